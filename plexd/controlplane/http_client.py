"""The daemon's HTTP client for the control plane: httpx over httpcore's pool, with the bounds plexd promises.

httpx builds and sends the requests and httpcore speaks HTTP/1.1 and to proxies, one connection per request
(`Connection: close`). A node's requests are seconds apart (the heartbeat every 30 s, longer than any sensible
keep-alive), so reuse saved a handshake only in bursts; and a connection that carries one exchange cannot hand a
request the bytes of another: httpcore takes bytes a server sent past its answer as the start of the next answer
(an answer smuggled in a body would be delivered to the next request), and a kept-alive connection the server
closed under a request left the caller to guess whether it had been acted on. Around them, plexd's own rules:

- a connect deadline (TCP and TLS handshake), a deadline per read and per write (`None`: wait forever, for the
  event stream, whose idle watchdog decides), and the caller's own total deadline around it;
- `gzip`/`deflate` bodies are decoded here, not by httpx, in bounded steps (httpx would inflate a whole read at
  once: 64 KiB of a bomb became 64 MiB before any cap saw it);
- the environment's proxies by our reading of them (`proxy_for`: `HTTPS_PROXY` with CONNECT, `HTTP_PROXY` in
  absolute form, `ALL_PROXY`, `NO_PROXY` with names, subdomains and networks), `http://` proxies only, with
  optional `user:password@` (Basic); httpx's own reading of the environment is off;
- TLS with the caller's `ssl.SSLContext` (server name checked), or the system's trust store by default, read
  lazily (`default_tls_context`);
- header values go out as Latin-1 bytes, as they came (an ETag with a byte >= 0x80); a value that cannot be framed
  is named, never quoted (it may be the bearer).

Errors are `TransportError` (with a `kind` a person reads: "cannot connect", "read timed out", ...),
`DecodingError` and `BodyTooLarge`; all are `RequestFailed` (a `PlexdError`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import ssl
import zlib
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from urllib.parse import unquote, urlsplit

import httpcore
import httpx

from plexd.base.errors import PlexdError

DECODED_STEP = 256 * 1024  # the most one decompression step may produce
DEFAULT_PORTS = {"http": 80, "https": 443}


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


class Headers(Mapping[str, str]):
    """Response headers, case-insensitive; a repeated header's values joined with ", "."""

    def __init__(self, pairs: list[tuple[bytes, bytes]] | Mapping[str, str] = ()) -> None:
        items = pairs.items() if isinstance(pairs, Mapping) else (
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in pairs)
        self._values: dict[str, str] = {}
        for name, value in items:
            key = name.lower()
            self._values[key] = f"{self._values[key]}, {value}" if key in self._values else value

    def __getitem__(self, name: str) -> str:
        return self._values[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Headers({self._values!r})"


class Response:
    """A response whose body is read as it arrives. `aclose()` (or reading to the end) frees the connection."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code
        self.headers = Headers(response.headers.raw)

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, decoded (gzip, deflate), in chunks of at most DECODED_STEP bytes."""
        encoding = self.headers.get("content-encoding", "").strip().lower()
        chunks = self._raw()
        if encoding not in ("gzip", "x-gzip", "deflate") or self.status_code in (204, 304):
            async for chunk in chunks:
                yield chunk
            return
        decoder = _Decoder(encoding)
        async for chunk in chunks:
            for piece in decoder.feed(chunk):
                yield piece
        for piece in decoder.finish():
            yield piece

    async def _raw(self) -> AsyncIterator[bytes]:
        with _named_errors():
            async for chunk in self._response.aiter_raw():
                yield chunk

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
        await self._response.aclose()  # a body not read to its end: httpcore closes the connection

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
        self.auth: tuple[str, str] | None = None
        if parts.username is not None:
            self.auth = (unquote(parts.username), unquote(parts.password or ""))

    @property
    def key(self) -> tuple[str, int, tuple[str, str] | None]:
        return self.host, self.port, self.auth


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
# The transport: one httpcore pool per proxy (and one direct), errors named


class Chunks(httpx.AsyncByteStream):
    """Byte chunks from any async iterable as an httpx body stream; closing it closes its source when it can."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        if (close := getattr(self._chunks, "aclose", None)) is not None:
            await close()


class _Transport(httpx.AsyncBaseTransport):
    def __init__(self, tls: ssl.SSLContext | None, env: Mapping[str, str]) -> None:
        self._tls = tls
        self.env = env
        self._pools: dict[object, httpcore.AsyncConnectionPool] = {}

    def _pool(self, proxy: _Proxy | None) -> httpcore.AsyncConnectionPool:
        key = None if proxy is None else proxy.key
        pool = self._pools.get(key)
        if pool is None:
            common = {"ssl_context": self._tls or default_tls_context(), "max_connections": 100,
                      "max_keepalive_connections": 0}  # one exchange per connection (the module docstring)
            pool = (httpcore.AsyncConnectionPool(**common) if proxy is None else  # type: ignore[arg-type]
                    httpcore.AsyncHTTPProxy(proxy_url=f"http://{_authority(proxy.host, proxy.port)}",
                                            proxy_auth=proxy.auth, **common))  # type: ignore[arg-type]
            self._pools[key] = pool
        return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        try:
            proxy = proxy_for(url.scheme, url.host, self.env)
        except ValueError as exc:  # the environment's proxy has a port that is no number
            raise TransportError("bad request", str(exc)) from None
        req = httpcore.Request(method=request.method,
                               url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port,
                                                target=url.raw_path),
                               headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        with _named_errors(proxy):
            resp = await self._pool(proxy).handle_async_request(req)
        return httpx.Response(status_code=resp.status, headers=resp.headers, stream=Chunks(resp.stream),
                              extensions=resp.extensions)

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            await pool.aclose()


@contextlib.contextmanager
def _named_errors(proxy: _Proxy | None = None) -> Iterator[None]:
    """httpcore's and httpx's errors as a TransportError whose kind a person reads."""
    try:
        yield
    except RequestFailed:
        raise
    except (httpcore.ConnectTimeout, httpx.ConnectTimeout, httpcore.PoolTimeout, httpx.PoolTimeout):
        raise TransportError("connect timed out") from None
    except (httpcore.ReadTimeout, httpx.ReadTimeout):
        raise TransportError("read timed out") from None
    except (httpcore.WriteTimeout, httpx.WriteTimeout):
        raise TransportError("write timed out") from None
    except (httpcore.ProxyError, httpx.ProxyError) as exc:
        where = f"proxy {proxy.host}:{proxy.port}" if proxy is not None else "the proxy"
        raise TransportError("cannot connect", f"{where} refused CONNECT: {exc}") from None  # exc: "403 Forbidden"
    except (httpcore.ConnectError, httpx.ConnectError) as exc:
        detail = _root_cause(exc)
        if "CERTIFICATE_VERIFY_FAILED" in detail:
            detail += (" (checked against api.tls.ca_file when set, else the system's trust store: Debian's "
                       "ca-certificates)")
        raise TransportError("cannot connect", detail) from None
    except (httpcore.LocalProtocolError, httpx.LocalProtocolError):
        raise TransportError("bad request", "the request could not be framed as HTTP/1.1") from None
    except (httpcore.RemoteProtocolError, httpx.RemoteProtocolError) as exc:
        detail = str(exc).rstrip(".")
        if detail == "Server disconnected without sending a response":  # httpcore says it only before an answer
            detail = "server disconnected without sending a response"  # (or before its answer's head was whole)
        raise TransportError("protocol error", detail) from None
    except (httpcore.ReadError, httpx.ReadError) as exc:
        raise TransportError("read error", str(exc) or type(exc).__name__) from None
    except (httpcore.WriteError, httpx.WriteError) as exc:
        raise TransportError("write error", str(exc) or type(exc).__name__) from None
    except (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol) as exc:
        raise TransportError("cannot connect", str(exc)) from None
    except OSError as exc:
        raise TransportError("cannot connect", str(exc)) from None


def _root_cause(exc: BaseException) -> str:
    """The innermost error's words: anyio says "All connection attempts failed" over the refusal that says why."""
    while (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    return str(exc) or type(exc).__name__


# ---------------------------------------------------------------------------------------------------------------
# The client


class HTTPClient:
    """httpx with plexd's bounds; see the module docstring."""

    def __init__(self, *, tls: ssl.SSLContext | None = None, connect_timeout: float = 10.0,
                 read_timeout: float | None = 30.0, write_timeout: float | None = 30.0,
                 env: Mapping[str, str] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self._transport = _Transport(tls, os.environ if env is None else env)
        # trust_env off: proxies and certificates are read by the rules above, not httpx's
        self._client = httpx.AsyncClient(transport=self._transport, trust_env=False, follow_redirects=False)

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                   content: bytes | None = None, read_timeout: float | _Default | None = DEFAULT) -> Response:
        """Send a request and answer once the status line and headers are in; the body streams from the
        Response, which must be closed (`aclose`, or `async with`)."""
        reads = self.read_timeout if isinstance(read_timeout, _Default) else read_timeout
        headers = headers or {}
        try:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise TransportError("cannot connect", f"not an http(s) URL: {url!r}")
            for name, value in headers.items():
                if problem := _header_problem(name, value):
                    raise TransportError("bad request", problem)
            # Values as Latin-1 bytes: an ETag the server sent with a byte >= 0x80 goes back as it came.
            wire = [(k.encode("ascii"), v.encode("latin-1")) for k, v in headers.items()
                    if k.lower() not in ("content-length", "connection")]
            wire.append((b"Connection", b"close"))
            timeout = httpx.Timeout(connect=self.connect_timeout, read=reads, write=self.write_timeout,
                                    pool=self.connect_timeout)
            request = httpx.Request(method, url, headers=wire, content=content,
                                    extensions={"timeout": timeout.as_dict()})
            if content is None and method in ("POST", "PUT", "PATCH"):
                request.headers["Content-Length"] = "0"
        except UnicodeError:  # a header name that is not ASCII
            raise TransportError("bad request", "the request could not be framed as HTTP/1.1") from None
        except httpx.InvalidURL as exc:  # a port that is no number, ...
            raise TransportError("bad request", str(exc)) from None
        return Response(await self._client.send(request, stream=True))

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                     content: bytes | None = None,
                     read_timeout: float | _Default | None = DEFAULT) -> AsyncIterator[Response]:
        response = await self.send(method, url, headers=headers, content=content, read_timeout=read_timeout)
        try:
            yield response
        finally:
            await response.aclose()


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


def _header_problem(name: str, value: str) -> str:
    """Why a header cannot be framed (h11's rule, checked before a byte is sent), naming the header only: values
    can be secrets. "" when it can."""
    try:
        value.encode("latin-1")
    except UnicodeError:
        return f"header {name} has a value that is not Latin-1 text"
    if any((ord(c) < 0x20 and c != "\t") or c == "\x7f" for c in value) or value != value.strip(" \t"):
        return f"header {name} has a value with a control character or surrounding blanks"
    return ""
