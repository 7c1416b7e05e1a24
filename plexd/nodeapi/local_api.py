"""The daemon's local socket: HTTP/1.1 over a Unix socket, every request tagged with the caller's credentials.

Built on h11 (python-hyper's HTTP/1.1 state machine, the one uvicorn runs on, already loaded by httpx) and
``asyncio.start_unix_server``, because the server must see the connecting socket to read ``SO_PEERCRED``:
uvicorn does not pass the transport to the application, and aiohttp (which does) costs 13 MiB of resident
memory and 140 ms of start-up in a daemon that runs in 56 MiB (measured: ``python -c 'import httpx,
aiohttp.web'`` vs ``import httpx``). The routes are a table of (method, path prefix) → handler, each with the
privilege it needs; the node API (§8) adds its routes to the same table.

Socket: a stale socket is removed at start (a live one means another daemon: refused), the parent directory is
created 0755, the socket is ``0660 root:plexd`` when group ``plexd`` exists, else ``0600`` with a warning —
never world-writable — and it is removed at stop.

Optional TCP listener (`listen_tcp`, the node API's ``node_api.http_enabled``): the same routes that are marked
``tcp=True`` (the §8 node API, never the daemon's control routes), each request with ``Authorization: Bearer
<token>`` compared in constant time, else ``401 {"error":"unauthorized"}``. TCP callers are strangers until the
token says otherwise, so the listener is built to cost little whatever they do:

- the token is checked as soon as the request head is parsed, and a 401 is sent before one byte of the body is
  read; the head must arrive within `header_timeout` (a few seconds), or the connection is closed;
- TCP connections have a budget of their own (`tcp_max_connections`, small), counted apart from the socket's:
  a flood of TCP clients is refused at the door and never takes a slot the root socket needs;
- 401s are limited per source address (`AUTH_FAILURE_BURST`, refilled at `AUTH_FAILURE_RATE`): past that, the
  address's new connections are answered 429 at once, unread.

Fair use, on both: a token bucket per client (uid, or TCP address) answers 429 when it is empty; a request must
arrive whole within `request_timeout` (else 408 and the connection is closed); bodies are capped at 1 MiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hmac
import json
import logging
import os
import pwd
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11

from plexd.base.errors import PlexdError
from plexd.base.ratelimit import RateLimiter

log = logging.getLogger(__name__)

SOCKET_GROUP = "plexd"
MAX_BODY = 1 << 20
MAX_HEADERS = 16 << 10
REQUEST_TIMEOUT = 10.0  # a whole request (or an idle keep-alive connection): a slow client cannot hold a slot
RATE_LIMIT_TARPIT = 0.25
MAX_CONNECTIONS = 64  # a runaway script cannot take every file descriptor the daemon needs for the mesh
ROOT_RESERVE = 8  # beyond MAX_CONNECTIONS, for root alone: a group member's hogs never lock out `plexd status`
TCP_MAX_CONNECTIONS = 16  # TCP's own budget, never the socket's: unauthenticated strangers get a small door
HEADER_TIMEOUT = 5.0  # on TCP the request head (with its token) must arrive within this
AUTH_FAILURE_BURST = 10  # 401s per source address before it is refused at the door ...
AUTH_FAILURE_RATE = 0.2  # ... refilled at one every 5 s
REFUSAL_LOG_INTERVAL = 60.0  # a flood at the door is one log line a minute, not one per connection


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+: the peer's supplementary groups


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int
    peer_groups: tuple[int, ...] | None = None  # SO_PEERGROUPS, when the kernel gives them

    def groups(self) -> set[int]:
        """Primary and supplementary groups of the peer: the process's own (SO_PEERGROUPS, what it really holds),
        else its user's in the user database (as `id` shows)."""
        gids = {self.gid}
        if self.peer_groups is not None:
            return gids | set(self.peer_groups)
        try:
            gids.update(os.getgrouplist(pwd.getpwuid(self.uid).pw_name, self.gid))
        except (KeyError, OSError):
            pass
        return gids

    def in_group(self, name: str) -> bool:
        try:
            return grp.getgrnam(name).gr_gid in self.groups()
        except KeyError:
            return False


