"""The control-plane HTTP client (plexd/controlplane/http_client.py: httpx) against real loopback sockets: a connection
per exchange, a server that closes or says too much, deadlines, decoding, broken answers, and the environment's proxies
(a real CONNECT proxy in front of a real TLS server). The wire tests (test_client_wire.py) check what the
control-plane calls put on the wire through it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import ssl
import subprocess
import zlib
from collections.abc import Awaitable, Callable

import pytest
from agentcore_recorder import Recorder, Reply, self_signed_ca, serving_tls
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plexd.controlplane import http_client

Conn = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class RawServer:
    """A loopback server that runs `handle(reader, writer, n)` for its n-th connection (from 1): the script
    decides every byte, including wrong ones."""

    def __init__(self, handle: Conn) -> None:
        self.handle = handle
        self.connections = 0
        self.port = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RawServer:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._tasks.add(asyncio.current_task())
            self.connections += 1
            try:
                await self.handle(reader, writer, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self._server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head (these tests send no bodies through RawServer)."""
    return await reader.readuntil(b"\r\n\r\n")


def answer(body: bytes = b"ok", *, headers: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body


async def get(client: http_client.HTTPClient, url: str, **kw) -> tuple[int, http_client.Headers, bytes]:
    async with client.stream("GET", url, **kw) as response:
        return response.status_code, response.headers, await response.aread()


# -- connections ---------------------------------------------------------------------------------------------


async def test_each_request_has_a_connection_of_its_own_and_says_so():
    heads = []

    async def handle(reader, writer, n):
        heads.append(await read_request(reader))
        writer.write(answer(f"conn {n}".encode()))
        await writer.drain()
        await asyncio.sleep(5)  # the client closes, not the server

    async with RawServer(handle) as server, http_client.HTTPClient() as client:
        assert [(await get(client, server.url))[2] for _ in range(3)] == [b"conn 1", b"conn 2", b"conn 3"]
        assert server.connections == 3
    assert all(b"\r\nConnection: close\r\n" in head for head in heads), heads


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_connection_closed_before_the_answer_is_an_error_never_a_second_send(method):
    async def handle(reader, writer, n):
        await read_request(reader)  # and the server closes: it may have acted on the request

    async with RawServer(handle) as server, http_client.HTTPClient() as client:
        with pytest.raises(http_client.TransportError, match="server disconnected without sending a response"):
            async with client.stream(method, server.url, content=b"{}" if method == "POST" else None):
                pass
        assert server.connections == 1


async def test_a_response_closed_before_its_end_does_not_go_back_to_the_pool():
    async def handle(reader, writer, n):
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
            await reader.read()  # EOF once the client drops the connection; a second request would hang here
            return
        writer.write(answer(b"second connection"))
        await writer.drain()

    async with RawServer(handle) as server, http_client.HTTPClient(read_timeout=2) as client:
        async with client.stream("GET", server.url) as response:
            assert response.status_code == 200  # not read to its end
        assert (await get(client, server.url))[2] == b"second connection"
        assert server.connections == 2


async def test_connect_failures_name_what_happened():
    async with RawServer(lambda r, w, n: asyncio.sleep(0)) as server:
        port = server.port
    async with http_client.HTTPClient() as client:
        with pytest.raises(http_client.TransportError, match=r"^cannot connect: .*(refused|111)"):
            await get(client, f"http://127.0.0.1:{port}/")
        with pytest.raises(http_client.TransportError, match="not an http"):
            await get(client, "ftp://127.0.0.1/")


async def test_an_unframeable_header_is_named_never_quoted():
    # Against a Go control plane the bearer is the node secret itself, and this message is logged at each retry.
    async with http_client.HTTPClient() as client:
        for secret, why in (("s3cr3t-node-key\nX: y", "control character"), ("s3cr3t\x00k", "control character"),
                            ("s3cr3t\u20ac", "not Latin-1")):
            with pytest.raises(http_client.TransportError, match=f"header Authorization has a value .*{why}") as caught:
                await get(client, "http://127.0.0.1:9/", headers={"Authorization": f"Bearer {secret}"})
            assert "s3cr3t" not in str(caught.value)


async def test_read_deadline_per_request_and_none_waits():
    async def handle(reader, writer, n):
        await read_request(reader)
        await asyncio.sleep(0.4)
        writer.write(answer(b"late"))
        await writer.drain()
        await asyncio.sleep(5)

    async with RawServer(handle) as server, http_client.HTTPClient(read_timeout=0.1) as client:
        with pytest.raises(http_client.TransportError, match=r"^read timed out$"):
            await get(client, server.url)
        assert (await get(client, server.url, read_timeout=None))[2] == b"late"


# -- bodies ----------------------------------------------------------------------------------------------------


async def test_chunked_gzip_and_deflate_bodies_are_decoded():
    text = b"x" * 100_000
    async with Recorder() as server, http_client.HTTPClient() as client:
        server.route("GET", "/gz", Reply(200, gzip.compress(text), {"Content-Encoding": "gzip"}))
        server.route("GET", "/zlib", Reply(200, zlib.compress(text), {"Content-Encoding": "deflate"}))
        raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        server.route("GET", "/raw", Reply(200, raw.compress(text) + raw.flush(), {"Content-Encoding": "deflate"}))
        server.route("GET", "/chunked", Reply(200, headers={}, chunks=[b"ab", b"cd"]))
        for path in ("/gz", "/zlib", "/raw"):
            assert (await get(client, server.url + path))[2] == text
        assert (await get(client, server.url + "/chunked"))[2] == b"abcd"


async def test_a_gzip_bomb_comes_out_in_bounded_steps():
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024))  # 64 MiB from ~64 KiB
    async with Recorder() as server, http_client.HTTPClient() as client:
        server.route("GET", "/", Reply(200, bomb, {"Content-Encoding": "gzip"}))
        async with client.stream("GET", server.url + "/") as response:
            largest = max([len(piece) async for piece in response.aiter_bytes()])
    assert largest <= http_client.DECODED_STEP


CUT_SHORT = gzip.compress(b"y" * 1000, mtime=0)[:-12]


# ids, not the bytes: every xdist worker must collect the same names (a gzip header holds its time)
@pytest.mark.parametrize("body,why", [(b"not gzip at all", "cannot be decoded"),
                                      (CUT_SHORT, "ends before its compressed stream")], ids=["not gzip", "cut short"])
async def test_a_body_that_is_not_what_its_encoding_says_is_a_decoding_error(body, why):
    async with Recorder() as server, http_client.HTTPClient() as client:
        server.route("GET", "/", Reply(200, body, {"Content-Encoding": "gzip"}))
        with pytest.raises(http_client.DecodingError, match=why):
            await get(client, server.url + "/")


async def test_headers_are_case_insensitive_and_repeats_are_joined():
    async def handle(reader, writer, n):
        await read_request(reader)
        writer.write(answer(headers="ETag: \"v1\"\r\nVary: a\r\nvary: b\r\n"))
        await writer.drain()

    async with RawServer(handle) as server, http_client.HTTPClient() as client:
        _, headers, _ = await get(client, server.url)
    assert headers["etag"] == headers.get("ETAG") == '"v1"' and headers["Vary"] == "a, b"
    assert "Retry-After" not in headers


@pytest.mark.parametrize("reply,why", [
    (b"SMTP ready\r\n\r\n", "protocol error"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (200 * 1024) + b"\r\n\r\n", "protocol error"),  # header past 64 KiB
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", "protocol error"),
])
async def test_broken_answers_are_protocol_errors(reply, why):
    async def handle(reader, writer, n):
        await read_request(reader)
        writer.write(reply)
        await writer.drain()

    async with RawServer(handle) as server, http_client.HTTPClient() as client:
        with pytest.raises(http_client.TransportError, match=why):
            await get(client, server.url)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=600),
                      st.builds(lambda head, body: b"HTTP/1.1 200 OK\r\n" + head + b"\r\n\r\n" + body,
                                st.binary(max_size=200), st.binary(max_size=200))))
def test_any_bytes_from_a_server_give_an_answer_or_an_http_error(data):
    async def scenario():
        async def handle(reader, writer, n):
            await read_request(reader)
            writer.write(data)
            await writer.drain()

        async with RawServer(handle) as server, http_client.HTTPClient(read_timeout=2) as client:
            try:
                await get(client, server.url)
            except http_client.RequestFailed:
                pass

    asyncio.run(scenario())


