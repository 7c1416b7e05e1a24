"""The daemon's HTTP/1.1 client for the control plane: h11 over asyncio streams.

Why not httpx: it, httpcore, anyio and certifi are 5.1 MiB of a 57 MiB daemon (measured: the daemon's modules
with and without them, stop 44), for features the control plane does not use (HTTP/2, cookies, redirects,
multipart, auth flows). h11 is already loaded for the node API server; asyncio and ssl are loaded anyway.

What it does, and all it does:
- one request per connection at a time, idle connections kept per origin for `keepalive_expiry` seconds
  (5 s, as httpx did: longer than most servers' own idle timeouts would only meet closed sockets) and dropped
  once the server has closed them; an idempotent request (GET, PUT, ...) that meets a connection closed under
  it, before any byte of an answer, is sent once more on a new one (a POST is not: see IDEMPOTENT);
- a connect deadline (TCP and TLS handshake), a deadline per read and per write (`None`: wait forever, for the
  event stream, whose idle watchdog decides), and the caller's own total deadline around it;
- TLS with the caller's `ssl.SSLContext` (server name checked), or the system's trust store by default, read
  lazily (`default_tls_context`);
- `gzip`/`deflate` bodies decoded as they stream, in bounded steps (a small compressed body cannot make one
  read return a huge block: the caller's byte cap sees it grow);
- the proxies of the environment, as httpx and Go's default transport honour them: `HTTPS_PROXY` (CONNECT),
  `HTTP_PROXY` (absolute-form requests), `ALL_PROXY`, `NO_PROXY`; `http://` proxies, with optional
  `user:password@` (Basic).

Errors are `TransportError` (with a `kind` a person reads: "cannot connect", "read timed out", ...),
`DecodingError` and `BodyTooLarge`; all are `RequestFailed` (a `PlexdError`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import os
import re
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from urllib.parse import unquote, urlsplit

import h11

from plexd.base.errors import PlexdError

READ_SIZE = 64 * 1024
DECODED_STEP = 256 * 1024  # the most one decompression step may produce
KEEPALIVE_EXPIRY = 5.0
MAX_IDLE_PER_ORIGIN = 4
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_PORTS = {"http": 80, "https": 443}
# Sent again after a kept-alive connection closed under them: the server may have acted on a POST before closing
# (a registration spends its one-time token), so a POST's caller sees the error and retries by its own rules.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


class _Default:
    """The client's own read timeout (`None` already means "wait forever")."""


DEFAULT = _Default()


class RequestFailed(PlexdError):
    """Anything that kept a request from getting a whole, readable answer."""


