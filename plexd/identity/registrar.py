"""Registration: find the bootstrap token, register with retries, persist the identity (docs/protocol.md §5).

Token sources, first non-empty wins (§5.1): ``token.value`` → ``token.file`` (missing file skipped; any other
read error is fatal) → the environment variable named by ``token.env`` → the metadata service (only when
``token.use_metadata``). Values are whitespace-trimmed; the winning value must be ≤ 512 bytes of printable ASCII
(0x20–0x7E) or registration stops (no falling through to the next source).

`Registrar.ensure_registered` reuses a valid identity without a request; a corrupt one is reported and replaced
by a fresh registration. ``POST /v1/register`` is retried with `plexd.base.backoff.Backoff` (1 s ×2 → 60 s, ±25 %) on
network errors, 5xx and unlisted statuses, waits ``Retry-After`` on 429, and gives up after
``registration.max_wait``. 400/401/403/404/409 stop at once with a message saying what the operator should do.
After success the token is removed from where it was kept: the token file is deleted when the token came from it,
and ``token.value`` is taken out of the config file (`plexd.config.edit`) when it was written there, so a spent
token does not stay in a file that is usually 0644. A config file holding a token and readable by others is
warned about before registering.

`Registrar.recover` is the 401 path (docs/decisions.md, Re-registration): reload the identity from disk;
re-register with the node secret as bearer, the same public key and an empty token; if that is refused and a
bootstrap token is available, register afresh. The identity is never deleted on a 401.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from plexd.base.backoff import Backoff
from plexd.base.clock import Clock
from plexd.base.errors import PlexdError
from plexd.base.failpoint import failpoint
from plexd.base.gojson import format_duration
from plexd.base.log import fingerprint
from plexd.base.wgkeys import b64, decode_key, generate_private_key, public_key_of
from plexd.config.settings import Config
from plexd.controlplane import http_client
from plexd.controlplane.client import ControlPlaneClient, RegisterRequest
from plexd.controlplane.client_errors import (
    AuthError,
    BadResponseError,
    ControlPlaneError,
    PermanentError,
    RetryAfterError,
)
from plexd.controlplane.platform_calls import project_from_token
from plexd.identity.identity_store import Identity, IdentityStore, node_secret
from plexd.state.model import RegisterResponse

log = logging.getLogger(__name__)

MAX_TOKEN_BYTES = 512
TOKEN_FILE_LIMIT = 64 * 1024  # what is read of a token's file or metadata answer (a token is checked after)
METADATA_TIMEOUT = 2.0
METADATA_DEADLINE = 10.0  # both requests of the IMDS flow, however slowly a server drips its answer


class TokenError(PlexdError):
    """No usable bootstrap token."""


class RegistrationError(PlexdError):
    """The control plane refused the registration, or could not be reached in time."""

    def __init__(self, message: str, status: int = 0) -> None:
        self.status = status
        super().__init__(message)


@dataclass(frozen=True)
class BootstrapToken:
    value: str
    source: str  # "config", "file", "env", "metadata", "prompt"
    where: str = ""  # the file path or variable name, for messages

    def __repr__(self) -> str:
        return f"BootstrapToken(source={self.source!r}, where={self.where!r}, {fingerprint(self.value)})"


def validate_token(value: str, origin: str) -> str:
    value = value.strip()
    raw = value.encode("utf-8", errors="surrogateescape")
    if len(raw) > MAX_TOKEN_BYTES:
        raise TokenError(f"bootstrap token from {origin} is {len(raw)} bytes long; the limit is {MAX_TOKEN_BYTES} "
                         "(was the wrong file given?)")
    bad = next((i for i, b in enumerate(raw) if not 0x20 <= b <= 0x7E), None)
    if bad is not None:
        raise TokenError(f"bootstrap token from {origin} contains a non-printable or non-ASCII byte "
                         f"(0x{raw[bad]:02x} at offset {bad}); copy the token again")
    return value


def read_token_file(path: str) -> str | None:
    """The file's content, None if it does not exist; other errors name the path and errno."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(TOKEN_FILE_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TokenError(f"cannot read bootstrap token file {path}: {exc.strerror or exc} (errno {exc.errno})") \
            from None
    return data.decode("utf-8", errors="surrogateescape")


