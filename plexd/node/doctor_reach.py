"""`plexd doctor`'s view of the control plane: reach it step by step (DNS, TCP, TLS, HTTP) so a failure names the
step that failed, and keep its Date header (the clock check) and the address it reached (the MTU check).

The daemon's client (`plexd.controlplane.http_client`) says only "cannot connect: ..."; an operator needs to know
whether to look at the resolver, a firewall, a certificate or the server. So the steps are taken here by hand, with
the same TLS settings the daemon uses, each within what is left of one budget. Through a proxy from the
environment the direct steps would test the wrong path: the request then goes through the daemon's own client.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

from plexd import __version__
from plexd.controlplane import http_client

PING_PATH = "/v1/ping"
STEP_TIMEOUT = 3.0  # seconds, each step
BUDGET = 8.0  # seconds for all the steps together
T = TypeVar("T")


@dataclass(frozen=True)
class Reach:
    """What reaching the control plane found. `step` is the one that failed ("" when it answered)."""

    url: str
    step: str = ""  # "config", "DNS", "TCP", "TLS", "HTTP"
    error: str = ""
    fix: str = ""
    address: str = ""  # the IP connected to (or last tried): the route the MTU check follows
    status: int = 0
    tls: str = ""  # "verified", "unverified", "" (plain http)
    proxy: str = ""  # host:port of the environment's proxy, when the request went through one
    server_date: float | None = None  # the Date header, unix seconds
    local_time: float | None = None  # this machine's clock while the answer was on its way
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.step and 200 <= self.status < 300


def reach(api_url: str, *, ca_file: str = "", insecure_skip_verify: bool = False,
          env: Mapping[str, str] | None = None, step_timeout: float = STEP_TIMEOUT, budget: float = BUDGET) -> Reach:
    """Reach `api_url` and GET /v1/ping; never raises for what the network or the server does."""
    start = time.monotonic()
    if not api_url:
        return Reach("", "config", "no control plane configured (api.url is empty)",
                     "before joining, name it: plexd doctor --api URL ('plexd join --api URL' stores it)")
    parts = urlsplit(api_url)
    host, scheme = parts.hostname or "", parts.scheme.lower()
    port = parts.port or http_client.DEFAULT_PORTS.get(scheme, 443)

    def left() -> float:
        return max(0.1, min(step_timeout, start + budget - time.monotonic()))

    try:
        tls = _tls_context(ca_file, insecure_skip_verify) if scheme == "https" else None
    except (OSError, ssl.SSLError) as exc:
        return Reach(api_url, "TLS", f"TLS: cannot load api.tls.ca_file {ca_file}: {exc}",
                     "point api.tls.ca_file at a readable PEM file of the control plane's CA")
    tls_kind = "" if tls is None else ("unverified" if insecure_skip_verify else "verified")
    environ = os.environ if env is None else env
    try:
        proxy = http_client.proxy_for(scheme, host, environ)
    except http_client.TransportError as exc:
        return Reach(api_url, "config", str(exc), "use an http:// proxy in HTTPS_PROXY / HTTP_PROXY, or none")
    if proxy is not None:
        done = _through_proxy(api_url, tls, left(), f"{proxy.host}:{proxy.port}", tls_kind)
    else:
        done = _direct(api_url, host, port, tls, left, tls_kind)
    return _with(done, seconds=round(time.monotonic() - start, 3))


def _direct(url: str, host: str, port: int, tls: ssl.SSLContext | None, left: Callable[[], float],
            tls_kind: str) -> Reach:
    timeout = left()
    try:
        infos = call_with_timeout(lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
    except TimeoutError:
        return Reach(url, "DNS", f"DNS: no answer for {host} within {timeout:g}s",
                     "check the resolvers in /etc/resolv.conf (or systemd-resolved) from this machine")
    except (OSError, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return Reach(url, "DNS", f"DNS: cannot resolve {host} ({why})",
                     "check the host name in api.url and the resolvers in /etc/resolv.conf")
    sock, address, failure = _connect(url, infos, port, left)
    if sock is None:
        return failure
    try:
        if tls is not None:
            sock, failure = _handshake(url, sock, tls, host, port, address, left())
            if failure is not None:
                return failure
        return _ping(url, sock, host, port, address, left(), tls_kind)
    finally:
        sock.close()


def _handshake(url: str, sock: socket.socket, tls: ssl.SSLContext, host: str, port: int, address: str,
               timeout: float) -> tuple[socket.socket, Reach | None]:
    """The TLS socket, or the plain one and the failure, named."""
    sock.settimeout(timeout)
    try:
        return tls.wrap_socket(sock, server_hostname=host), None
    except ssl.SSLCertVerificationError as exc:
        return sock, Reach(url, "TLS", f"TLS: the certificate of {host} is not trusted ({exc.verify_message})",
                           "install the CA that signed it (apt-get install ca-certificates, or set "
                           "api.tls.ca_file), or fix the server's certificate chain", address)
    except ssl.SSLError as exc:
        return sock, Reach(url, "TLS", f"TLS: handshake with {address}:{port} failed ({exc.reason or exc})",
                           f"is {port} a TLS port? an https:// URL to a plain-http server fails here", address)
    except TimeoutError:
        return sock, Reach(url, "TLS", f"TLS: no handshake from {address}:{port} within {timeout:g}s",
                           "the server accepted TCP but does not speak TLS there: check the port in api.url",
                           address)
    except OSError as exc:
        return sock, Reach(url, "TLS", f"TLS: the connection broke during the handshake ({exc.strerror or exc})",
                           "a middlebox may be cutting TLS: try from another network, or check a proxy", address)


def _connect(url: str, infos: list[Any], port: int,
             left: Callable[[], float]) -> tuple[socket.socket | None, str, Reach]:
    """A TCP connection to the first address that takes one; else the last failure, named."""
    failure = Reach(url, "TCP", "TCP: the name resolved to no address", "check the host name in api.url")
    seen: set[str] = set()
    for family, kind, proto, _name, sockaddr in infos:
        address = str(sockaddr[0])
        if address in seen:
            continue
        seen.add(address)
        timeout = left()
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(sockaddr)
            return sock, address, failure
        except ConnectionRefusedError:
            failure = Reach(url, "TCP", f"TCP: connection refused by {address}:{port}",
                            f"nothing listens on {address}:{port}: is the control plane running, and is the port "
                            "in api.url right?", address)
        except TimeoutError:
            failure = Reach(url, "TCP", f"TCP: no answer from {address}:{port} within {timeout:g}s",
                            f"a firewall drops it or the address is wrong: allow outbound TCP to {address}:{port}",
                            address)
        except OSError as exc:
            failure = Reach(url, "TCP", f"TCP: cannot connect to {address}:{port} ({exc.strerror or exc})",
                            "check this machine's routes and firewall towards the control plane", address)
        sock.close()
    return None, "", failure


def _ping(url: str, sock: socket.socket, host: str, port: int, address: str, timeout: float, tls_kind: str) -> Reach:
    host_text = f"[{host}]" if ":" in host else host
    default = http_client.DEFAULT_PORTS.get(urlsplit(url).scheme.lower())
    authority = host_text if port == default else f"{host_text}:{port}"
    request = (f"GET {PING_PATH} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: plexd/{__version__} (doctor)\r\n"
               "Accept: application/json\r\nConnection: close\r\n\r\n").encode("latin-1")
    sock.settimeout(timeout)
    sent = time.time()
    response = http.client.HTTPResponse(sock)
    try:
        sock.sendall(request)
        response.begin()
    except TimeoutError:
        return Reach(url, "HTTP", f"HTTP: no answer to GET {PING_PATH} within {timeout:g}s",
                     "the server took the connection but does not answer: check its health", address, tls=tls_kind)
    except (OSError, http.client.HTTPException) as exc:
        return Reach(url, "HTTP", f"HTTP: no readable answer to GET {PING_PATH} ({exc.__class__.__name__}: {exc})",
                     "is api.url the control plane's address (and scheme)?", address, tls=tls_kind)
    finally:
        response.close()
    local = (sent + time.time()) / 2
    return _answered(url, response.status, response.getheader("Date"), local, address, tls_kind)


def _through_proxy(url: str, tls: ssl.SSLContext | None, timeout: float, proxy: str, tls_kind: str) -> Reach:
    async def ping() -> tuple[int, str | None, float]:
        async with http_client.HTTPClient(tls=tls, connect_timeout=timeout, read_timeout=timeout,
                                     write_timeout=timeout) as client:
            sent = time.time()
            async with asyncio.timeout(timeout * 2):
                response = await client.send("GET", url.rstrip("/") + PING_PATH,
                                             headers={"User-Agent": f"plexd/{__version__} (doctor)"})
                await response.aclose()
            return response.status_code, response.headers.get("Date"), (sent + time.time()) / 2

    # the path that matters is the one to the proxy (the MTU check follows it when its address is literal)
    host = proxy.rpartition(":")[0].strip("[]")
    address = host if _is_ip(host) else ""
    try:
        status, date, local = asyncio.run(ping())
    except TimeoutError:
        return Reach(url, "HTTP", f"HTTP through proxy {proxy}: no answer within {timeout * 2:g}s",
                     "check the proxy (HTTPS_PROXY / HTTP_PROXY) and whether it may reach the control plane",
                     address, proxy=proxy)
    except http_client.RequestFailed as exc:
        return Reach(url, "HTTP", f"HTTP through proxy {proxy}: {exc}",
                     "check the proxy (HTTPS_PROXY / HTTP_PROXY, NO_PROXY) and the control plane behind it",
                     address, proxy=proxy)
    return _with(_answered(url, status, date, local, address, tls_kind), proxy=proxy)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _answered(url: str, status: int, date: str | None, local: float, address: str, tls_kind: str) -> Reach:
    server = None
    if date:
        try:
            server = parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            server = None
    if 200 <= status < 300:
        return Reach(url, address=address, status=status, tls=tls_kind, server_date=server, local_time=local)
    return Reach(url, "HTTP", f"HTTP: GET {PING_PATH} answered {status}",
                 "the server answers but not as a plexd control plane: is api.url its base address?"
                 if status < 500 else "the control plane is up but failing: see its logs", address, status,
                 tls_kind, server_date=server, local_time=local)


def _with(found: Reach, **changes: Any) -> Reach:
    from dataclasses import replace

    return replace(found, **changes)


def _tls_context(ca_file: str, insecure: bool) -> ssl.SSLContext:
    """The TLS settings the daemon's client uses (plexd.controlplane.client), so the check proves the same trust."""
    if insecure:
        return http_client.unverified_tls_context()
    if not ca_file:
        return http_client.default_tls_context()
    ctx = ssl.create_default_context(cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def call_with_timeout(fn: Callable[[], T], timeout: float) -> T:
    """`fn()` in a daemon thread, or TimeoutError after `timeout`: getaddrinfo has no timeout of its own, and a
    thread left behind must not keep the command from exiting."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller, who decides
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="doctor-call")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box["value"]