def peer_cred(sock: socket.socket) -> PeerCred | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid, _peer_groups(sock))


def _peer_groups(sock: socket.socket) -> tuple[int, ...] | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
    except OSError:  # ERANGE (more than 256 groups) or an old kernel: the user database decides
        return None
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str] = field(repr=False)  # Authorization carries the TCP token: never in a repr
    body: bytes = field(repr=False)
    cred: PeerCred | None
    via: str = "unix"  # "unix" (cred from SO_PEERCRED) or "tcp" (authenticated by the bearer token)
    remote: str = ""  # the TCP client's address

    @property
    def client(self) -> tuple[str, Any]:
        """Who this is, for the rate limit: the uid on the socket, the address on TCP."""
        if self.via == "tcp":
            return ("tcp", self.remote)
        return ("uid", self.cred.uid if self.cred else None)

    def json(self) -> Any:
        if not self.body.strip():
            return {}
        from plexd.base import boundedjson

        try:
            return boundedjson.loads(self.body, "body")
        except PlexdError as exc:
            raise LocalAPIError(400, str(exc)) from None


@dataclass
class Response:
    status: int = 200
    body: Any = field(default=None, repr=False)  # JSON document, or bytes/str as they are (a secret's value too)
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    # Sent chunk by chunk as it comes (chunked transfer encoding) instead of `body`: streamed action output.
    stream: AsyncIterator[bytes] | None = None

    def encoded(self) -> bytes:
        if self.body is None and self.status == 204:
            return b""
        if isinstance(self.body, bytes):
            return self.body
        if isinstance(self.body, str) and self.content_type != "application/json":
            return self.body.encode()
        return (json.dumps(self.body, separators=(",", ":")) + "\n").encode()


class LocalAPIError(PlexdError):
    """Raised by a handler: answered with `status` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Refused(PlexdError):
    """The request cannot be read to its end (too slow, too large, unauthorized): answer `response` and close.
    `linger`: read what the client still sends for a moment first (never for a stranger on TCP)."""

    def __init__(self, response: Response, *, linger: bool = True) -> None:
        self.response = response
        self.linger = linger


Handler = Callable[[Request], Awaitable[Response]]
Authorize = Callable[[Request], str | None]  # None = allowed; else the refusal message


def require_admin(admin_group: str) -> Authorize:
    """The daemon's own control routes: uid 0 or a member of `admin_group`."""

    def check(req: Request) -> str | None:
        cred = req.cred
        if cred is None:
            return "forbidden: peer credentials unavailable"
        if cred.uid == 0 or cred.in_group(admin_group):
            return None
        return f"forbidden: needs root or membership of group {admin_group}"

    return check


def anyone(req: Request) -> str | None:
    return None


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # exact path, or a prefix ending in "/" that matches anything below it
    handler: Handler
    authorize: Authorize
    tcp: bool = False  # also served on the TCP listener