class TransportError(RequestFailed):
    """The connection failed: `kind` says how ("cannot connect", "read timed out", ...), the message adds why."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class DecodingError(RequestFailed):
    """A body labelled with an encoding it does not have."""


class BodyTooLarge(RequestFailed):
    """A body past the size its reader allows (`Response.aread`'s limit)."""


class _ClosedBeforeAnswer(TransportError):
    """The server closed the connection before any byte of an answer: on a reused connection, sent again."""


class Headers(Mapping[str, str]):
    """Response headers, looked up case-insensitively; a repeated header's values joined with ", "."""

    def __init__(self, pairs: list[tuple[bytes, bytes]] | Mapping[str, str] = ()) -> None:
        self._map: dict[str, str] = {}
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        for name, value in items:
            key = (name.decode("latin-1") if isinstance(name, bytes) else name).lower()
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            self._map[key] = f"{self._map[key]}, {text}" if key in self._map else text

    def __getitem__(self, name: str) -> str:
        return self._map[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __repr__(self) -> str:
        return f"Headers({self._map!r})"


class Response:
    """A response whose body is read as it arrives. `aclose()` (or reading to the end) frees the connection."""

    def __init__(self, status_code: int, headers: Headers, chunks: AsyncIterator[bytes],
                 close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.status_code = status_code
        self.headers = headers
        self._chunks = chunks
        self._close = close

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, decoded (gzip, deflate), in chunks of at most DECODED_STEP bytes."""
        encoding = self.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("gzip", "x-gzip", "deflate") or self.status_code in (204, 304):
            async for chunk in self._chunks:
                yield chunk
            return
        decoder = _Decoder(encoding)
        async for chunk in self._chunks:
            for piece in decoder.feed(chunk):
                yield piece
        for piece in decoder.finish():
            yield piece

    async def aread(self, limit: int | None = None, *, truncate: bool = False) -> bytes:
        """The body, decoded. With `limit`, at most that many bytes: past it `BodyTooLarge`, or, with `truncate`,
        its first `limit` bytes without waiting for the rest (a refusal's reason needs only its start)."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in self.aiter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size >= limit:
                if truncate:
                    break
                if size > limit:
                    raise BodyTooLarge(f"response larger than {limit} bytes")
        return b"".join(chunks)[:limit]

    async def aclose(self) -> None:
        if self._close is not None:
            close, self._close = self._close, None
            await close()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Decoder:
    def __init__(self, encoding: str) -> None:
        self._z = zlib.decompressobj(31 if "gzip" in encoding else zlib.MAX_WBITS)
        self._encoding = encoding
        # "deflate" comes with and without its zlib header (httpx and browsers accept both): until the first
        # bytes decode, a header error means the raw form
        self._may_be_raw = encoding == "deflate"
        self._fed = False  # an empty body is empty, whatever its label says

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._fed = self._fed or bool(data)
        if self._may_be_raw:
            self._may_be_raw = False
            try:
                out = self._z.decompress(data, DECODED_STEP)
            except zlib.error:
                self._z = zlib.decompressobj(-zlib.MAX_WBITS)
                out = self._step(data)
        else:
            out = self._step(data)
        while True:
            if out:
                yield out
            if not self._z.unconsumed_tail:
                return
            out = self._step(self._z.unconsumed_tail)

    def finish(self) -> Iterator[bytes]:
        if not self._fed:
            return
        try:
            rest = self._z.flush()
        except zlib.error as exc:
            raise self._broken(exc) from None
        if rest:
            yield rest
        if not self._z.eof:
            raise DecodingError(f"{self._encoding} body ends before its compressed stream does")

    def _step(self, data: bytes) -> bytes:
        try:
            return self._z.decompress(data, DECODED_STEP)
        except zlib.error as exc:
            raise self._broken(exc) from None

    def _broken(self, exc: zlib.error) -> DecodingError:
        return DecodingError(f"{self._encoding} body cannot be decoded: {exc}")


# ---------------------------------------------------------------------------------------------------------------
# Proxies from the environment


class _Proxy:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise TransportError("cannot connect", f"proxy {parts.scheme}://{parts.hostname or ''} from the "
                                                   "environment is not supported (only http:// proxies)")
        self.host, self.port = parts.hostname, parts.port or 80
        self.authorization = ""
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self.authorization = "Basic " + base64.b64encode(pair).decode()


def _env(env: Mapping[str, str], name: str) -> str:
    return (env.get(name.lower()) or env.get(name.upper()) or "").strip()


def _bypassed(host: str, no_proxy: str) -> bool:
    """NO_PROXY as curl and httpx read it: `*`, host names (their subdomains too, a leading dot optional),
    IP addresses and CIDR blocks."""
    host = host.lower().strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        if address is not None:
            with contextlib.suppress(ValueError):
                if address in ipaddress.ip_network(entry.strip("[]"), strict=False):
                    return True
            continue
        entry = entry.lstrip(".").split(":")[0]
        if host == entry or host.endswith("." + entry):
            return True
    return False


def proxy_for(scheme: str, host: str, env: Mapping[str, str]) -> _Proxy | None:
    """The proxy the environment names for `scheme://host`, or None."""
    if _bypassed(host, _env(env, "no_proxy")):
        return None
    url = _env(env, f"{scheme}_proxy") or _env(env, "all_proxy")
    return _Proxy(url) if url else None


# ---------------------------------------------------------------------------------------------------------------
# Connections


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.idle_since = 0.0
        self.reused = False
        self.heard = False  # any byte from the server since the request went out

    def usable(self, now: float, expiry: float) -> bool:
        """Young enough, still open, and silent: bytes that came while it sat idle (a 408 before the server
        closed it, or garbage) are nobody's answer, and would be taken for the next request's."""
        buffered = getattr(self.reader, "_buffer", b"")  # StreamReader has no public "bytes waiting" call
        return (now - self.idle_since <= expiry and not buffered and not self.reader.at_eof()
                and not self.writer.transport.is_closing())

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)

    async def write(self, data: bytes, timeout: float | None) -> None:
        try:
            self.writer.write(data)
            async with asyncio.timeout(timeout):
                await self.writer.drain()
        except TimeoutError:
            raise TransportError("write timed out") from None
        except OSError as exc:
            raise TransportError("write error", str(exc)) from None

    async def next_event(self, timeout: float | None, answered: bool) -> object:
        """The next h11 event of the answer, reading from the socket as needed."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise TransportError("protocol error", str(exc)) from None
            if event is not h11.NEED_DATA:
                return event
            try:
                async with asyncio.timeout(timeout):
                    data = await self.reader.read(READ_SIZE)
            except TimeoutError:
                raise TransportError("read timed out") from None
            except OSError as exc:
                if not answered and not self.heard:
                    raise _ClosedBeforeAnswer("read error", str(exc)) from None
                raise TransportError("read error", str(exc)) from None
            if not data and not answered:
                if not self.heard:
                    raise _ClosedBeforeAnswer("protocol error", "server disconnected without sending a response")
                raise TransportError("protocol error", "server disconnected in the middle of its answer's head")
            self.heard = True
            try:
                self.h11.receive_data(data)
            except h11.RemoteProtocolError as exc:
                raise TransportError("protocol error", str(exc)) from None


class HTTPClient:
    """A pool of HTTP/1.1 connections with deadlines; see the module docstring."""

    def __init__(self, *, tls: ssl.SSLContext | None = None, connect_timeout: float = 10.0,
                 read_timeout: float | None = 30.0, write_timeout: float | None = 30.0,
                 keepalive_expiry: float = KEEPALIVE_EXPIRY, env: Mapping[str, str] | None = None) -> None:
        self.tls = tls
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.keepalive_expiry = keepalive_expiry
        self._env = os.environ if env is None else env
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._closed = False

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await conn.close()

    async def send(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                   content: bytes | None = None, read_timeout: float | _Default | None = DEFAULT) -> Response:
        """Send a request and answer once the status line and headers are in; the body streams from the
        Response, which must be closed (`aclose`, or `async with`)."""
        reads = self.read_timeout if isinstance(read_timeout, _Default) else read_timeout
        try:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise TransportError("cannot connect", f"not an http(s) URL: {url!r}")
            port = parts.port or DEFAULT_PORTS[parts.scheme]
            proxy = proxy_for(parts.scheme, parts.hostname, self._env)
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            if proxy is not None and parts.scheme == "http":
                target = f"http://{parts.netloc.rpartition('@')[2]}{target}"  # absolute form, to the proxy
            request = self._request(method, target, parts.scheme, parts.hostname, port, headers or {}, content,
                                    proxy)
        except (UnicodeError, h11.LocalProtocolError):
            # A header value with a newline, a NUL or non-Latin-1 text. Named, never quoted: the value may be the
            # bearer (the node secret itself, against a Go control plane), and this message is logged.
            raise TransportError("bad request", _unframeable(headers or {})) from None
        except ValueError as exc:  # a port that is no number
            raise TransportError("bad request", str(exc)) from None
        origin = (parts.scheme, parts.hostname, port)
        for attempt in (1, 2):
            conn = await self._connection(origin, proxy, pooled=attempt == 1)
            try:
                return await self._exchange(conn, origin, request, content, reads)
            except _ClosedBeforeAnswer:
                await conn.close()
                if not conn.reused or attempt == 2 or method not in IDEMPOTENT:
                    raise
            except BaseException:
                await conn.close()
                raise
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                     content: bytes | None = None,
                     read_timeout: float | _Default | None = DEFAULT) -> AsyncIterator[Response]:
        response = await self.send(method, url, headers=headers, content=content, read_timeout=read_timeout)
        try:
            yield response
        finally:
            await response.aclose()

    # -- one exchange -------------------------------------------------------------------------------------------

    def _request(self, method: str, target: str, scheme: str, host: str, port: int, headers: Mapping[str, str],
                 content: bytes | None, proxy: _Proxy | None) -> h11.Request:
        wire = [("Host", _host_text(host) if port == DEFAULT_PORTS[scheme] else _authority(host, port))]
        wire += [(k, v) for k, v in headers.items() if k.lower() not in ("host", "content-length")]
        if content is not None or method in ("POST", "PUT", "PATCH"):
            wire.append(("Content-Length", str(len(content or b""))))
        if proxy is not None and scheme == "http" and proxy.authorization:
            wire.append(("Proxy-Authorization", proxy.authorization))
        # Values as Latin-1 bytes: an ETag the server sent with a byte >= 0x80 goes back as it came.
        return h11.Request(method=method, target=target,
                           headers=[(k.encode("ascii"), v.encode("latin-1")) for k, v in wire])

    async def _exchange(self, conn: _Connection, origin: tuple[str, str, int], request: h11.Request,
                        content: bytes | None, reads: float | None) -> Response:
        data = conn.h11.send(request) or b""
        if content:
            data += conn.h11.send(h11.Data(data=content)) or b""
        data += conn.h11.send(h11.EndOfMessage()) or b""
        await conn.write(data, self.write_timeout)
        while True:
            event = await conn.next_event(reads, answered=False)
            if isinstance(event, h11.Response):
                break
            if not isinstance(event, h11.InformationalResponse):
                raise TransportError("protocol error", f"unexpected {type(event).__name__} before the answer")
        state = {"done": False}

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                ev = await conn.next_event(reads, answered=True)
                if isinstance(ev, h11.Data):
                    yield bytes(ev.data)
                elif isinstance(ev, h11.EndOfMessage | h11.ConnectionClosed):
                    state["done"] = True
                    return

        async def close() -> None:
            await self._release(conn, origin, whole=state["done"])

        return Response(event.status_code, Headers(event.headers), chunks(), close)

    async def _release(self, conn: _Connection, origin: tuple[str, str, int], whole: bool) -> None:
        """Back to the pool when the exchange ended cleanly and both sides may go on; closed otherwise."""
        reusable = (whole and not self._closed and conn.h11.our_state is h11.DONE
                    and conn.h11.their_state is h11.DONE and conn.h11.trailing_data == (b"", False))
        idle = self._idle.setdefault(origin, [])
        if not reusable or len(idle) >= MAX_IDLE_PER_ORIGIN:
            await conn.close()
            return
        conn.h11.start_next_cycle()
        conn.idle_since, conn.reused, conn.heard = time.monotonic(), True, False
        idle.append(conn)

    # -- connecting ---------------------------------------------------------------------------------------------

    async def _connection(self, origin: tuple[str, str, int], proxy: _Proxy | None, *,
                          pooled: bool = True) -> _Connection:
        idle = self._idle.get(origin, []) if pooled else []
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self.keepalive_expiry):
                return conn
            await conn.close()
        scheme, host, port = origin
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await self._open(scheme, host, port, proxy)
        except TimeoutError:
            raise TransportError("connect timed out") from None
        except ssl.SSLCertVerificationError as exc:
            raise TransportError("cannot connect", f"{exc} (checked against api.tls.ca_file when set, else the "
                                                   "system's trust store: Debian's ca-certificates)") from None
        except (OSError, ssl.SSLError) as exc:
            raise TransportError("cannot connect", str(exc)) from None

    async def _open(self, scheme: str, host: str, port: int, proxy: _Proxy | None) -> _Connection:
        tls = (self.tls or default_tls_context()) if scheme == "https" else None
        if proxy is None:
            reader, writer = await asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None,
                                                           limit=READ_SIZE)
            return _Connection(reader, writer)
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port, limit=READ_SIZE)
        if tls is None:
            return _Connection(reader, writer)  # plain http: absolute-form requests to the proxy
        try:
            await _connect_tunnel(reader, writer, host, port, proxy)
            await writer.start_tls(tls, server_hostname=host)
        except BaseException:
            writer.close()
            raise
        return _Connection(reader, writer)


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address in brackets


def _authority(host: str, port: int) -> str:
    return f"{_host_text(host)}:{port}"


async def _connect_tunnel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int,
                          proxy: _Proxy) -> None:
    """CONNECT host:port through the proxy; raises unless it answers 2xx."""
    authority = _authority(host, port)
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if proxy.authorization:
        lines.append(f"Proxy-Authorization: {proxy.authorization}")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    await writer.drain()
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise OSError(f"proxy {proxy.host}:{proxy.port} answered CONNECT with an oversized header") from None
    except asyncio.IncompleteReadError:
        raise OSError(f"proxy {proxy.host}:{proxy.port} closed the connection during CONNECT") from None
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].startswith("2"):
        raise OSError(f"proxy {proxy.host}:{proxy.port} refused CONNECT {authority}: {status_line[:200]}")


_default_contexts: dict[tuple[str, str], ssl.SSLContext] = {}
_HASHED_NAME = re.compile(r"[0-9a-f]{8}\.\d+")


def default_tls_context() -> ssl.SSLContext:
    """The system's trust store, TLS 1.2 or newer, host names checked; SSL_CERT_FILE / SSL_CERT_DIR replace it,
    as OpenSSL reads them. Where the store is a hashed directory (Debian's /etc/ssl/certs), OpenSSL looks a CA up
    when a chain needs it instead of parsing all ~140 up front: 1.0 MiB for the context instead of 2.3, and no
    start-up parse. Built once per environment, and shared (each connection gets its own SSL object)."""
    env = (os.environ.get("SSL_CERT_FILE", ""), os.environ.get("SSL_CERT_DIR", ""))
    ctx = _default_contexts.get(env)
    if ctx is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verification and host-name checks on
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        capath = ssl.get_default_verify_paths().capath
        if any(env):
            ctx.load_verify_locations(cafile=env[0] or None, capath=env[1] or None)
        elif capath and _hashed(capath):
            ctx.load_verify_locations(capath=capath)
        else:
            ctx.load_default_certs()
        _default_contexts[env] = ctx
    return ctx


def _hashed(directory: str) -> bool:
    """Whether `directory` holds OpenSSL's hash links (`5ad8a5d6.0`), so lookups by subject work."""
    try:
        with os.scandir(directory) as entries:
            return any(_HASHED_NAME.fullmatch(entry.name) for entry in entries)
    except OSError:
        return False


def unverified_tls_context() -> ssl.SSLContext:
    """api.tls.insecure_skip_verify: encrypted, but any certificate is accepted (labs only)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _unframeable(headers: Mapping[str, str]) -> str:
    """Which header keeps a request from being framed, by name only (values can be secrets)."""
    for name, value in headers.items():
        try:
            value.encode("latin-1")
        except UnicodeError:
            return f"header {name} has a value that is not Latin-1 text"
        if any((ord(c) < 0x20 and c != "\t") or c == "\x7f" for c in value) or value != value.strip(" \t"):
            return f"header {name} has a value with a control character or surrounding blanks"
    return "the request could not be framed as HTTP/1.1"