async def _metadata_token(base_url: str) -> str | None:
    """IMDS flow of §5.1: session token (IMDSv2) if the service gives one, then the plexd token. Any failure
    means "source unavailable"."""
    base = base_url.rstrip("/")
    try:
        async with http_client.HTTPClient(connect_timeout=METADATA_TIMEOUT, read_timeout=METADATA_TIMEOUT,
                                     write_timeout=METADATA_TIMEOUT) as http, asyncio.timeout(METADATA_DEADLINE):
            headers = {}
            try:
                status, text = await _metadata_get(http, "PUT", f"{base}/latest/api/token",
                                                   {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
                if status == 200 and text.strip():
                    headers["X-aws-ec2-metadata-token"] = text.strip()
            except http_client.RequestFailed:
                pass  # IMDSv1 fallback: ask without a session token
            status, text = await _metadata_get(http, "GET", f"{base}/plexd/bootstrap-token", headers)
            if status != 200:
                log.info("metadata service has no bootstrap token (HTTP %d)", status)
                return None
            return text
    except http_client.RequestFailed as exc:
        log.info("metadata service at %s unavailable: %s", base, exc)
        return None
    except TimeoutError:
        log.info("metadata service at %s unavailable: no answer within %.0f s", base, METADATA_DEADLINE)
        return None


async def _metadata_get(http: http_client.HTTPClient, method: str, url: str,
                        headers: Mapping[str, str]) -> tuple[int, str]:
    """(status, body text) of one metadata request; the body capped as a token file is."""
    async with http.stream(method, url, headers=headers) as response:
        body = await response.aread(TOKEN_FILE_LIMIT)
        return response.status_code, body.decode("utf-8", errors="replace")


async def resolve_token(
    config: Config,
    env: Mapping[str, str] | None = None,
    *,
    token_file: str | None = None,
    token_env: str | None = None,
) -> BootstrapToken | None:
    """The first non-empty token source, validated; None when every source is empty. `token_file` and
    `token_env` (from ``plexd join``) replace the configured file and variable."""
    env = os.environ if env is None else env
    t = config.token
    if t.value.strip():
        return BootstrapToken(validate_token(t.value, "token.value"), "config", "token.value")
    path = token_file or t.file
    if path:
        content = read_token_file(path)
        if token_file and content is None:
            raise TokenError(f"bootstrap token file {path} does not exist")
        if content is not None and content.strip():
            return BootstrapToken(validate_token(content, f"file {path}"), "file", path)
        if token_file:
            raise TokenError(f"bootstrap token file {path} is empty")
    var = token_env or t.env
    if var:
        value = env.get(var, "")
        if value.strip():
            return BootstrapToken(validate_token(value, f"environment variable {var}"), "env", var)
        if token_env:
            raise TokenError(f"environment variable {var} is not set or empty")
    if t.use_metadata:
        value = await _metadata_token(t.metadata_url)
        if value and value.strip():
            return BootstrapToken(validate_token(value, f"metadata service {t.metadata_url}"), "metadata",
                                  t.metadata_url)
    return None


def no_token_message(config: Config) -> str:
    return (f"no bootstrap token: write it to {config.token.file}, set {config.token.env}, or run "
            "'plexd join --token-file FILE' (ask the control-plane admin for a token)")


def refusal_message(status: int, server_message: str, *, api: str, hostname: str, reregister: bool = False) -> str:
    """What a refused registration means for the operator (§1.3 statuses)."""
    said = f" (server said: {server_message})" if server_message else ""
    if status == 400:
        return (f"the control plane rejected the registration request as malformed (HTTP 400){said}; "
                "check registration.hostname and registration.metadata, and that plexd matches the control plane")
    if status == 401:
        if reregister:
            return f"the control plane no longer accepts this node's secret (HTTP 401){said}"
        return (f"bootstrap token refused (HTTP 401){said}: it is unknown, expired or already used — "
                "create a new token and run 'plexd join' again")
    if status == 403:
        return (f"registration forbidden (HTTP 403){said}: this token may not register nodes here; "
                "check the token with the control-plane admin")
    if status == 404:
        return (f"{api}/v1/register does not exist (HTTP 404){said}: check that api points at a plexd "
                "control plane")
    if status == 409:
        return (f"a node named {hostname!r} is already registered (HTTP 409){said}; set registration.hostname "
                "to another name or deregister the old node")
    if status in (0, 200) and server_message:  # refused by plexd itself: the answer is the other contract's
        return f"registration stopped: {server_message}"
    return f"registration refused (HTTP {status}){said}"


_FATAL = (400, 401, 403, 404, 409, 422)


def _said(exc: ControlPlaneError) -> str:
    """The server's reason, with the platform contract's error code when it sent one."""
    return f"{exc.code}: {exc.message}" if exc.code and exc.message else exc.code or exc.message


class Registrar:
    def __init__(
        self,
        config: Config,
        client: ControlPlaneClient,
        store: IdentityStore | None = None,
        *,
        clock: Clock | None = None,
        capabilities: Callable[[], Mapping[str, Any] | None] | None = None,
        env: Mapping[str, str] | None = None,
        rand: Callable[[], float] = random.random,
        hostname: Callable[[], str] = socket.gethostname,
        wait_retry: Callable[[int, ControlPlaneError, float, float], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        # (attempt, error, delay, seconds left): waits out a retry delay; `plexd join` shows a countdown with it
        self._wait_retry = wait_retry
        self.posting = False  # a register request is on the wire: its answer spends the token and must be saved
        self.client = client
        self.store = store or IdentityStore(config.data_dir)
        self.clock = clock or Clock()
        self._capabilities = capabilities or (lambda: None)
        self._env = os.environ if env is None else env
        self._rand = rand
        self._hostname = hostname

    def hostname(self) -> str:
        return self.config.registration.hostname or self._hostname()

    async def ensure_registered(
        self, *, token_file: str | None = None, token_env: str | None = None,
        prompt: Callable[[], str] | None = None,
    ) -> tuple[Identity, bool]:
        """The node's identity and whether it was registered just now. Reuses a valid identity on disk."""
        loaded = self.store.load()
        if loaded.identity is not None:
            self._adopt_dialect(loaded.identity)
            self.client.set_token(loaded.identity.bearer)
            self._note_secret_mode(loaded.identity)
            log.info("using the stored identity", extra={"node_id": loaded.identity.node_id,
                                                          "mesh_ip": loaded.identity.mesh_ip})
            return loaded.identity, False
        if loaded.problem:
            log.warning("stored identity in %s is unusable (%s); treating the node as not registered",
                        self.store.data_dir, loaded.problem, extra={"component": "identity"})
        token = await self.find_token(token_file=token_file, token_env=token_env, prompt=prompt)
        if token is None:
            why = (f"the stored identity in {self.store.data_dir} is unusable ({loaded.problem}) and there is "
                   if loaded.problem else "")
            raise TokenError(why + no_token_message(self.config))
        return await self.register(token), True

    def _adopt_dialect(self, identity: Identity) -> None:
        """A registered node speaks the contract it registered with; a config naming the other is overruled, and
        says so (switching contracts takes a new registration)."""
        configured = self.config.api.dialect
        if configured not in ("auto", identity.dialect):
            log.warning("api.dialect is %s, but this node registered with the %s contract and keeps speaking it; "
                        "deregister and register again to switch", configured, identity.dialect,
                        extra={"component": "identity"})
        self.client.adopt_dialect(identity.dialect)

    @staticmethod
    def _note_secret_mode(identity: Identity) -> None:
        if identity.bearer == identity.node_secret_key:  # the secret itself is the bearer: say so once
            node_secret.note_mode(identity.node_secret_kdf)

    async def find_token(
        self, *, token_file: str | None = None, token_env: str | None = None, prompt: Callable[[], str] | None = None
    ) -> BootstrapToken | None:
        """The configured sources (with `plexd join`'s overrides), then the prompt when there is one."""
        token = await resolve_token(self.config, self._env, token_file=token_file, token_env=token_env)
        if token is None and prompt is not None:
            value = prompt()
            if value.strip():
                token = BootstrapToken(validate_token(value, "the prompt"), "prompt")
        return token

    async def register(self, token: BootstrapToken, private_key: bytes | None = None) -> Identity:
        """A fresh registration with `token` (a new keypair unless `private_key` is given)."""
        self.config.require_api()
        self.store.ensure_writable()  # before the token is spent
        # The key is on disk before the token is spent: plexd killed between the answer and its save asks again
        # with the same token and key. A control plane that repeats a registration for the same token and key
        # answers with the same identity (the devplane does, for 5 minutes; the protocol does not require it: a
        # plexd extension, docs/protocol.md), where a new key would find the token spent.
        private_key = private_key or self.store.registering_key(token.value) or generate_private_key()
        self.store.write_registering_key(private_key, token.value)
        request = RegisterRequest(
            token=token.value,
            public_key=b64(public_key_of(private_key)),
            hostname=self.hostname(),
            metadata=self.config.registration.metadata or None,
            capabilities=self._capabilities(),
            node_secret_kdf=node_secret.HKDF_SHA256,
            project_id=self.config.registration.project_id or project_from_token(token.value),
            resource_handle=self.config.registration.resource_handle or self.hostname(),
        )
        log.info("registering with the control plane", extra={"api": self.client.base_url,
                                                               "token": fingerprint(token.value),
                                                               "token_source": token.source})
        in_config_file = token.source == "config" and self.config.source_of("token.value").startswith("file ")
        if in_config_file:
            self._warn_if_readable(self.config.config_file)
        try:
            identity = await self._post(request, bearer=token.value, private_key=private_key, reregister=False)
        except RegistrationError as exc:
            if exc.status in _FATAL:  # refused for good: the next try, with this token or another, gets a new key
                self.store.drop_registering_key()
            raise
        if token.source == "file":
            try:
                os.unlink(token.where)
                log.info("deleted the used bootstrap token file %s", token.where)
            except OSError as exc:
                log.warning("could not delete the used bootstrap token file %s: %s", token.where, exc.strerror)
        elif in_config_file and self.config.config_file:
            self._forget_config_token(self.config.config_file)
        return identity

    @staticmethod
    def _warn_if_readable(path: str | None) -> None:
        try:
            mode = os.stat(path).st_mode & 0o777 if path else 0
        except OSError:
            return
        if mode & 0o077:
            log.warning("the bootstrap token is in %s, which is mode %04o (readable by others); it is removed "
                        "from the file once the node is registered. Keep tokens in token.file (0600) instead",
                        path, mode)

    @staticmethod
    def _forget_config_token(path: str) -> None:
        """A spent token has no business in a config file (often 0644): take token.value out of it."""
        from plexd.base.errors import ConfigError
        from plexd.config.edit import remove_token_value

        try:
            if remove_token_value(path):
                log.info("removed the used bootstrap token (token.value) from %s", path)
        except (ConfigError, OSError) as exc:
            log.warning("the used bootstrap token is still in %s: %s", path, exc)

    async def reregister(self, identity: Identity) -> Identity:
        """Re-register a known node: node secret as bearer, the same public key, an empty token."""
        self.store.ensure_writable()
        request = RegisterRequest(token="", public_key=identity.public_key, hostname=self.hostname(),
                                  metadata=self.config.registration.metadata or None,
                                  capabilities=self._capabilities(), node_secret_kdf=node_secret.HKDF_SHA256,
                                  confirms=RegisterResponse(
                                      node_id=identity.node_id, mesh_ip=identity.mesh_ip,
                                      signing_public_key=identity.signing_public_key,
                                      node_secret_key=identity.node_secret_key,
                                      node_secret_kdf=identity.node_secret_kdf,
                                      signing_key_id=identity.signing_key_id,
                                      domain_mesh_cidr=identity.domain_mesh_cidr))
        log.info("re-registering with the stored identity", extra={"node_id": identity.node_id})
        return await self._post(request, bearer=identity.bearer, private_key=identity.private_key,
                                reregister=True)

    async def recover(
        self, current: Identity | None, *, token_file: str | None = None, token_env: str | None = None,
        prompt: Callable[[], str] | None = None,
    ) -> Identity:
        """After a 401 (or `plexd join` on a registered node): adopt a newer identity from disk, else re-register
        with the node secret, else register afresh with a bootstrap token. Never deletes the identity."""
        loaded = self.store.load()
        if loaded.identity is not None and current is not None and (
            loaded.identity.node_secret_key != current.node_secret_key or loaded.identity.node_id != current.node_id
        ):
            log.info("identity on disk changed; using it", extra={"node_id": loaded.identity.node_id})
            self._adopt_dialect(loaded.identity)
            self.client.set_token(loaded.identity.bearer)
            return loaded.identity
        base = loaded.identity or current
        if base is not None:
            self._adopt_dialect(base)
        refused: RegistrationError | None = None
        if base is not None:
            try:
                return await self.reregister(base)
            except RegistrationError as exc:
                if exc.status not in _FATAL:
                    raise
                log.warning("re-registration refused: %s", exc, extra={"node_id": base.node_id})
                refused = exc
        token = await self.find_token(token_file=token_file, token_env=token_env, prompt=prompt)
        if token is None:
            why = f"{refused}; " if refused else ""
            raise RegistrationError(f"{why}{no_token_message(self.config)}", refused.status if refused else 0)
        return await self.register(token)

    async def _post(self, request: RegisterRequest, *, bearer: str, private_key: bytes, reregister: bool) -> Identity:
        api = self.client.base_url
        max_wait = self.config.registration.max_wait
        backoff = Backoff(base=1.0, cap=60.0, jitter=0.25, rand=self._rand)
        started = self.clock.monotonic()
        attempts = 0
        while True:
            attempts += 1
            try:
                self.posting = True
                try:
                    resp = await self.client.register(request, token=bearer)
                finally:
                    self.posting = False
                decode_key(resp.signing_public_key, "signing_public_key in the register response")
                kdf = node_secret.check(resp.node_secret_kdf or None, "the register response")
                break
            except ValueError as exc:
                # Checked before saving (the Go agent saves first, and then every restart fails).
                raise RegistrationError(f"the control plane at {api} sent an unusable identity: {exc}") from None
            except (AuthError, PermanentError) as exc:
                raise RegistrationError(refusal_message(exc.status, _said(exc), api=api, hostname=request.hostname,
                                                        reregister=reregister), exc.status) from None
            except RetryAfterError as exc:
                delay = backoff.after_hint(exc.retry_after)
                last: ControlPlaneError = exc
            except ControlPlaneError as exc:
                if exc.status in _FATAL and not isinstance(exc, BadResponseError):
                    raise RegistrationError(refusal_message(exc.status, _said(exc), api=api,
                                                            hostname=request.hostname, reregister=reregister),
                                            exc.status) from None
                delay = backoff.next_delay()
                last = exc
            elapsed = self.clock.monotonic() - started
            if elapsed + delay > max_wait:
                raise RegistrationError(
                    f"could not register with the control plane at {api} within "
                    f"{format_duration(max_wait)} ({attempts} attempts); last error: {last}. "
                    "Check that the address is right and reachable, or raise registration.max_wait"
                ) from None
            log.warning("registration attempt %d failed: %s; retrying in %.1fs", attempts, last, delay,
                        extra={"component": "registrar"})
            if self._wait_retry is not None:
                await self._wait_retry(attempts, last, delay, max_wait - elapsed)
            else:
                await self.clock.sleep(delay)
        identity = Identity(node_id=resp.node_id, mesh_ip=resp.mesh_ip, signing_public_key=resp.signing_public_key,
                            node_secret_key=resp.node_secret_key, private_key=private_key, node_secret_kdf=kdf,
                            dialect=self.client.dialect, signing_key_id=resp.signing_key_id,
                            domain_mesh_cidr=resp.domain_mesh_cidr)
        failpoint("register.answered")
        self.store.save(identity)
        self.client.set_token(identity.bearer)
        self._note_secret_mode(identity)
        log.info("registered", extra={"node_id": identity.node_id, "mesh_ip": identity.mesh_ip,
                                      "node_secret": fingerprint(identity.node_secret_key)})
        return identity

