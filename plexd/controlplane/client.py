"""HTTP client for the control plane: every endpoint of docs/protocol.md §1.2, byte-compatible with the Go agent.

Usage::

    async with ControlPlaneClient("https://cp.example", token=bootstrap_token) as cp:
        resp = await cp.register(RegisterRequest(token=..., public_key=..., hostname=...))
        cp.set_token(resp.node_secret_key)          # bearer switching: bootstrap token → node secret
        state = await cp.fetch_state(resp.node_id)  # plexd.state.model.State

Transport rules (§1.1): ``User-Agent: plexd/<version>``, ``Accept: application/json``, ``Accept-Encoding: gzip``,
``Content-Type: application/json`` only when a body is sent, request bodies larger than 1024 bytes gzipped with
``Content-Encoding: gzip``, response bodies capped at 10 MiB. Connect timeout 10 s; every normal call has a 30 s
total deadline. Path parameters are escaped like Go's ``url.PathEscape`` (``/`` → ``%2F``). TLS is verified by
default (``ca_file`` adds a trust root; ``insecure_skip_verify`` is for labs only); minimum TLS 1.2.

Errors are the typed exceptions of `plexd.controlplane.client_errors` (transient / auth / retry-after / permanent);
``Retry-After`` is read as integer seconds or an HTTP-date.

For the SSE stream (events engineer): ``async with cp.open_event_stream(node_id, last_event_id, read_timeout=90)
as response:`` yields the open, status-checked `plexd.controlplane.http_client.Response` (headers ``Accept:
text/event-stream``, ``Cache-Control: no-cache``, ``Last-Event-ID`` when given). There is no total deadline on the
body; the optional `read_timeout` raises a "read timed out" `TransportError` after that many idle seconds. Read its
frames with `plexd.controlplane.sse.read_events`. A non-2xx status raises the typed error before the body is read.

Request bodies with a fixed [C] shape have builders here (`RegisterRequest`, `HeartbeatRequest`, ...); the
open-ended ones (drift, results, metrics, logs, audit, capabilities) take a ready JSON-able dict/list from the
service that owns them and are sent as-is with Go escaping.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import logging
import re
import ssl
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from plexd import __version__
from plexd.base import boundedjson
from plexd.base.errors import WireFormatError
from plexd.base.gojson import EncodedJSON, format_time, go_marshal
from plexd.controlplane import http_client, platform_actions, platform_calls, release_store
from plexd.controlplane.answers import HeartbeatResponse, PeerEndpoint, SecretResponse, path_escape
from plexd.controlplane.client_errors import (
    AuthError,
    BadResponseError,
    ControlPlaneError,
    PermanentError,
    RetryAfterError,
    TransientError,
)
from plexd.controlplane.problem import parse_problem
from plexd.state.model import Peer, RegisterResponse, State
from plexd.state.model import _fields as _object  # Go's lenient decoding: case-insensitive keys


class _Tls(Protocol):
    ca_file: str
    insecure_skip_verify: bool


class _Api(Protocol):
    url: str
    tls: _Tls
    dialect: str


class HasApi(Protocol):
    """What `for_config` reads of a `plexd.config.settings.Config` (the adapter does not import the config)."""

    api: _Api

log = logging.getLogger(__name__)

GZIP_THRESHOLD = 1024  # bytes; larger request bodies are gzipped (§1.1)
# Not Go's default 6: on the JSON plexd sends (a minute of metrics at 1,000 peers is ~1 MiB) level 1 takes half
# the CPU for ~11 % more bytes, and the body is still a twentieth of its size. Any gzip reader takes either.
GZIP_LEVEL = 1
INGEST_ROUTES = ("/metrics", "/logs", "/audit")  # the only platform routes that take a gzipped body
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_RESPONSE_BYTES = 10 * 1024 * 1024  # decompressed response cap (§1.1)
MAX_ERROR_BYTES = 4096  # the Go agent keeps the first 4 KiB of an error body
CONNECT_TIMEOUT = 10.0
REQUEST_TIMEOUT = 30.0

JSON = Any
Batch = Sequence[Mapping[str, JSON]] | EncodedJSON  # telemetry entries, or the JSON array the queue already holds


# ---------------------------------------------------------------------------------------------------------------
# Request bodies with a fixed wire shape


@dataclass(frozen=True)
class RegisterRequest:
    """``POST /v1/register`` (§1.3). `metadata` and `capabilities` are omitted when empty (omitempty)."""

    token: str = field(repr=False)  # the bootstrap token: never in a repr
    public_key: str
    hostname: str
    metadata: Mapping[str, str] | None = None
    capabilities: Mapping[str, JSON] | None = None
    # The key derivation the node offers (plexd.identity.node_secret); omitted when empty. A Go control plane
    # ignores it.
    node_secret_kdf: str = ""
    # The platform contract's fields (not sent to a spec control plane): the project and resource the node joins
    # as, and the registration's nonce, the same on every retry of this one registration.
    project_id: str = ""
    resource_handle: str = ""
    nonce: str = field(default_factory=lambda: platform_calls.new_nonce())
    # A re-registration: the identity it confirms. The platform has no re-registration; an authenticated call
    # answered confirms the identity as it is.
    confirms: RegisterResponse | None = field(default=None, repr=False)

    def to_wire(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {"token": self.token, "public_key": self.public_key, "hostname": self.hostname}
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        if self.capabilities:
            out["capabilities"] = dict(self.capabilities)
        if self.node_secret_kdf:
            out["node_secret_kdf"] = self.node_secret_kdf
        return out


@dataclass(frozen=True)
class MeshInfo:
    interface: str
    peer_count: int
    listen_port: int

    def to_wire(self) -> dict[str, JSON]:
        return {"interface": self.interface, "peer_count": self.peer_count, "listen_port": self.listen_port}


@dataclass(frozen=True)
class NatInfo:
    public_endpoint: str
    type: str  # none | full_cone | symmetric | unknown — note: "type" here, "nat_type" in the endpoint report

    def to_wire(self) -> dict[str, JSON]:
        return {"public_endpoint": self.public_endpoint, "type": self.type}


@dataclass(frozen=True)
class HeartbeatRequest:
    """``POST /v1/nodes/{id}/heartbeat`` (§1.4): `uptime` a Go duration string, `binary_checksum` bare hex.

    `extra` carries the optional bridge/user_access/ingress/site_to_site objects verbatim (omitted when absent).
    """

    node_id: str
    timestamp: datetime
    status: str
    uptime: str
    binary_checksum: str
    mesh: MeshInfo | None = None
    nat: NatInfo | None = None
    extra: Mapping[str, JSON] = field(default_factory=dict)
    status_reason: str = ""  # why `status` is degraded; ours (a Go control plane ignores an unknown key)

    def to_wire(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {
            "node_id": self.node_id,
            "timestamp": format_time(self.timestamp),
            "status": self.status,
            "uptime": self.uptime,
            "binary_checksum": self.binary_checksum,
        }
        if self.status_reason:
            out["status_reason"] = self.status_reason
        if self.mesh is not None:
            out["mesh"] = self.mesh.to_wire()
        if self.nat is not None:
            out["nat"] = self.nat.to_wire()
        for key in ("bridge", "user_access", "ingress", "site_to_site", "paths"):
            if self.extra.get(key) is not None:
                out[key] = self.extra[key]
        return out


# ---------------------------------------------------------------------------------------------------------------
# The client

def _array(entries: Batch) -> JSON:
    return entries if isinstance(entries, EncodedJSON) else [dict(e) for e in entries]


def _parse_body(what: str, data: bytes) -> JSON:
    """A 2xx answer's JSON body, bounded; a clear error naming the request otherwise."""
    if not data.strip():
        raise BadResponseError(what, 200, "empty response body (expected a JSON object)")
    try:
        return boundedjson.loads(data)
    except WireFormatError as exc:
        raise BadResponseError(what, 200, f"response is not JSON we can read: {exc}") from None


SPEC, PLATFORM = "spec", "platform"


MAX_ETAG = 256  # an ETag is an opaque short string; a longer one is not sent back


@dataclass(frozen=True)
class _PulledState:
    path: str
    etag: str
    digest: bytes
    state: State


class ControlPlaneClient:
    def __init__(
        self,
        base_url: str,
        *,
        token: str = "",
        ca_file: str = "",
        insecure_skip_verify: bool = False,
        user_agent: str = f"plexd/{__version__}",
        request_timeout: float = REQUEST_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
        now: Any = None,
        dialect: str = "spec",
        release_url: str = "",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.release_url = release_url  # platform: where releases are published (upgrade.release_url)
        self._releases: http_client.HTTPClient | None = None  # platform: the release store's, made on first use
        self._connect_timeout = connect_timeout
        # The contract spoken (plexd.controlplane.dialect): "spec" or "platform"; "auto" until the registration
        # or the stored identity settles it. Only the wire layer looks at it.
        self.dialect = dialect
        self._published: dict[str, str] = {}  # platform: the status reports as last sent (key → value)
        self._reachability = platform_calls.Reachability()
        self._executions = platform_actions.Statuses()  # platform: each listed execution's status
        self._guessed = False  # the dialect is auto's guess, not yet confirmed by an answer
        self._token = token
        self.user_agent = user_agent
        self.request_timeout = request_timeout
        self._now = now or (lambda: datetime.now(UTC))  # for HTTP-date Retry-After
        self._last_state: _PulledState | None = None  # the last state answer, for conditional pulls
        self._http = http_client.HTTPClient(tls=_tls_context(ca_file, insecure_skip_verify),
                                       connect_timeout=connect_timeout, read_timeout=request_timeout,
                                       write_timeout=request_timeout)

    @classmethod
    def for_config(cls, config: HasApi, *, token: str = "", dialect: str = "") -> ControlPlaneClient:
        """A client for ``config.api`` (URL and TLS settings). Callers that need a URL check `require_api` first;
        without one, calls fail as unreachable rather than at construction."""
        return cls(config.api.url or "http://unconfigured.invalid", token=token, ca_file=config.api.tls.ca_file,
                   insecure_skip_verify=config.api.tls.insecure_skip_verify,
                   dialect=dialect or getattr(config.api, "dialect", "spec"),  # a registered node's: its identity's
                   release_url=getattr(getattr(config, "upgrade", None), "release_url", ""))

    # -- lifecycle and auth -------------------------------------------------------------------------------------

    async def __aenter__(self) -> ControlPlaneClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._releases is not None:
            await self._releases.aclose()

    def _release_http(self) -> http_client.HTTPClient:
        """The release store's client (platform): the system's trust store, whatever CA the control plane has."""
        if self._releases is None:
            self._releases = http_client.HTTPClient(tls=http_client.default_tls_context(),
                                                    connect_timeout=self._connect_timeout,
                                                    read_timeout=self.request_timeout,
                                                    write_timeout=self.request_timeout)
        return self._releases

    def artifacts_problem(self) -> str:
        """Why no release can be fetched at all ("" when one may be): a platform node with no release store."""
        return release_store.MISSING if self.platform and not self.release_url else ""

    @property
    def token(self) -> str:
        return self._token

    @property
    def platform(self) -> bool:
        return self.dialect == PLATFORM

    @property
    def registration_carries_capabilities(self) -> bool:
        """Whether the register request announced the capabilities (the platform's has no such field: they are
        announced with ``PUT /capabilities`` after it)."""
        return not self.platform

    def adopt_dialect(self, dialect: str) -> None:
        """Speak the contract a registered node registered with (its identity's)."""
        self.dialect, self._guessed = dialect, False

    def guess_dialect(self, bootstrap_token: str) -> str:
        """With ``api.dialect: auto``, the contract to register with, from the bootstrap token's form: the
        platform's tokens are ``psb_<env>_<project>_<kind>_<random>``. The answer has the last word (`register`)."""
        if self.dialect not in (SPEC, PLATFORM) or self._guessed:
            self.dialect = PLATFORM if platform_calls.project_from_token(bootstrap_token) else SPEC
            self._guessed = True
        return self.dialect

    def set_token(self, token: str) -> None:
        """Switch the bearer: the bootstrap token before registration, the node secret after it."""
        self._token = token

    def _headers(self, token: str | None = None) -> dict[str, str]:
        headers = {"User-Agent": self.user_agent, "Accept": "application/json", "Accept-Encoding": "gzip"}
        bearer = self._token if token is None else token
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        return headers

    # -- the transport core -------------------------------------------------------------------------------------

    async def _call(
        self, method: str, path: str, body: JSON = None, *, has_body: bool = False, token: str | None = None,
        what: str = "",
    ) -> bytes:
        """Send one request and return the (decompressed, capped) response body of a 2xx; raise typed errors."""
        return (await self._exchange(method, path, body, has_body=has_body, token=token, what=what))[2]

    async def _exchange(
        self, method: str, path: str, body: JSON = None, *, has_body: bool = False, token: str | None = None,
        what: str = "", extra_headers: Mapping[str, str] | None = None, also_ok: Collection[int] = (),
    ) -> tuple[int, http_client.Headers, bytes]:
        """`_call`, answering (status, headers, body); a status in `also_ok` (a 304) is an answer, not an error."""
        what = what or f"{method} {path}"
        headers = {**self._headers(token), **(extra_headers or {})}
        content: bytes | None = None
        if has_body:
            content = body if isinstance(body, bytes) else _utf8(go_marshal(body))  # bytes: sent as they are
            headers.setdefault("Content-Type", "application/json")
            # The platform reads raw bytes everywhere but its three ingest routes (docs/platform-dialect.md).
            if len(content) > GZIP_THRESHOLD and (not self.platform or path.endswith(INGEST_ROUTES)):
                content = gzip.compress(content, compresslevel=GZIP_LEVEL)
                headers["Content-Encoding"] = "gzip"
        url = self.base_url + path
        try:
            async with asyncio.timeout(self.request_timeout):
                response = await self._http.send(method, url, headers=headers, content=content)
                try:
                    data = await _read_capped(response, what)
                finally:
                    await response.aclose()
        except TimeoutError:
            raise TransientError(f"{what} to {self.base_url}",
                                 message=f"no complete answer within {self.request_timeout:g}s") from None
        except http_client.TransportError as exc:
            raise TransientError(f"{what} to {self.base_url}", message=str(exc)) from None
        except http_client.DecodingError as exc:
            # A body labelled gzip that is not: not a TransportError, and without this it escapes as a traceback.
            raise BadResponseError(what, response.status_code, f"response body cannot be decoded: {exc}") from None
        if not 200 <= response.status_code < 300 and response.status_code not in also_ok:
            raise self._status_error(what, response.status_code, data, response.headers)
        return response.status_code, response.headers, data

    def _status_error(self, what: str, status: int, body: bytes, headers: http_client.Headers) -> ControlPlaneError:
        problem = parse_problem(headers.get("Content-Type", ""), body[:MAX_ERROR_BYTES], headers)
        message = problem.message or _error_message(body[:MAX_ERROR_BYTES])
        if problem.correlation_id:
            message += f" (correlation id {problem.correlation_id})"
        error = self._classified(what, status, message, headers, problem.code)
        error.problem = problem.is_problem
        return error

    def _classified(self, what: str, status: int, message: str, headers: http_client.Headers,
                    code: str) -> ControlPlaneError:
        if status == 401:
            return AuthError(what, status, message, code)
        if status == 429 or (status == 503 and "Retry-After" in headers):  # a server shedding load says when
            return RetryAfterError(what, status, message, parse_retry_after(headers.get("Retry-After"), self._now()),
                                   code)
        if status in (403, 404):
            return PermanentError(what, status, message, code)
        return TransientError(what, status, message, code)

    async def _json(self, method: str, path: str, body: JSON = None, *, has_body: bool = False,
                    token: str | None = None, what: str = "") -> JSON:
        what = what or f"{method} {path}"
        return _parse_body(what, await self._call(method, path, body, has_body=has_body, token=token, what=what))

    # -- §1.2 endpoints -------------------------------------------------------------------------------------------

    async def register(self, request: RegisterRequest, *, token: str | None = None) -> RegisterResponse:
        """#1 ``POST /v1/register``. The bearer is `token` if given (the bootstrap token, or the node secret for a
        re-registration), else the client's current token."""
        self.guess_dialect(request.token)
        try:
            answer = await self._register(request, token)
        except ControlPlaneError as exc:
            # A refusal says which contract the server speaks (the platform's errors are problem+json) and
            # spends no token in either: a wrong guess is asked again, once, in the other dialect. Nothing heard
            # (the network, a 5xx, a 429) confirms nothing: the retry guesses again.
            answered = 400 <= exc.status < 500 and exc.status != 429
            answered_in = PLATFORM if exc.problem else SPEC
            if not (self._guessed and answered and answered_in != self.dialect):
                self._guessed = self._guessed and not answered
                raise
            log.info("the control plane answered the registration in the %s contract; registering with it",
                     answered_in, extra={"dialect": answered_in})
            self.adopt_dialect(answered_in)
            return await self._register(request, token)
        self._guessed = False
        return answer

    async def _register(self, request: RegisterRequest, token: str | None) -> RegisterResponse:
        what = "registration (POST /v1/register)"
        if self.platform:
            return await platform_calls.register(self, request, request.token, token)
        doc = await self._json("POST", "/v1/register", request.to_wire(), has_body=True, token=token, what=what)
        if isinstance(doc, dict) and "nsk" in doc and "node_secret_key" not in doc:
            raise PermanentError(what, 200, "the answer is the platform contract's (nsk, no node_secret_key); "
                                            "set api.dialect: platform")
        return _typed(what, RegisterResponse.from_wire, doc)

    async def heartbeat(self, node_id: str, request: HeartbeatRequest | Mapping[str, JSON]) -> HeartbeatResponse:
        """#3 ``POST /v1/nodes/{id}/heartbeat``."""
        body = request.to_wire() if isinstance(request, HeartbeatRequest) else dict(request)
        if self.platform:
            return await platform_calls.heartbeat(self, node_id, body, self._published)
        what = "heartbeat"
        doc = await self._json("POST", f"/v1/nodes/{path_escape(node_id)}/heartbeat", body, has_body=True, what=what)
        f = _typed(what, _object, doc, "response")
        for key in ("reconcile", "rotate_keys"):
            if f.get(key) is not None and not isinstance(f[key], bool):
                raise BadResponseError(what, 200, f"{key} must be a boolean")
        return HeartbeatResponse(reconcile=bool(f.get("reconcile")), rotate_keys=bool(f.get("rotate_keys")))

    async def deregister(self, node_id: str, *, purge: bool = False) -> None:
        """#4 ``POST /v1/nodes/{id}/deregister`` with no body (and so no Content-Type). `purge` adds
        ``?purge=true``, which tells a control plane that knows it (ours) that the node will not come back with
        its secret; the Go control plane ignores the query."""
        if self.platform:
            log.info("the platform contract has no deregistration call: the node is removed locally only; remove "
                     "it in the platform too")
            return
        query = "?purge=true" if purge else ""
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/deregister{query}", what="deregister")

    async def rotate_keys(self, node_id: str, new_public_key: str) -> list[Peer]:
        """#5 ``POST /v1/keys/rotate`` → the updated peers."""
        if self.platform:
            return await platform_calls.rotate_keys(self, new_public_key)
        what = "key rotation (POST /v1/keys/rotate)"
        doc = await self._json("POST", "/v1/keys/rotate", {"node_id": node_id, "new_public_key": new_public_key},
                               has_body=True, what=what)
        return _typed(what, _peer_list, doc, "updated_peers")

    async def put_capabilities(self, node_id: str, capabilities: Mapping[str, JSON]) -> None:
        """#6 ``PUT /v1/nodes/{id}/capabilities`` (body from `plexd.trust.integrity.capabilities_document`)."""
        if self.platform:
            return await platform_calls.put_capabilities(self, node_id, capabilities)
        await self._call("PUT", f"/v1/nodes/{path_escape(node_id)}/capabilities", dict(capabilities),
                         has_body=True, what="capabilities announcement")

    async def report_endpoint(self, node_id: str, public_endpoint: str, nat_type: str) -> list[PeerEndpoint]:
        """#7 ``PUT /v1/nodes/{id}/endpoint`` → the NAT-discovered endpoints of peers."""
        if self.platform:  # the platform answers a receipt: peers' endpoints come in the state
            await platform_calls.report_endpoint(self, node_id, public_endpoint, nat_type)
            return []
        what = "endpoint report"
        doc = await self._json("PUT", f"/v1/nodes/{path_escape(node_id)}/endpoint",
                               {"public_endpoint": public_endpoint, "nat_type": nat_type}, has_body=True, what=what)
        return _typed(what, _peer_endpoints, doc)

    async def fetch_state(self, node_id: str) -> State:
        """#8 ``GET /v1/nodes/{id}/state``. An unchanged state costs next to nothing: the request carries the last
        answer's ``ETag`` (``If-None-Match``) and a 304 reuses the state parsed then; without ETags, a body with the
        same digest as the last one is not parsed again."""
        what = "state fetch"
        path = f"/v1/nodes/{path_escape(node_id)}/state"
        last = self._last_state if self._last_state is not None and self._last_state.path == path else None
        conditional = {"If-None-Match": last.etag} if last is not None and last.etag else None
        status, headers, data = await self._exchange("GET", path, what=what, extra_headers=conditional,
                                                     also_ok=(304,) if conditional else ())
        if status == 304 and last is not None:
            return last.state
        digest = hashlib.sha256(data).digest()
        if last is not None and last.digest == digest:
            return last.state
        doc = _parse_body(what, data)
        if self.platform:
            self._reachability.note(doc)
            self._executions.note(doc)
        state = _typed(what, platform_calls.parse_state if self.platform else State.from_wire, doc)
        etag = headers.get("ETag", "")
        self._last_state = _PulledState(path, etag if len(etag) <= MAX_ETAG else "", digest, state)
        return state

    async def report_drift(self, node_id: str, report: Mapping[str, JSON]) -> None:
        """#9 ``POST /v1/nodes/{id}/drift``: ``{"timestamp": ..., "corrections": [{"type","detail"}...]}``."""
        if self.platform:  # the platform has no drift report: the corrections are in the node's log and status
            return
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/drift", dict(report), has_body=True,
                         what="drift report")

    async def fetch_secret(self, node_id: str, key: str) -> SecretResponse:
        """#10 ``GET /v1/nodes/{id}/secrets/{key}``."""
        if self.platform:
            return await platform_calls.fetch_secret(self, node_id, key)
        what = f"secret fetch ({key})"
        doc = await self._json("GET", f"/v1/nodes/{path_escape(node_id)}/secrets/{path_escape(key)}", what=what)
        return _typed(what, _secret, doc)

    async def sync_reports(self, node_id: str, entries: Sequence[Mapping[str, JSON]], deleted: Sequence[str]) -> None:
        """#11 ``POST /v1/nodes/{id}/report``: both keys always present, ``null`` when empty (§1.12)."""
        if self.platform:
            return await platform_calls.sync_reports(self, node_id, entries, deleted)
        body = {"entries": [dict(e) for e in entries] or None, "deleted": list(deleted) or None}
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/report", body, has_body=True,
                         what="report sync")

    async def ack_execution(self, node_id: str, execution_id: str, status: str, reason: str = "") -> None:
        """#12 ``POST .../executions/{eid}/ack``: status ``accepted`` or ``rejected``; reason always present."""
        if self.platform:
            return await platform_actions.acknowledge(self, node_id, execution_id, status, reason,
                                                       self._executions.of(execution_id))
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/executions/{path_escape(execution_id)}/ack",
                         {"execution_id": execution_id, "status": status, "reason": reason}, has_body=True,
                         what="execution ack")

    async def report_result(self, node_id: str, execution_id: str, result: Mapping[str, JSON]) -> None:
        """#13 ``POST .../executions/{eid}/result`` (body shape §1.13, built by the action dispatcher)."""
        if self.platform:
            return await platform_actions.report_result(self, node_id, execution_id, result)
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/executions/{path_escape(execution_id)}/result",
                         dict(result), has_body=True, what="execution result")

    async def report_session_activity(self, node_id: str, session_id: str, activity: Mapping[str, JSON]) -> None:
        """``POST /v1/nodes/{id}/sessions/{sid}`` (docs/protocol.md §A1.4): exactly one of ssh, k8s, tcp."""
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/sessions/{path_escape(session_id)}",
                         dict(activity), has_body=True, what="session activity report")

    async def send_metrics(self, node_id: str, points: Batch) -> None:
        """#14 ``POST /v1/nodes/{id}/metrics``: a JSON array."""
        if self.platform:
            return await platform_calls.ingest(self, node_id, "metrics", points)
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/metrics", _array(points), has_body=True,
                         what="metrics batch")

    async def send_logs(self, node_id: str, entries: Batch) -> None:
        """#15 ``POST /v1/nodes/{id}/logs``: a JSON array."""
        if self.platform:
            return await platform_calls.ingest(self, node_id, "logs", entries)
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/logs", _array(entries), has_body=True,
                         what="logs batch")

    async def send_audit(self, node_id: str, entries: Batch) -> None:
        """#16 ``POST /v1/nodes/{id}/audit``: a JSON array."""
        if self.platform:
            return await platform_calls.ingest(self, node_id, "audit", entries)
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/audit", _array(entries), has_body=True,
                         what="audit batch")

    @contextlib.asynccontextmanager
    async def open_artifact(self, version: str, os_name: str, arch: str) -> AsyncIterator[http_client.Response]:
        """#17 ``GET /v1/artifacts/plexd/{version}/{os}/{arch}``: yields the streamed response (raw bytes). The
        platform serves none: the release comes from `release_url` (plexd.controlplane.release_store)."""
        if self.platform:  # the platform's nodes fetch releases where they are published, not from it
            async with release_store.open_release(self._release_http(), self.release_url, self.user_agent, version,
                                                  os_name, arch) as response:
                yield response
            return
        path = f"/v1/artifacts/plexd/{path_escape(version)}/{path_escape(os_name)}/{path_escape(arch)}"
        async with self._stream("GET", path, self._headers(), "artifact download", read_timeout=None) as response:
            yield response

    async def tunnel_ready(self, node_id: str, session_id: str, listen_addr: str, timestamp: datetime) -> None:
        """#18 ``POST .../tunnels/{sid}/ready``."""
        if self.platform:  # the platform learns a session's state from the session activity reports
            return
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/tunnels/{path_escape(session_id)}/ready",
                         {"listen_addr": listen_addr, "timestamp": format_time(timestamp)}, has_body=True,
                         what="tunnel ready report")

    async def tunnel_closed(self, node_id: str, session_id: str, reason: str, duration: str,
                            timestamp: datetime) -> None:
        """#19 ``POST .../tunnels/{sid}/closed``: reason ``revoked|expired|shutdown``, duration a Go string."""
        if self.platform:
            return
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/tunnels/{path_escape(session_id)}/closed",
                         {"reason": reason, "duration": duration, "timestamp": format_time(timestamp)},
                         has_body=True, what="tunnel closed report")

    async def report_integrity_violation(
        self, node_id: str, *, kind: str, path: str, expected_checksum: str, actual_checksum: str, detail: str,
        timestamp: datetime,
    ) -> None:
        """#20 ``POST /v1/nodes/{id}/integrity/violations``; `kind` is ``hook`` or ``binary``, timestamp in UTC."""
        if self.platform:
            return await platform_calls.report_integrity_violation(
                self, node_id, kind=kind, path=path, expected_checksum=expected_checksum,
                actual_checksum=actual_checksum)
        body = {"type": kind, "path": path, "expected_checksum": expected_checksum,
                "actual_checksum": actual_checksum, "detail": detail, "timestamp": format_time(timestamp)}
        await self._call("POST", f"/v1/nodes/{path_escape(node_id)}/integrity/violations", body, has_body=True,
                         what="integrity violation report")

    async def ping(self) -> None:
        """#21 ``GET /v1/ping`` (platform: ``GET /v1/health``): a cheap reachability check."""
        if self.platform:
            await self._call("GET", "/v1/health", token="", what="health check")
            return
        await self._call("GET", "/v1/ping", what="ping")

    @contextlib.asynccontextmanager
    async def open_event_stream(
        self, node_id: str, last_event_id: str = "", *, read_timeout: float | None = None
    ) -> AsyncIterator[http_client.Response]:
        """#2 ``GET /v1/nodes/{id}/events``: yields the open SSE response; see the module docstring."""
        headers = self._headers()
        headers["Accept"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        async with self._stream("GET", f"/v1/nodes/{path_escape(node_id)}/events", headers, "event stream",
                                read_timeout=read_timeout) as response:
            yield response

    @contextlib.asynccontextmanager
    async def _stream(self, method: str, path: str, headers: dict[str, str], what: str,
                      read_timeout: float | None) -> AsyncIterator[http_client.Response]:
        """A streamed request with a connect deadline but no total deadline on the body."""
        try:
            response = await self._http.send(method, self.base_url + path, headers=headers, read_timeout=read_timeout)
        except http_client.TransportError as exc:
            raise TransientError(f"{what} to {self.base_url}", message=str(exc)) from None
        try:
            if not 200 <= response.status_code < 300:
                try:
                    async with asyncio.timeout(self.request_timeout):
                        body = await _read_capped(response, what, MAX_ERROR_BYTES, truncate=True)
                except (TimeoutError, http_client.RequestFailed, ControlPlaneError):
                    body = b""
                raise self._status_error(what, response.status_code, body, response.headers)
            yield response
        finally:
            await response.aclose()


# ---------------------------------------------------------------------------------------------------------------
# Helpers


def _tls_context(ca_file: str, insecure: bool) -> ssl.SSLContext:
    if insecure:
        return http_client.unverified_tls_context()
    if not ca_file:
        # the system's trust store, built once and shared by the API client and every event-stream client
        return http_client.default_tls_context()
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        from plexd.base.errors import ConfigError

        raise ConfigError(f"api.tls.ca_file: cannot load CA certificates from {ca_file}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


async def _read_capped(response: http_client.Response, what: str, limit: int = MAX_RESPONSE_BYTES, *,
                       truncate: bool = False) -> bytes:
    """The (decompressed) body, at most `limit` bytes: beyond it, an error, or the first `limit` bytes when
    `truncate` (error bodies only need their start)."""
    try:
        return await response.aread(limit, truncate=truncate)
    except http_client.BodyTooLarge as exc:
        raise BadResponseError(what, response.status_code, str(exc)) from None


def _error_message(body: bytes) -> str:
    """The server's short reason: the ``error`` field of a JSON error body, else the text itself."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        doc = boundedjson.parse(text)
    except ValueError:
        return text
    if isinstance(doc, dict):
        for key in ("error", "message"):
            if isinstance(doc.get(key), str):
                return doc[key]
    return text


RETRY_AFTER_CAP = 86400.0


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """``Retry-After`` as integer seconds or an HTTP-date → seconds from `now` (never negative); None if absent
    or unreadable."""
    if not value:
        return None
    value = value.strip()[:64]  # an HTTP-date is 29 characters; a longer header is not one we can read
    if value.isascii() and value.isdigit():
        # Any number of digits is valid HTTP; more than a day is not advice we can follow (and a huge integer
        # would overflow a float).
        return float(min(int(value[:12]), RETRY_AFTER_CAP))
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - now).total_seconds()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return min(max(0.0, seconds), RETRY_AFTER_CAP)


def _typed(what: str, parse: Any, doc: JSON, *args: Any) -> Any:
    try:
        return parse(doc, *args)
    except WireFormatError as exc:
        raise BadResponseError(what, 200, str(exc)) from None


def _peer_list(doc: JSON, key: str) -> list[Peer]:
    items = _null_default(_object(doc, "response").get(key), [])
    if not isinstance(items, list):
        raise WireFormatError(key, "must be an array")
    return [Peer.from_wire(p, f"{key}[{i}]") for i, p in enumerate(items)]


def _peer_endpoints(doc: JSON) -> list[PeerEndpoint]:
    items = _null_default(_object(doc, "response").get("peer_endpoints"), [])
    if not isinstance(items, list):
        raise WireFormatError("peer_endpoints", "must be an array")
    out = []
    for i, item in enumerate(items):
        f = _object(item, f"peer_endpoints[{i}]")
        peer_id, endpoint = _null_default(f.get("peer_id"), ""), _null_default(f.get("endpoint"), "")
        if not isinstance(peer_id, str) or not isinstance(endpoint, str):
            raise WireFormatError(f"peer_endpoints[{i}]", "peer_id and endpoint must be strings")
        out.append(PeerEndpoint(peer_id=peer_id, endpoint=endpoint))
    return out


def _secret(doc: JSON) -> SecretResponse:
    f = _object(doc, "response")
    texts = {key: _null_default(f.get(key), "") for key in ("key", "ciphertext", "nonce")}
    for key, value in texts.items():
        if not isinstance(value, str):
            raise WireFormatError(key, "must be a string")
    version = _null_default(f.get("version"), 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise WireFormatError("version", "must be an integer")
    return SecretResponse(version=version, **texts)


def _null_default(value: JSON, default: JSON) -> JSON:
    """Go decodes JSON null (or an absent key) into the zero value."""
    return default if value is None else value


def _utf8(text: str) -> bytes:
    """`text` as UTF-8; each lone surrogate (from outside input: `json.loads` of ``"\udc80"``) becomes one U+FFFD,
    what Go's decoder makes of it, instead of failing the request forever. Strict first: a megabyte of metrics is
    one pass."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text).encode()
