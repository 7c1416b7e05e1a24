"""Kubernetes sessions (docs/protocol.md §A1.3, `kind: k8s`): an HTTP proxy to the node's API server.

Every request is authenticated on its own: `Authorization: Bearer <session token>` must pass
`verify_session_token` for this session while the session is live (in the desired block, before `expires_at`).
The proxy then forwards it with the node's own credentials and the session's identity as impersonation headers
(`Impersonate-User`, one `Impersonate-Group` each); whatever the caller sent as `Authorization` or
`Impersonate-*` never reaches the API server.

The listener speaks TLS with the node's own certificate (`plexd.access.certificate`). A connection counts
against `max_connections` from its accept, before the TLS handshake: one over the cap is closed at once, so
silent connects cannot pile up file descriptors. Until its request is authenticated a connection is
"pre-authentication": it has `pre_auth_timeout` from the accept to send a head with a valid token, at most
`pre_auth_per_source` of one address are in the TLS handshake at once (the rest wait their turn), and when the
table is full a newcomer from an address with fewer such connections than the busiest address takes the slot of
that address's oldest one, so connects that never speak, from one address or several, never lock out a client
elsewhere. An authenticated connection that passes no byte either way for `connection_idle` is closed.

One request per connection (the upstream request says `Connection: close`, the client's connection closes after
the response), so no second request ever rides on the first one's authentication. The request line and every
header value are checked for control bytes (a bare LF would split the line for a lenient server), and the
session's impersonated user and groups for anything that cannot go into a header as it is
(`sessions.impersonation_problem`). After the request head the bytes pass untouched both ways: bodies, watch
streams, and protocol upgrades (exec, attach, port-forward over WebSocket or SPDY) alike. For an upgrade,
nothing more of the client's reaches the API server until it answered 101 (else a keep-alive server would read
the client's next bytes as a second request, unauthenticated), and the upgraded stream ends when either side
ends. Each request is reported as §A1.4 `k8s` activity (verb, resource, namespace, name, status, duration).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nacl.signing import VerifyKey

from plexd.access.activity import Report, emit
from plexd.access.lifetime import watch_lifetime
from plexd.access.token import TokenRefused, verify_session_token
from plexd.base.errors import PlexdError
from plexd.base.serving import idle_timeout, mesh_listener, only_from
from plexd.state.sessions_block import K8sTarget, Session, impersonation_problem

log = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
PRE_AUTH_TIMEOUT = 5.0  # from the accept to an authenticated head: a TLS handshake and a head, on any mesh path
# One address's TLS handshakes at once; more wait their turn (client-go sends its parallel discovery requests
# at once, each on its own connection here), so a burst is slowed, not refused.
PRE_AUTH_PER_SOURCE = 8
# An authenticated connection with no byte either way this long is closed (the session's idle_timeout when it has
# one): about when the API server ends a quiet watch by itself (30-60 min).
CONNECTION_IDLE = 1800.0
DIAL_TIMEOUT = 10.0
MAX_CONNECTIONS = 32
COPY_CHUNK = 1 << 16
IN_CLUSTER = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Dropped from the caller's request head: hop-by-hop headers and what the proxy sets itself. (Bodies pass as
# bytes, so Transfer-Encoding and Content-Length go through unchanged.)
_DROPPED = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "host", "authorization"}
_TOKEN_CHARS = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # in a field value (HTAB is allowed there, not in a target)



@dataclass(frozen=True)
class ApiServer:
    """Where the node's API server is and how the node authenticates to it."""

    url: str  # https://HOST:PORT (http:// only for a local test stand-in)
    token: str = field(default="", repr=False)
    ca_file: str | None = None

    @classmethod
    def in_cluster(cls, environ: dict[str, str] | None = None, root: Path = IN_CLUSTER) -> ApiServer | None:
        """The API server a pod sees: KUBERNETES_SERVICE_HOST/PORT and the service account's token and CA."""
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            return None
        try:
            token = (root / "token").read_text().strip()
        except OSError:
            return None
        shown = f"[{host}]" if ":" in host else host
        ca = root / "ca.crt"
        return cls(f"https://{shown}:{port}", token, str(ca) if ca.exists() else None)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https://"):
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.set_alpn_protocols(["http/1.1"])  # upgrades are HTTP/1.1 only
        return ctx