# -- proxies ---------------------------------------------------------------------------------------------------


class ConnectProxy(RawServer):
    """A real forward proxy: CONNECT tunnels and absolute-form plain requests, recording what it was asked."""

    def __init__(self) -> None:
        super().__init__(self._serve)
        self.asked: list[tuple[str, dict[str, str]]] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        line, *rest = head.split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in rest if h)}
        method, target, _ = line.split(" ")
        self.asked.append((f"{method} {target}", headers))
        if method == "CONNECT":
            host, port = target.rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:  # absolute form: forward the request as it came, to the origin it names
            host, port = target.split("/")[2].rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            up_writer.write(head.encode("latin-1"))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return self_signed_ca(tmp_path_factory.mktemp("tls"))


async def test_https_goes_through_the_environments_proxy_with_connect_and_its_credentials(tls_files):
    trust = ssl.create_default_context(cafile=str(tls_files[0]))
    async with Recorder(ssl_context=serving_tls(*tls_files)) as server, ConnectProxy() as proxy:
        env = {"HTTPS_PROXY": proxy.url.replace("http://", "http://ops:s%3Acret@")}
        async with http_client.HTTPClient(tls=trust, env=env) as client:
            status, _, _ = await get(client, server.url + "/v1/ping")
    assert status == 200 and server.requests[0].path == "/v1/ping"
    (asked, headers), = proxy.asked
    assert asked == f"CONNECT 127.0.0.1:{server.port}"
    assert headers["proxy-authorization"] == "Basic " + base64.b64encode(b"ops:s:cret").decode()
    assert "proxy-authorization" not in server.requests[0].headers  # the origin never sees them


async def test_plain_http_goes_to_the_proxy_in_absolute_form_and_no_proxy_bypasses_it():
    async with Recorder() as server, ConnectProxy() as proxy:
        async with http_client.HTTPClient(env={"http_proxy": proxy.url}) as client:
            await get(client, server.url + "/v1/ping?x=1")
        assert proxy.asked[0][0] == f"GET {server.url}/v1/ping?x=1"
        assert server.requests[0].path == f"{server.url}/v1/ping?x=1"  # forwarded as the proxy got it
        for no_proxy in ("127.0.0.1", "127.0.0.0/8", "*", "localhost, 127.0.0.1"):
            async with http_client.HTTPClient(env={"HTTP_PROXY": proxy.url, "NO_PROXY": no_proxy}) as client:
                await get(client, server.url + "/direct")
        assert len(proxy.asked) == 1 and server.requests[-1].path == "/direct"


def test_no_proxy_matches_names_their_subdomains_and_networks():
    assert http_client._bypassed("api.example.com", "example.com")
    assert http_client._bypassed("api.example.com", ".example.com")
    assert not http_client._bypassed("badexample.com", "example.com")
    assert http_client._bypassed("10.1.2.3", "10.0.0.0/8")
    assert not http_client._bypassed("10.1.2.3", "192.168.0.0/16,example.com")
    assert http_client._bypassed("::1", "::1")


async def test_a_proxy_scheme_it_cannot_speak_is_named():
    async with http_client.HTTPClient(env={"HTTPS_PROXY": "socks5://127.0.0.1:1080"}) as client:
        with pytest.raises(http_client.TransportError, match=r"proxy socks5://127.0.0.1 .*not supported"):
            await get(client, "https://127.0.0.1:1/")


