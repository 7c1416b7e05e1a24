"""A tiny HTTP/1.1 server that records every request and answers from a script (agent-core wire tests).

This is the one place a recording server is right (issue 3): the wire tests check the exact bytes the client
puts on the wire — method, path, headers, body — which the real control plane would accept without showing.
It runs in the test's event loop (asyncio streams), supports keep-alive, chunked responses and TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gzip
import ipaddress
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Recorded:
    method: str
    path: str  # raw request target, escapes kept
    headers: dict[str, str]  # lower-cased names
    body: bytes  # as received (maybe gzipped)

    @property
    def json(self):
        data = gzip.decompress(self.body) if self.headers.get("content-encoding") == "gzip" else self.body
        return json.loads(data)

    @property
    def text(self) -> str:
        data = gzip.decompress(self.body) if self.headers.get("content-encoding") == "gzip" else self.body
        return data.decode()


@dataclass
class Reply:
    status: int = 200
    body: bytes | str = b"{}"
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    # For streaming: chunks sent with `delay` seconds between them (chunked transfer encoding).
    chunks: list[bytes] | None = None
    delay: float = 0.0


Handler = Callable[[Recorded], Reply | Awaitable[Reply]]


class Recorder:
    def __init__(self, handler: Handler | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        self.requests: list[Recorded] = []
        self.handler = handler or (lambda req: Reply())
        self.routes: dict[tuple[str, str], list[Reply] | Reply] = {}
        self._ssl = ssl_context
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"{'https' if self._ssl else 'http'}://127.0.0.1:{self.port}"

    def route(self, method: str, path: str, *replies: Reply) -> None:
        """Answer METHOD PATH with these replies in turn (the last one repeats)."""
        self.routes[(method, path)] = list(replies)

    async def __aenter__(self) -> Recorder:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        for task in list(self._conns):
            with contextlib.suppress(BaseException):
                await task
        await self._server.wait_closed()

    async def _reply_for(self, req: Recorded) -> Reply:
        scripted = self.routes.get((req.method, req.path.split("?")[0]))
        if scripted is not None:
            return scripted.pop(0) if len(scripted) > 1 else scripted[0]
        reply = self.handler(req)
        if asyncio.iscoroutine(reply):
            reply = await reply
        return reply

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(asyncio.current_task())
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = h.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = b""
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding") == "chunked":
                    while True:
                        size = int((await reader.readline()).strip(), 16)
                        chunk = await reader.readexactly(size + 2)
                        if size == 0:
                            break
                        body += chunk[:-2]
                req = Recorded(method, target, headers, body)
                self.requests.append(req)
                reply = await self._reply_for(req)
                await self._write(writer, reply)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._conns.discard(asyncio.current_task())
            writer.close()

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, reply: Reply) -> None:
        reason = {200: "OK", 204: "No Content"}.get(reply.status, "Status")
        head = [f"HTTP/1.1 {reply.status} {reason}"]
        head += [f"{k}: {v}" for k, v in reply.headers.items()]
        if reply.chunks is None:
            body = reply.body.encode() if isinstance(reply.body, str) else reply.body
            head.append(f"Content-Length: {len(body)}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            await writer.drain()
            return
        head.append("Transfer-Encoding: chunked")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        await writer.drain()
        for chunk in reply.chunks:
            if reply.delay:
                await asyncio.sleep(reply.delay)
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def self_signed_ca(d: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) in `d`: a self-signed CA certificate for 127.0.0.1, to serve TLS and to trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "plexd test CA")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return d / "cert.pem", d / "key.pem"


def serving_tls(cert: Path, key: Path) -> ssl.SSLContext:
    """A server-side TLS context presenting `cert`."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx
