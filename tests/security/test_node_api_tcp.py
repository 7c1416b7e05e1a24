"""Attacks on the node API's TCP listener from the network: a slowloris that tries to starve the root socket, a
request whose body is never sent, a token guessed again and again. Real TCP and Unix sockets, the real server."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from node_api_helpers import (
    TCP_TOKEN,
    node_api_fixture,  # noqa: F401 - provides the node_api fixture
    unix_call,
)

from plexd.base.ratelimit import RateLimiter
from plexd.nodeapi import local_api

pytestmark = pytest.mark.root  # the socket's group is a real group (groupadd)

PARTIAL_HEAD = b"GET /v1/state HTTP/1.1\r\nHost: x\r\nUser-Agent: slow"  # never finished


def exchange(address, data: bytes, *, source: str | None = None, timeout: float = 10.0) -> bytes:
    """Send `data` on a fresh TCP connection and read until the server closes it."""
    with socket.create_connection(address, timeout=timeout, source_address=(source, 0) if source else None) as s:
        s.sendall(data)
        return read_to_eof(s)


def read_to_eof(s: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def request(method: str, path: str, *, token: str | None = None, body: bytes = b"",
            length: int | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\n"
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    if body or length is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body) if length is None else length}\r\n"
    return head.encode() + b"\r\n" + body


def status_and_body(raw: bytes) -> tuple[int, object]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, body


async def wait_for(condition, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_tcp_slowloris_of_200_connections_never_starves_the_root_socket(node_api, record_property):
    """200 TCP connections that each send half a request head and hold it (the head deadline set long, so they
    hold their slots for the whole test): TCP's own budget (16) is full and the rest are turned away at the door,
    while root on the Unix socket is answered every time. The latency is recorded, not asserted (bench/
    node_api_tcp_flood.py measures it)."""
    served = await node_api(tcp=True, header_timeout=120, request_timeout=120)
    api = served.api
    assert api.tcp_max_connections == local_api.TCP_MAX_CONNECTIONS == 16

    def open_flood() -> list[socket.socket]:
        socks = []
        for _ in range(200):
            s = socket.create_connection(api.tcp_address, timeout=10)
            try:
                s.sendall(PARTIAL_HEAD)
            except OSError:
                pass  # already refused at the door and closed
            socks.append(s)
        return socks

    flood = await asyncio.to_thread(open_flood)
    try:
        await wait_for(lambda: api.tcp_refused + len(api._tcp_connections) >= 200,
                       f"the server to take or refuse all 200 (refused {api.tcp_refused}, "
                       f"open {len(api._tcp_connections)})")
        assert len(api._tcp_connections) == 16 and api.tcp_refused == 184
        assert not api._connections  # the flood holds none of the socket's 64 slots

        latencies = []
        for _ in range(20):
            started = time.perf_counter()
            status, doc = await asyncio.to_thread(unix_call, api.socket_path, "GET", "/v1/state/metadata",
                                                  timeout=10)  # the generous bound: an answer within 10 s
            latencies.append((time.perf_counter() - started) * 1000)
            assert (status, doc) == (200, {"env": "prod"})
        record_property("unix_socket_ms_during_tcp_flood", f"median {sorted(latencies)[10]:.2f}, "
                                                           f"max {max(latencies):.2f}")
        print(f"root socket during a 200-connection TCP slowloris: median {sorted(latencies)[10]:.2f} ms, "
              f"max {max(latencies):.2f} ms")
        assert len(api._tcp_connections) == 16  # the slowloris still holds its slots: we were answered anyway

        # one refused at the door was told why, without the server reading a byte from it
        answers = [status_and_body(read_to_eof(s)) for s in flood[-5:]]
        assert (503, {"error": "too many TCP connections to the node API"}) in answers, answers
    finally:
        for s in flood:
            s.close()
    await wait_for(lambda: not api._tcp_connections, "the slowloris connections to be closed")


async def test_a_request_head_that_never_ends_is_cut_at_the_header_deadline(node_api):
    served = await node_api(tcp=True, header_timeout=1, request_timeout=30)
    raw = await asyncio.to_thread(exchange, served.api.tcp_address, PARTIAL_HEAD)
    assert status_and_body(raw) == (408, {"error": "request head not completed within 1s"}), raw
    # a connection that says nothing at all is closed at the same deadline, with no answer
    assert await asyncio.to_thread(exchange, served.api.tcp_address, b"") == b""


@pytest.mark.parametrize("token", [None, "wrong-token", ""])
async def test_an_unauthenticated_request_gets_401_before_its_body_is_sent(node_api, token):
    """The head announces a 1 MB body that never comes: the 401 arrives anyway, and the connection is closed.
    The server could only decide from the head, so it never read a body byte."""
    served = await node_api(tcp=True, header_timeout=30, request_timeout=30)
    head_only = request("PUT", "/v1/state/report/planted", token=token, length=1_000_000)
    raw = await asyncio.to_thread(exchange, served.api.tcp_address, head_only)
    assert status_and_body(raw) == (401, {"error": "unauthorized"}), raw
    assert b"\r\nwww-authenticate: Bearer\r\n" in raw and b"\r\nconnection: close\r\n" in raw.lower()
    assert served.reports.get("planted") is None

    # the same request with the token is read and stored: the 401 was the token, not the shape
    body = json.dumps({"content_type": "text/plain", "payload": "ok"}).encode()
    raw = await asyncio.to_thread(exchange, served.api.tcp_address,
                                  request("PUT", "/v1/state/report/planted", token=TCP_TOKEN, body=body))
    assert status_and_body(raw)[0] == 200, raw
    assert served.reports.get("planted").payload == "ok"


async def test_401s_are_limited_per_source_address(node_api):
    """A token guessed again and again from one address: after the burst of 401s the address is refused at the
    door with 429 (even with the right token, until its bucket refills); another address is not affected."""
    served = await node_api(tcp=True, auth_failures=RateLimiter(rate=0.001, burst=5))
    address = served.api.tcp_address

    def guess(token: str, source: str = "127.0.0.1") -> tuple[int, object]:
        return status_and_body(exchange(address, request("GET", "/v1/state/metadata", token=token), source=source))

    for i in range(5):
        assert await asyncio.to_thread(guess, f"guess-{i}") == (401, {"error": "unauthorized"})
    status, doc = await asyncio.to_thread(guess, "guess-5")
    assert status == 429 and doc == {"error": "too many unauthorized requests from 127.0.0.1; retry later"}
    assert (await asyncio.to_thread(guess, TCP_TOKEN))[0] == 429  # refused at the door, unread
    assert await asyncio.to_thread(guess, TCP_TOKEN, "127.0.0.2") == (200, {"env": "prod"})


async def test_the_default_401_limit_is_ten_then_one_every_five_seconds(node_api):
    served = await node_api(tcp=True)
    limiter = served.api.auth_failures
    assert (limiter.rate, limiter.burst) == (local_api.AUTH_FAILURE_RATE, local_api.AUTH_FAILURE_BURST) == (0.2, 10)
