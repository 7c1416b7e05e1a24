"""Hostile and broken STUN servers over real UDP sockets on loopback: each one is logged with the server and what
it did, the next one is tried, and nothing crashes. The servers here are deliberately broken stand-ins (no real
STUN server answers garbage on request); the real coturn is in tests/e2e/test_nat_lab.py.

Also the NAT service's bookkeeping against them: what it reports, when, and that a failure streak is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable

import pytest

from plexd.nat.discovery import discover
from plexd.nat.endpoint_domain import Endpoint
from plexd.nat.nat_service import NatService
from plexd.nat.probe import BoundTransport
from plexd.nat.servers import parse_server
from plexd.nat.stun import HEADER, MAGIC_COOKIE, binding_response

Answer = Callable[[bytes, tuple[str, int]], list[bytes]]


class FakeStun(asyncio.DatagramProtocol):
    """A UDP server on 127.0.0.1 that answers each request with what `answer(request, source)` returns."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.requests += 1
        for reply in self.answer(data, addr):
            self.transport.sendto(reply, addr)


def txid(req: bytes) -> bytes:
    return req[8:20]


def good(req, addr):
    return [binding_response(txid(req), addr[0], addr[1])]


def mapped_elsewhere(req, addr):
    return [binding_response(txid(req), addr[0], addr[1] + 1)]


BROKEN: dict[str, tuple[Answer, str]] = {
    "garbage": (lambda req, addr: [b"\xde\xad\xbe\xef" * 8], "not a STUN message"),
    "wrong cookie": (lambda req, addr: [HEADER.pack(0x0101, 0, 0x11111111, txid(req))], "wrong magic cookie"),
    "wrong transaction": (lambda req, addr: [binding_response(b"z" * 12, "192.0.2.1", 1)],
                          "unrelated datagram(s) ignored)"),
    "ipv6 mapped": (lambda req, addr: [HEADER.pack(0x0101, 24, MAGIC_COOKIE, txid(req))
                                       + struct.pack("!HHBBH", 0x0020, 20, 0, 2, 1) + bytes(16)],
                    "IPv6 address; plexd discovers IPv4 endpoints only"),
    "silent": (lambda req, addr: [], "no answer within 0.6s"),
}


@pytest.fixture
async def servers():
    loop = asyncio.get_running_loop()
    made = []

    async def start(answer: Answer) -> tuple[str, FakeStun]:
        transport, proto = await loop.create_datagram_endpoint(lambda: FakeStun(answer), local_addr=("127.0.0.1", 0))
        made.append(transport)
        return f"127.0.0.1:{transport.get_extra_info('sockname')[1]}", proto

    yield start
    for t in made:
        t.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", list(BROKEN))
async def test_a_broken_server_is_named_and_the_next_one_answers(servers, kind) -> None:
    answer, problem = BROKEN[kind]
    bad, bad_proto = await servers(answer)
    ok, _ = await servers(good)
    transport = BoundTransport.bind(free_port())
    try:
        found = await discover(transport, [parse_server(bad), parse_server("no-such-host.invalid"),
                                           parse_server(ok)], timeout=0.6)
    finally:
        transport.close()
    assert found.ok and found.server == ok and str(found.public) == f"127.0.0.1:{transport.local_port}"
    assert found.nat_type == "none"  # the server saw the machine's own address and port
    failures = dict(found.failures)
    assert problem in failures[bad], failures
    assert "cannot resolve no-such-host.invalid" in failures["no-such-host.invalid:3478"]
    assert bad_proto.requests >= 1


async def test_two_servers_that_see_different_ports_mean_symmetric(servers) -> None:
    first, _ = await servers(mapped_elsewhere)
    second, _ = await servers(lambda req, addr: [binding_response(txid(req), addr[0], addr[1] + 2)])
    transport = BoundTransport.bind(free_port())
    try:
        found = await discover(transport, [parse_server(first), parse_server(second)], timeout=1)
        same = await discover(transport, [parse_server(first), parse_server(first.replace("127.0.0.1", "localhost")),
                                          parse_server(first)], timeout=1)
    finally:
        transport.close()
    assert (found.nat_type, found.public.port) == ("symmetric", transport.local_port + 1)
    assert same.nat_type == "unknown"  # one server under three names answers only once: no second opinion


async def test_a_lost_request_is_sent_again(servers) -> None:
    seen = []

    def drop_first(req, addr):
        seen.append(txid(req))
        return [] if len(seen) == 1 else good(req, addr)

    srv, _ = await servers(drop_first)
    transport = BoundTransport.bind(free_port())
    try:
        found = await discover(transport, [parse_server(srv)], timeout=2)
    finally:
        transport.close()
    assert found.ok and len(seen) == 2 and seen[0] == seen[1]  # the same transaction, resent


def service(srv_list, changes: list[str]) -> NatService:
    return NatService([parse_server(s) for s in srv_list], free_port(), changes.append, refresh_interval=30,
                      timeout=0.5, local_target=lambda: "127.0.0.1", raw_transport=BoundTransport.bind)


async def test_the_service_says_when_the_endpoint_to_report_changes(servers, caplog) -> None:
    srv, _ = await servers(good)
    changes: list[str] = []
    svc = service([srv], changes)
    assert svc.current() is None
    assert await svc.refresh_once() == 30
    assert await svc.refresh_once() == 30
    assert svc.current() == Endpoint(f"127.0.0.1:{svc.listen_port}", "none")
    assert changes == [f"NAT discovery: public endpoint 127.0.0.1:{svc.listen_port} (none)"]  # unchanged: once


async def test_silence_means_the_local_endpoint_logs_once_and_backs_off(servers, caplog) -> None:
    srv, _ = await servers(BROKEN["silent"][0])
    changes: list[str] = []
    svc = service([srv], changes)
    caplog.set_level(logging.DEBUG, logger="plexd.nat")
    delays = [await svc.refresh_once() for _ in range(3)]
    assert svc.current() == Endpoint(f"127.0.0.1:{svc.listen_port}", "unknown") and len(changes) == 1
    assert all(d < 30 for d in delays) and delays[0] < delays[2]  # backoff towards the refresh interval
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("NAT discovery failed" in w for w in warnings) == 1
    assert sum(f"STUN server {srv}: no answer" in w for w in warnings) == 1
    assert svc.status()["consecutive_failures"] == 3 and "no answer within 0.5s" in svc.status()["last_error"]


async def test_the_start_hand_over_ends_at_its_deadline_whatever_the_servers_do(servers) -> None:
    """Silent servers at start: the first discovery gives the listen port up at the hand-over deadline (the
    device must get it), names why, and the next attempt uses the other transport."""
    from plexd.nat.nat_service import PortHandover

    silent, _ = await servers(BROKEN["silent"][0])
    port = free_port()
    handover = PortHandover.try_bind(port, deadline=0.4)
    assert handover is not None
    opened = []

    def raw(p):  # stands in for the raw socket (no root needed here); records that the refresh path was used
        opened.append(p)
        return BoundTransport.bind(p)

    svc = NatService([parse_server(silent), parse_server(silent)], port, timeout=5, handover=handover,
                     raw_transport=raw)
    loop = asyncio.get_running_loop()
    start = loop.time()
    found = await svc._discover()
    assert loop.time() - start < 1.0 and not found.ok
    assert "no answer before the WireGuard device needed the listen port" in found.failures[0][1]
    await asyncio.wait_for(handover.released(), 0.1)
    assert opened == []
    svc.timeout = 0.3
    await svc._discover()
    assert opened == [port]  # later attempts: the refresh transport, closed after use
    BoundTransport.bind(port).close()