class BadRequest(PlexdError):
    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason
        super().__init__(reason)


@dataclass
class RequestHead:
    method: str
    target: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        lname = name.lower()
        return next((v for k, v in self.headers if k.lower() == lname), None)

    @property
    def upgrade(self) -> bool:
        connection = {t.strip().lower() for t in (self.get("connection") or "").split(",")}
        return "upgrade" in connection and self.get("upgrade") is not None


def parse_head(raw: bytes) -> RequestHead:
    """A request head (without the blank line), strictly: one request line, `Name: value` lines, no folding."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(400, "request head is not ASCII") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    # The request line goes up as it came: a bare LF or any other control byte in it is refused, never passed to
    # a server that might read it as the end of a line (and the rest as a header of the caller's).
    if len(parts) != 3 or not _TOKEN_CHARS.fullmatch(parts[0]):
        raise BadRequest(400, f"malformed request line {lines[0][:60]!r}: expected METHOD /TARGET HTTP/1.1")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(400, f"unsupported HTTP version {version[:16]!r}")
    if not target.startswith("/"):
        raise BadRequest(400, f"request target must start with '/', got {target[:60]!r}")
    if not target.isprintable():  # ASCII already: this is any byte below 0x20 or DEL
        raise BadRequest(400, f"request target has a control character: {target[:60]!r}")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, f"too many headers: {len(lines) - 1}, at most {MAX_HEADERS}")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN_CHARS.fullmatch(name):
            raise BadRequest(400, f"malformed header line {line[:40]!r}")
        if _CONTROL.search(value):
            raise BadRequest(400, f"header {name!r} has a control character")
        headers.append((name, value.strip()))
    return RequestHead(method, target, headers)


def activity(method: str, path: str, status: int, duration_ms: int) -> dict[str, Any]:
    """The §A1.4 k8s row of one request: verb and resource read from the method and the path."""
    segments = [s for s in urlsplit(path).path.split("/") if s]
    query = urlsplit(path).query
    if segments[:1] == ["api"]:
        rest = segments[2:]
    elif segments[:1] == ["apis"]:
        rest = segments[3:]
    else:
        rest = []
    namespace = ""
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    elif len(rest) == 2 and rest[0] == "namespaces":
        rest = ["namespaces", rest[1]]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else ""
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    watch = "watch=true" in query or "watch=1" in query
    verb = {"GET": "watch" if watch else ("get" if name else "list"), "POST": "create", "PUT": "update",
            "PATCH": "patch", "DELETE": "delete" if name else "deletecollection"}.get(method, method.lower())
    return {"k8s": {"verb": verb, "resource_kind": resource, "namespace": namespace, "name": name,
                    "status_code": status, "duration_ms": duration_ms}}


def _status_code(response: bytes) -> int:
    """The code of a response's status line (`HTTP/1.1 101 Switching Protocols`), 0 when there is none."""
    line = response.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) >= 2 and line[1].isdigit() and len(line[1]) == 3 else 0


def _content_length(response_head: bytes) -> int | None:
    """A response head's one Content-Length, or None (none, several, or not a number: read until the end)."""
    values = [line.split(b":", 1)[1].strip() for line in response_head.split(b"\r\n")[1:]
              if line[:15].lower() == b"content-length:"]
    return int(values[0]) if len(values) == 1 and values[0].isdigit() and len(values[0]) <= 18 else None