class LocalAPI:
    def __init__(self, socket_path: str, *, group: str = SOCKET_GROUP, request_timeout: float = REQUEST_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, rate_limit: RateLimiter | None = None,
                 tcp_max_connections: int = TCP_MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT,
                 auth_failures: RateLimiter | None = None) -> None:
        self.socket_path = socket_path
        self.group = group
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self.rate_limit = rate_limit or RateLimiter(0, 1)
        self.tcp_max_connections = tcp_max_connections
        self.header_timeout = min(header_timeout, request_timeout)
        self.auth_failures = auth_failures or RateLimiter(AUTH_FAILURE_RATE, AUTH_FAILURE_BURST)
        self.tcp_refused = 0  # TCP connections turned away at the door (budget full, or too many 401s)
        self._tcp_connections: set[asyncio.Task[Any]] = set()
        self._refusal_logged = -REFUSAL_LOG_INTERVAL
        self._refused_since_log = 0
        self.routes: list[Route] = []
        self._server: asyncio.base_events.Server | None = None
        self._tcp_server: asyncio.base_events.Server | None = None
        self._tcp_token = b""
        self.tcp_address: tuple[str, int] | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._in_flight = 0  # requests read and not yet answered
        self._answered = asyncio.Event()  # set whenever no request is in flight
        self._answered.set()

    def add(self, method: str, path: str, handler: Handler, authorize: Authorize = anyone, *,
            tcp: bool = False) -> None:
        self.routes.append(Route(method, path, handler, authorize, tcp))

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        path = self.socket_path
        parent = os.path.dirname(path) or "."
        try:
            os.makedirs(parent, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise PlexdError(f"node_api.socket_path: cannot create {parent}: {exc.strerror}") from None
        _remove_stale(path)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path, limit=MAX_HEADERS)
        except OSError as exc:
            raise PlexdError(f"node_api.socket_path: cannot listen on {path}: {exc.strerror}") from None
        self._secure(path)
        log.info("local API listening on %s", path)

    async def listen_tcp(self, host: str, port: int, token: str) -> None:
        """The node API on TCP too, for callers that cannot reach the socket (containers). `token` must not be
        empty: an unauthenticated TCP listener would hand the node's secrets to anyone who can connect."""
        if not token:
            raise PlexdError("node_api.http_token_file: the token is empty; the TCP listener needs a bearer token")
        self._tcp_token = token.encode()
        try:
            self._tcp_server = await asyncio.start_server(self._serve_tcp, host, port, limit=MAX_HEADERS)
        except OSError as exc:
            raise PlexdError(f"node_api.http_listen: cannot listen on {host}:{port}: {exc.strerror}") from None
        self.tcp_address = self._tcp_server.sockets[0].getsockname()[:2]
        log.info("node API listening on %s:%d (TCP, bearer token)", *self.tcp_address)

    def _secure(self, path: str) -> None:
        try:
            gid = grp.getgrnam(self.group).gr_gid
        except KeyError:
            os.chmod(path, 0o600)
            log.warning("group %s does not exist: the local socket %s is 0600 (root only); create the group "
                        "to let its members use the node API", self.group, path)
            return
        try:
            # The group only: under the unit plexd has no CAP_CHOWN and may give its file to a group it is in
            # (SupplementaryGroups=plexd).
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
        except OSError as exc:  # not root (tests), or a group the unit does not give plexd: owner-only is safe
            os.chmod(path, 0o600)
            log.warning("cannot give %s to group %s (%s): socket is 0600 (under systemd, the unit's "
                        "SupplementaryGroups= must name the group)", path, self.group, exc.strerror)

    async def stop(self, grace: float = 0.0) -> None:
        """Stop listening; give requests being answered up to `grace` seconds (the answer to `plexd
        deregister` is written after the teardown), then close every connection and remove the socket."""
        servers = [s for s in (self._server, self._tcp_server) if s is not None]
        for server in servers:
            server.close()
        if grace > 0 and not self._answered.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._answered.wait()
        connections = self._connections | self._tcp_connections
        for task in connections:
            task.cancel()
        if connections:
            await asyncio.wait(connections, timeout=2)
        for server in servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)
        self._server = self._tcp_server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    # -- one connection -----------------------------------------------------------------------------------------

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        remote = str(peer[0]) if peer else ""
        # Refused at the door, unread: a stranger waiting here would hold the slot it is refused for.
        if len(self._tcp_connections) >= self.tcp_max_connections:
            self._refuse_at_door(writer, remote, Response(503, {"error": "too many TCP connections to the node API"},
                                                          headers={"connection": "close"}), "the TCP budget is full")
            return
        if self.auth_failures.blocked(("tcp", remote)):
            self._refuse_at_door(writer, remote, Response(429, {"error": "too many unauthorized requests from "
                                                                          f"{remote}; retry later"},
                                                          headers={"connection": "close", "retry-after": "5"}),
                                 "too many 401s from it")
            return
        task = asyncio.current_task()
        if task is not None:
            self._tcp_connections.add(task)
        try:
            await self._serve(reader, writer, via="tcp", remote=remote)
        finally:
            if task is not None:
                self._tcp_connections.discard(task)

    def _refuse_at_door(self, writer: asyncio.StreamWriter, remote: str, response: Response, why: str) -> None:
        self.tcp_refused += 1
        self._refused_since_log += 1
        now = asyncio.get_running_loop().time()
        if now - self._refusal_logged >= REFUSAL_LOG_INTERVAL:
            log.warning("node API (TCP): refused %d connection(s) (latest from %s: %s; %d TCP connections open)",
                        self._refused_since_log, remote or "unknown peer", why, len(self._tcp_connections))
            self._refusal_logged, self._refused_since_log = now, 0
        conn = _Connection(h11.SERVER)
        with contextlib.suppress(Exception):  # best effort: the answer goes into the send buffer, never awaited
            conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # h11 answers only a request it has seen
            conn.next_event()
            writer.write(self._encode(conn, response))
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, via: str = "unix",
                     remote: str = "") -> None:
        task = asyncio.current_task()
        sock = writer.get_extra_info("socket")
        cred = peer_cred(sock) if sock is not None and via == "unix" else None
        conn = _Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADERS)
        limit = self.max_connections + (ROOT_RESERVE if cred is not None and cred.uid == 0 else 0)
        if via == "unix" and len(self._connections) >= limit:
            log.warning("local API: %d connections open, refusing one more from %s", len(self._connections),
                        _who(cred, remote))
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):  # take the request first, so the client reads our answer
                    await reader.read(65536)
            with contextlib.suppress(Exception):
                await self._send(conn, writer, Response(503, {"error": "too many connections to the local API"},
                                                        headers={"connection": "close"}))
            writer.close()
            return
        if task is not None and via == "unix":  # TCP connections are counted in their own budget (_serve_tcp)
            self._connections.add(task)
        authenticated = via == "unix"  # the socket's callers are known by SO_PEERCRED; TCP's by their token
        try:
            while True:
                try:
                    request = await self._read_request(conn, reader, cred, via, remote, authenticated)
                except _Refused as refused:
                    with contextlib.suppress(Exception):
                        await self._send(conn, writer, refused.response)
                        if refused.linger:
                            await _linger(reader, writer)
                    break
                if request is None:
                    break
                authenticated = True
                self._in_flight += 1
                self._answered.clear()
                try:
                    response = await self._dispatch(request)
                    await self._send(conn, writer, response)
                finally:
                    self._in_flight -= 1
                    if not self._in_flight:
                        self._answered.set()
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    break
        except _SlowReader:
            log.warning("local API: %s did not read its answer within %gs while every connection slot was "
                        "taken; connection dropped", _who(cred, remote), self.request_timeout)
            writer.transport.abort()  # close() would wait for the unread bytes to drain, for ever
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, h11.LocalProtocolError):
            pass
        except asyncio.CancelledError:
            # stop() ends open connections so. Ended here, not re-raised: asyncio's own done-callback of a
            # connection task asks a cancelled one for its exception, and logs the CancelledError it gets as an
            # error with a traceback (Python 3.11), once per connection open at every stop.
            pass
        except h11.RemoteProtocolError as exc:
            with contextlib.suppress(Exception):
                await self._send(conn, writer, Response(exc.error_status_hint, {"error": f"bad request: {exc}"}))
        finally:
            if task is not None:
                self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_request(self, conn: _Connection, reader: asyncio.StreamReader, cred: PeerCred | None,
                            via: str = "unix", remote: str = "", authenticated: bool = True) -> Request | None:
        head: h11.Request | None = None
        body = bytearray()
        started = False  # a byte of this request arrived: a timeout is then answered, not just closed
        now = asyncio.get_running_loop().time()
        deadline = now + self.request_timeout
        # On TCP the head, which carries the token, must come quickly: a stranger cannot hold a slot for long.
        head_deadline = now + self.header_timeout if via == "tcp" else deadline
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    async with asyncio.timeout_at(deadline if head is not None else head_deadline):
                        data = await reader.read(65536)
                except TimeoutError:
                    if not authenticated:  # a stranger that connected and never showed a token
                        self.auth_failures.allow(("tcp", remote))
                    if not started:
                        raise  # an idle keep-alive connection: closed quietly
                    if head is None and via == "tcp":
                        raise _Refused(Response(408, {"error": "request head not completed within "
                                                               f"{self.header_timeout:g}s"},
                                                headers={"connection": "close"}), linger=False) from None
                    log.warning("local API: a request from %s did not arrive whole within %gs; connection closed",
                                _who(cred, remote), self.request_timeout)
                    raise _Refused(Response(408, {"error": f"request not completed within {self.request_timeout:g}s"},
                                            headers={"connection": "close"})) from None
                started = started or bool(data)
                conn.receive_data(data)
                if not data and head is None and conn.their_state is h11.IDLE:
                    return None
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Request):
                head = event
                conn.head_request = event.method == b"HEAD"
                if via == "tcp":
                    self._check_bearer(event, remote)  # before a byte of the body is read
                length = next((v for k, v in event.headers if k == b"content-length"), b"0")
                if length.isdigit() and int(length) > MAX_BODY:
                    raise _Refused(_too_large())
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    raise _Refused(_too_large())
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                target = head.target.decode("ascii", errors="replace")
                parts = urlsplit(target)
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers}
                return Request(head.method.decode("ascii", errors="replace").upper(), parts.path,
                               parse_qs(parts.query), headers, bytes(body), cred, via, remote)

    def _check_bearer(self, head: h11.Request, remote: str) -> None:
        """A TCP request's token, from its head alone: refused → 401 (429 once the address has failed too often),
        sent before the body is read, and the connection closed."""
        authorization = next((v for k, v in head.headers if k == b"authorization"), b"")
        if self._token_ok(authorization.decode("latin-1")):
            return
        wait = self.auth_failures.allow(("tcp", remote))
        if wait:
            raise _Refused(Response(429, {"error": f"too many unauthorized requests from {remote}; retry later"},
                                    headers={"connection": "close", "retry-after": str(max(1, round(wait + 0.5)))}),
                           linger=False)
        raise _Refused(Response(401, {"error": "unauthorized"},
                                headers={"www-authenticate": "Bearer", "connection": "close"}), linger=False)

    async def _dispatch(self, request: Request) -> Response:
        if request.via == "tcp" and not self._token_ok(request.headers.get("authorization", "")):
            # _check_bearer refused such a request from its head already; this stays as a second lock
            return Response(401, {"error": "unauthorized"}, headers={"www-authenticate": "Bearer"})
        wait = self.rate_limit.allow(request.client)
        if wait:
            # Answer a refused request late (a quarter second at least): a client that floods on one connection
            # is slowed to a few requests per second, so refusing it costs the daemon almost nothing.
            await asyncio.sleep(min(1.0, max(wait, RATE_LIMIT_TARPIT)))
            return Response(429, {"error": f"rate limit exceeded: at most {self.rate_limit.rate:g} requests per "
                                           f"second per client; retry in {wait:.2f}s"},
                            headers={"retry-after": str(max(1, round(wait + 0.5)))})
        matched = [r for r in self.routes if _matches(r.path, request.path) and (r.tcp or request.via == "unix")]
        if not matched:
            return Response(404, "404 page not found\n", content_type="text/plain; charset=utf-8")
        method = "GET" if request.method == "HEAD" else request.method  # HEAD: GET's answer, sent without body
        route = next((r for r in matched if r.method == method), None)
        if route is None:
            return Response(405, "Method Not Allowed\n", content_type="text/plain; charset=utf-8")
        try:
            refusal = route.authorize(request)
            if refusal is not None:
                log.warning("local API: %s %s refused for %s", request.method, request.path,
                            _who(request.cred, request.remote))
                return Response(403, {"error": refusal})
            return await route.handler(request)
        except LocalAPIError as exc:
            return Response(exc.status, {"error": exc.message})
        except Exception:
            log.exception("local API: %s %s failed", request.method, request.path)
            return Response(500, {"error": "internal error"})

    def _token_ok(self, authorization: str) -> bool:
        scheme, _, token = authorization.strip().partition(" ")
        return (scheme.lower() == "bearer" and bool(self._tcp_token)
                and hmac.compare_digest(token.strip().encode("latin-1"), self._tcp_token))

    async def _send(self, conn: _Connection, writer: asyncio.StreamWriter, response: Response) -> None:
        stream = response.stream
        if stream is None:
            writer.write(self._encode(conn, response))
        else:
            headers = [("content-type", response.content_type), ("transfer-encoding", "chunked"),
                       *response.headers.items()]
            writer.write(conn.send(h11.Response(status_code=response.status, headers=headers)))
            await self._send_chunks(conn, writer, stream)
            writer.write(conn.send(h11.EndOfMessage()))
        await self._drain(writer)

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        """Wait for the client to take what was written. A reader that pauses (a pager) may take its time while
        connection slots are to spare; once they run out, one that has not read for `request_timeout` is dropped:
        clients that ask and never read would otherwise hold every slot for good."""
        while True:
            try:
                async with asyncio.timeout(self.request_timeout):
                    await writer.drain()
                return
            except TimeoutError:
                if self._slots_short():
                    raise _SlowReader from None

    def _slots_short(self) -> bool:
        return (len(self._connections) >= self.max_connections
                or len(self._tcp_connections) >= self.tcp_max_connections)

    @staticmethod
    def _encode(conn: _Connection, response: Response) -> bytes:
        """A whole response with a body (not streamed), as bytes."""
        body = response.encoded()
        headers = [("content-type", response.content_type), ("content-length", str(len(body))),
                   *response.headers.items()]
        if response.status == 204:
            headers = [h for h in headers if h[0] not in ("content-type", "content-length")]
        out = conn.send(h11.Response(status_code=response.status, headers=headers)) or b""
        if body and not conn.head_request:
            out += conn.send(h11.Data(data=body)) or b""
        return out + (conn.send(h11.EndOfMessage()) or b"")

    async def _send_chunks(self, conn: _Connection, writer: asyncio.StreamWriter,
                           stream: AsyncIterator[bytes]) -> None:
        try:
            if conn.head_request:  # the headers alone; the producer is still closed (below)
                return
            async for chunk in stream:
                if chunk:
                    writer.write(conn.send(h11.Data(data=chunk)))
                    await self._drain(writer)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:  # the client went away: let the producer clean up
                await aclose()