async def test_a_proxy_that_refuses_connect_is_named():
    async def handle(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async with RawServer(handle) as proxy, http_client.HTTPClient(env={"HTTPS_PROXY": proxy.url}) as client:
        with pytest.raises(http_client.TransportError, match=r"cannot connect: proxy .* refused CONNECT: 403"):
            await get(client, "https://127.0.0.1:1/")


# -- the trust store -------------------------------------------------------------------------------------------


@pytest.fixture
async def tls_server(tls_files):
    async with Recorder(ssl_context=serving_tls(*tls_files)) as server:
        yield server


def hashed_dir(tmp_path, ca):
    """A CA directory as update-ca-certificates leaves it: the certificate under its subject hash."""
    subject_hash = subprocess.run(["openssl", "x509", "-subject_hash", "-noout", "-in", str(ca)], check=True,
                                  capture_output=True, text=True).stdout.strip()
    (tmp_path / f"{subject_hash}.0").write_bytes(ca.read_bytes())
    return tmp_path


async def test_the_default_trust_store_is_looked_up_lazily_and_the_environment_replaces_it(
        tls_server, tls_files, tmp_path, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    system = http_client.default_tls_context()
    if http_client._hashed(ssl.get_default_verify_paths().capath or ""):
        assert system.cert_store_stats()["x509_ca"] == 0  # nothing parsed up front
    async with http_client.HTTPClient() as client:  # the system store does not know the test CA
        with pytest.raises(http_client.TransportError, match="CERTIFICATE_VERIFY_FAILED"):
            await get(client, tls_server.url + "/")
    monkeypatch.setenv("SSL_CERT_DIR", str(hashed_dir(tmp_path, tls_files[0])))
    async with http_client.HTTPClient() as client:
        assert (await get(client, tls_server.url + "/"))[0] == 200
    monkeypatch.delenv("SSL_CERT_DIR")
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files[0]))
    async with http_client.HTTPClient() as client:
        assert (await get(client, tls_server.url + "/"))[0] == 200
    assert http_client.default_tls_context() is not system


async def test_a_directory_without_hash_links_is_not_taken_for_a_store(tmp_path):
    (tmp_path / "ca.pem").write_text("x")
    assert not http_client._hashed(str(tmp_path)) and not http_client._hashed(str(tmp_path / "absent"))


# -- what the review found ---------------------------------------------------------------------------------------


async def test_bytes_after_an_answer_are_nobodys_answer():
    smuggled = answer(b"smuggled")  # a whole second answer behind the first, in the same write

    async def handle(reader, writer, n):
        await read_request(reader)
        writer.write(answer(f"answer {n}".encode()) + (smuggled if n == 1 else b""))
        await writer.drain()
        await asyncio.sleep(5)

    async with RawServer(handle) as server, http_client.HTTPClient() as client:
        assert (await get(client, server.url))[2] == b"answer 1"
        assert (await get(client, server.url))[2] == b"answer 2"  # not the smuggled one from connection 1
        assert server.connections == 2


@pytest.mark.parametrize("status", [200, 204, 304])
async def test_an_empty_body_labelled_gzip_is_empty(status):
    async def handle(reader, writer, n):
        await read_request(reader)
        length = "" if status in (204, 304) else "Content-Length: 0\r\n"
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Encoding: gzip\r\n{length}\r\n".encode())
        await writer.drain()

    async with RawServer(handle) as server, http_client.HTTPClient() as client:
        assert (await get(client, server.url))[::2] == (status, b"")


async def test_an_answer_cut_in_the_middle_of_its_head_is_an_error_not_a_second_send():
    async def handle(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 20")  # part of a head, then gone: the request may have been acted on

    async with RawServer(handle) as server, http_client.HTTPClient() as client:
        with pytest.raises(http_client.TransportError, match="protocol error"):
            await get(client, server.url)
        assert server.connections == 1


async def test_request_input_it_cannot_send_is_a_transport_error_and_latin_1_goes_out_as_it_came():
    heads = []

    async def handle(reader, writer, n):
        heads.append(await read_request(reader))
        writer.write(answer())
        await writer.drain()

    async with RawServer(handle) as server, http_client.HTTPClient() as client:
        for headers in ({"X": "a\r\nInjected: 1"}, {"X": "€"}):
            with pytest.raises(http_client.TransportError, match="bad request"):
                await get(client, server.url, headers=headers)
        await get(client, server.url, headers={"If-None-Match": '"caf\xe9"'})
        assert b'If-None-Match: "caf\xe9"' in heads[-1] and len(heads) == 1
    async with http_client.HTTPClient(env={"HTTP_PROXY": "http://proxy:notaport"}) as client:
        with pytest.raises(http_client.TransportError, match="bad request"):
            await get(client, "http://127.0.0.1:1/")


async def test_a_certificate_the_trust_store_does_not_know_says_where_trust_comes_from(tls_server):
    async with http_client.HTTPClient() as client:
        with pytest.raises(http_client.TransportError,
                           match=r"CERTIFICATE_VERIFY_FAILED.*api.tls.ca_file.*ca-certificates"):
            await get(client, tls_server.url + "/")