def _status(code: int, reason: str, message: str) -> bytes:
    import json

    body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "reason": reason, "code": code}).encode()
    phrase = {400: "Bad Request", 401: "Unauthorized", 429: "Too Many Requests", 431: "Request Header Fields Too "
              "Large", 502: "Bad Gateway", 503: "Service Unavailable"}.get(code, "Error")
    return (f"HTTP/1.1 {code} {phrase}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class K8sSession:
    """One session's proxy listener. `start()` binds `bind_host`:0; `close(reason)` ends it."""

    def __init__(self, session: Session, bind_host: str, api: ApiServer, *, tls: ssl.SSLContext,
                 keys: Callable[[], Iterable[VerifyKey]], is_live: Callable[[str], bool],
                 report: Report | None = None, now: Callable[[], float] = time.time,
                 max_connections: int = MAX_CONNECTIONS, pre_auth_timeout: float = PRE_AUTH_TIMEOUT,
                 pre_auth_per_source: int = PRE_AUTH_PER_SOURCE, connection_idle: float | None = None,
                 device: str | None = None) -> None:
        """`device`: the mesh interface, the only one the listener takes connections from (`mesh_listener`)."""
        if not isinstance(session.target, K8sTarget):
            raise ValueError(f"session {session.session_id} is a {session.kind} session, not k8s")
        # The block's parser refuses these already; a session built elsewhere must not reach the head either.
        for what, value in [("user", session.target.user), *(("group", g) for g in session.target.impersonate_groups)]:
            if problem := impersonation_problem(what, value):
                raise ValueError(f"session {session.session_id}: {problem}")
        self.session = session
        self.target: K8sTarget = session.target
        self.bind_host, self.device, self.api, self.tls = bind_host, device, api, tls
        self.device_index = 0  # the interface index the listener is bound to, once started
        self._keys, self._is_live, self._report, self._now = keys, is_live, report, now
        self.max_connections = max_connections
        self.pre_auth_timeout, self.pre_auth_per_source = pre_auth_timeout, pre_auth_per_source
        self.connection_idle = connection_idle or session.idle_timeout or CONNECTION_IDLE
        self._server: asyncio.base_events.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._sockets: dict[asyncio.Task[None], Any] = {}  # each connection's socket, for `rebind`
        self._pending: dict[asyncio.Task[None], str] = {}  # not yet authenticated, oldest first: task -> address
        self._handshakes: dict[str, asyncio.Semaphore] = {}  # per address with pending connections
        self.port = 0
        self.closed: str | None = None
        self.last_activity = now()
        self.requests = 0
        self.idle_closed = 0
        self.refused: dict[str, int] = {}
        self._ssl = api.ssl_context()
        split = urlsplit(api.url)
        self._upstream = (split.hostname or "", split.port or (443 if split.scheme == "https" else 80))
        self._host_header = split.netloc

    async def start(self) -> int:
        # TLS towards the caller too: client-go sends a bearer token over TLS only (and a client can pin the
        # proxy's certificate, plexd.access.certificate).
        # TLS is started per connection in _accepted, once it is counted (not by the server before it is).
        sock, self.device_index = mesh_listener(self.bind_host, self.device)
        self._server = await asyncio.start_server(self._accepted, sock=sock,
                                                  limit=MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        self._watch = asyncio.create_task(
            watch_lifetime(self.session, now=self._now, last_activity=lambda: self.last_activity,
                           closed=lambda: self.closed is not None, close=self.close),
            name=f"plexd:k8s-session:{self.session.session_id}")
        await self._emit({"k8s": {"phase": "session_started", "listener_endpoint": self.listener_endpoint}})
        log.info("k8s session %s proxying on %s:%d to %s", self.session.session_id, self.bind_host, self.port,
                 self.api.url, extra={"session_id": self.session.session_id})
        return self.port

    def _refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        source = str((writer.get_extra_info("peername") or ("?",))[0])
        if self.closed is not None:
            writer.close()
            return
        if len(self._conns) >= self.max_connections and not self._displace(source):
            self._refuse("capacity")  # closed before TLS: a flood of connects costs no handshake and no fd
            writer.close()
            return
        self._conns.add(task)
        self._pending[task] = source
        self._sockets[task] = writer.get_extra_info("socket")
        try:
            await self._serve(reader, writer, source)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            self._conns.discard(task)
            self._sockets.pop(task, None)
            self._pending.pop(task, None)
            if source not in self._pending.values():
                self._handshakes.pop(source, None)
            writer.close()

    def _displace(self, source: str) -> bool:
        """The table is full. A newcomer from an address with fewer unauthenticated connections than the busiest
        address takes the slot of that address's oldest one (True); else it is refused. So silent connects, from
        one address or several, never keep a client out of an address that is not flooding."""
        counts = Counter(self._pending.values())
        if not counts:
            return False  # every slot is an authenticated request
        busiest, most = counts.most_common(1)[0]
        if counts[source] >= most:
            return False
        oldest = next(t for t, s in self._pending.items() if s == busiest)
        del self._pending[oldest]
        self._conns.discard(oldest)
        oldest.cancel()
        self._refuse("displaced before authentication")
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str) -> None:
        gate = self._handshakes.setdefault(source, asyncio.Semaphore(self.pre_auth_per_source))
        try:
            async with asyncio.timeout(self.pre_auth_timeout):  # the turn, the handshake and the head, together
                async with gate:
                    await writer.start_tls(self.tls)
                raw = await reader.readuntil(b"\r\n\r\n")
            head = parse_head(raw[:-4])
        except TimeoutError:
            self._refuse("pre-authentication deadline")
            return
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            self._refuse("malformed")
            return
        except BadRequest as exc:
            self._refuse("malformed")
            writer.write(_status(exc.status, "BadRequest", exc.reason))
            await writer.drain()
            return
        why = self._authenticate(head)
        if why is not None:
            self._refuse(why)
            log.warning("k8s session %s: request refused: %s", self.session.session_id, why,
                        extra={"session_id": self.session.session_id})
            writer.write(_status(401, "Unauthorized", f"session token refused: {why}"))
            await writer.drain()
            return
        self._pending.pop(asyncio.current_task(), None)  # authenticated: out of the pre-authentication budget
        self.requests += 1
        self.last_activity = self._now()
        started = time.monotonic()
        try:
            async with asyncio.timeout(DIAL_TIMEOUT):
                up_reader, up_writer = await asyncio.open_connection(
                    *self._upstream, ssl=self._ssl, server_hostname=self._upstream[0] if self._ssl else None)
        except (OSError, TimeoutError) as exc:
            writer.write(_status(502, "BadGateway", f"cannot reach the API server: {exc or 'timeout'}"))
            await writer.drain()
            return
        status = [0]
        try:
            async with idle_timeout(self.connection_idle) as touch:  # touched by every byte either way
                up_writer.write(self._upstream_head(head))
                await up_writer.drain()
                if head.upgrade:
                    await self._relay_upgrade(reader, writer, up_reader, up_writer, status, touch)
                else:
                    await self._relay(reader, writer, up_reader, up_writer, status, touch)
        except TimeoutError:
            self.idle_closed += 1
        finally:
            up_writer.close()
            await self._emit(activity(head.method, head.target, status[0],
                                      int((time.monotonic() - started) * 1000)))

    def _authenticate(self, head: RequestHead) -> str | None:
        """None when the request carries a token for this live session; else the reason (never the token)."""
        auth = head.get("authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "no bearer token"
        if not self._is_live(self.session.session_id) or self.session.expired(self._now()):
            return "the session is no longer granted"
        try:
            verify_session_token(token.strip(), keys=self._keys(), session_id=self.session.session_id, kind="k8s",
                                 target=self.target.to_wire(), now=self._now())
        except TokenRefused as exc:
            return f"{exc.reason}: {exc.detail}"
        return None

    def _upstream_head(self, head: RequestHead) -> bytes:
        lines = [f"{head.method} {head.target} HTTP/1.1", f"Host: {self._host_header}"]
        for name, value in head.headers:
            lname = name.lower()
            if lname in _DROPPED or lname.startswith("impersonate-"):
                continue
            lines.append(f"{name}: {value}")
        if self.api.token:
            lines.append(f"Authorization: Bearer {self.api.token}")
        lines.append(f"Impersonate-User: {self.target.user}")
        lines.extend(f"Impersonate-Group: {g}" for g in self.target.impersonate_groups)
        # `close` for an upgrade too: a 101 hands the connection over anyway, any other answer must end it.
        lines.append("Connection: Upgrade, close" if head.upgrade else "Connection: close")
        # The caller's part is ASCII (parse_head); the impersonated names may be any UTF-8, as client-go sends them.
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, status: list[int] | None,
                    touch: Callable[[], None]) -> None:
        """Copy until EOF; `status` (the response's direction) gets the status line's code."""
        while data := await src.read(COPY_CHUNK):
            if status is not None and not status[0]:
                status[0] = _status_code(data)
            self.last_activity = self._now()
            touch()
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            with contextlib.suppress(OSError):
                dst.write_eof()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, status: list[int],
                     touch: Callable[[], None]) -> None:
        down = asyncio.ensure_future(self._pump(up_reader, writer, status, touch))
        up = asyncio.ensure_future(self._pump(reader, up_writer, None, touch))
        try:
            # The response decides: once the API server closes (it was asked to: Connection: close), the client's
            # side goes too.
            await down
        finally:
            up.cancel()
            await asyncio.gather(up, down, return_exceptions=True)

    async def _relay_upgrade(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter,
                             status: list[int], touch: Callable[[], None]) -> None:
        """An upgrade request (`Connection: Upgrade, close` went upstream): the response head first. Only a 101
        opens the client's direction; any other answer is relayed and the connection ends with it."""
        try:
            head = await up_reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            status[0] = 502
            writer.write(_status(502, "BadGateway", "the API server's response head is too large"))
            await writer.drain()
            return
        status[0] = _status_code(head)
        writer.write(head)
        await writer.drain()
        self.last_activity = self._now()
        touch()
        if status[0] != 101:  # the response's body, then the end; the client's further bytes are never read
            length = _content_length(head)
            if length is None:
                await self._pump(up_reader, writer, None, touch)  # until the server closes (it was asked to)
            else:  # a server that ignored `close` must not hold the client after the body
                with contextlib.suppress(asyncio.IncompleteReadError):
                    while length > 0:
                        data = await up_reader.readexactly(min(length, COPY_CHUNK))
                        length -= len(data)
                        touch()
                        writer.write(data)
                        await writer.drain()
            return
        down = asyncio.ensure_future(self._pump(up_reader, writer, None, touch))
        up = asyncio.ensure_future(self._pump(reader, up_writer, None, touch))
        try:
            # Either side ending ends the stream: an exec whose kubectl went away must not hold the API server's
            # stream (and this session's connection slot) until the remote process next writes.
            await asyncio.wait((down, up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)

    async def _emit(self, body: dict[str, Any]) -> None:
        await emit(self._report, self.session.session_id, "k8s", body)

    async def close(self, reason: str) -> None:
        if self.closed is not None:
            return
        self.closed = reason
        if self._server is not None:
            self._server.close()
        conns = list(self._conns)
        if self._watch is not None and self._watch is not asyncio.current_task():
            conns.append(self._watch)
        for t in conns:
            t.cancel()
        await asyncio.gather(*conns, return_exceptions=True)
        log.info("k8s session %s ended (%s)", self.session.session_id, reason,
                 extra={"session_id": self.session.session_id})
        await self._emit({"k8s": {"phase": "session_ended", "terminated_by": reason}})

    def listening_sockets(self) -> list[Any]:
        """The listener's sockets (the sessions domain marks them for the firewall's session rules)."""
        return list(self._server.sockets) if self._server is not None and self.closed is None else []

    def rebind(self, index: int) -> None:
        """The mesh interface was recreated (index `index`): the listener and its connections take what arrives on
        the new one (`plexd.base.serving.only_from`), keeping the port and the connections. OSError: not done."""
        for sock in [*self.listening_sockets(), *(s for s in self._sockets.values() if s is not None)]:
            only_from(sock, index)
        self.device_index = index

    @property
    def listener_endpoint(self) -> str:
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        return f"{host}:{self.port}"

    def status(self) -> dict[str, Any]:
        return {"session_id": self.session.session_id, "kind": "k8s", "listener_endpoint":
                f"{self.bind_host}:{self.port}", "requests": self.requests, "refused": dict(self.refused),
                "connections": len(self._conns), "unauthenticated": len(self._pending),
                "idle_closed": self.idle_closed, "closed": self.closed}