class _Connection(h11.Connection):
    """h11's connection, knowing whether the request in hand is a HEAD (its answer has headers only)."""

    head_request = False


class _SlowReader(PlexdError):
    """The client did not read its answer in time."""


def _who(cred: PeerCred | None, remote: str) -> str:
    """The caller, for a log line."""
    return f"uid {cred.uid} pid {cred.pid}" if cred else (remote or "unknown peer")


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After refusing a request mid-body: stop sending, and read what the client still sends for a moment, so
    closing does not reset the connection before the client has read the answer."""
    if writer.can_write_eof():
        writer.write_eof()
    async with asyncio.timeout(1.0):
        discarded = 0
        while discarded < 4 * MAX_BODY and (chunk := await reader.read(65536)):
            discarded += len(chunk)


def _too_large() -> Response:
    return Response(400, {"error": f"invalid JSON body: larger than 1 MiB ({MAX_BODY} bytes)"},
                    headers={"connection": "close"})


def _matches(pattern: str, path: str) -> bool:
    return path == pattern or (pattern.endswith("/") and path.startswith(pattern))


def _remove_stale(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise PlexdError(f"node_api.socket_path: {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listening: left by a crashed daemon
        log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise PlexdError(f"node_api.socket_path: another plexd is already serving {path}; stop it first")
