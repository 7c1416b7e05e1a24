"""The relay domain (bridge mode) through the real engine, with a real UDP relay and real sockets on loopback
standing in for two WireGuard ends: sessions from the state's bridge block are served, a relay socket that dies is
drift (reopened and reported), an event revokes a session, and a bridge node's daemon lists only what it was
assigned. The sides' public keys, which the relay checks handshakes' mac1 with, come from the state's peers. The
kernel fast path's drift is in tests/e2e/test_relay_lab.py (it needs a namespace of its own)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import socket
import struct
from datetime import UTC, datetime, timedelta

import pytest
from engine_helpers import converge
from nacl.public import PrivateKey

from plexd.base.errors import WireFormatError
from plexd.bridge.relay_domain import RelayDomain, live_elements
from plexd.state.desired import DesiredState
from plexd.state.model import Peer, State

LATER = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")


def entry(sid: str, a: tuple[str, int], b: tuple[str, int]) -> dict:
    return {"session_id": sid, "peer_a_id": f"n_{sid}_a", "peer_a_endpoint": f"{a[0]}:{a[1]}",
            "peer_b_id": f"n_{sid}_b", "peer_b_endpoint": f"{b[0]}:{b[1]}", "expires_at": LATER}


def public_key(node: str) -> str:
    return base64.b64encode(bytes(PrivateKey(hashlib.sha256(node.encode()).digest()).public_key)).decode()


def peer(node: str, k: int) -> dict:
    return {"id": node, "public_key": public_key(node), "mesh_ip": f"10.1.0.{k}"}


def model(state: dict) -> DesiredState:
    """A bridge's desired state, with every node its relay sessions name among its peers (their keys)."""
    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.1.0.1")
    relay = (state.get("bridge") or {}).get("relay") or state.get("relay_config") or {}
    nodes = sorted({s[k] for s in relay.get("sessions") or [] for k in ("peer_a_id", "peer_b_id")})
    return base.with_state(State.from_wire({"peers": [peer(n, 2 + k) for k, n in enumerate(nodes)], **state}))


def initiation(sender: int, to: str) -> bytes:
    """A handshake initiation with the mac1 WireGuard puts on it for node `to`."""
    message = bytes([1, 0, 0, 0]) + struct.pack("<I", sender) + b"\x11" * 108
    key = hashlib.blake2s(b"mac1----" + base64.b64decode(public_key(to))).digest()
    return message + hashlib.blake2s(message, key=key, digest_size=16).digest() + bytes(16)


@pytest.fixture
def ends():
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
    yield socks
    for s in socks:
        s.close()


async def relayed(domain: RelayDomain, src: socket.socket, dst: socket.socket, packet: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    await loop.sock_sendto(src, packet, ("127.0.0.1", domain.relay.port))
    data, _ = await asyncio.wait_for(loop.sock_recvfrom(dst, 2048), 5)
    return data


async def test_sessions_are_served_a_dead_socket_is_reopened_and_a_revocation_applies(ends):
    a, b = ends
    domain = RelayDomain("127.0.0.1", 0)
    desired = model({"bridge": {"relay": {"sessions": [entry("rel_1", a.getsockname(), b.getsockname())]}}})
    try:
        started = await converge(domain, desired)
        assert [c.correction().type for c in started.changes] == ["relay_listener_started", "relay_session_added"]
        assert await relayed(domain, a, b, initiation(100, "n_rel_1_b")) == initiation(100, "n_rel_1_b")
        assert [s["session_id"] for s in domain.status()["sessions"]] == ["rel_1"]
        assert (await converge(domain, desired)).changes == ()

        domain.relay.close_socket()  # the relay's socket dies under it
        repaired = await converge(domain, desired)
        assert [str(c.correction()) for c in repaired.changes] == [
            "relay_listener_started: relay 127.0.0.1:0: its socket is closed; reopened"]
        assert await relayed(domain, a, b, initiation(101, "n_rel_1_b")) == initiation(101, "n_rel_1_b")

        revoked = desired.with_relay_event(lambda relay: relay.revoked({"session_id": "rel_1"}))
        gone = await domain.apply_delta(revoked, None)
        assert [c.correction().type for c in gone.changes] == ["relay_session_removed"]
        assert domain.status()["sessions"] == []
    finally:
        await domain.teardown()
    assert not domain.relay.listening


async def test_a_side_that_is_not_a_peer_gets_no_handshake_until_its_key_is_known(ends):
    a, b = ends
    sessions = {"bridge": {"relay": {"sessions": [entry("rel_1", a.getsockname(), b.getsockname())]}}}
    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.1.0.1")
    only_a = base.with_state(State.from_wire({"peers": [peer("n_rel_1_a", 2)], **sessions}))
    domain = RelayDomain("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    try:
        await converge(domain, only_a)
        [status] = domain.status()["sessions"]
        assert "no WireGuard public key for n_rel_1_b" in status["handshakes_refused"]
        await loop.sock_sendto(a, initiation(100, "n_rel_1_b"), ("127.0.0.1", domain.relay.port))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(loop.sock_recvfrom(b, 2048), 0.5)
        assert domain.status()["dropped"]["bad_mac1"] == 1

        # b becomes a peer (a peer_added event): the next apply takes its key.
        both = only_a.with_peer(Peer.from_wire(peer("n_rel_1_b", 3)))
        await converge(domain, both, full=False)
        assert domain.status()["sessions"][0]["handshakes_refused"] is None
        assert await relayed(domain, a, b, initiation(101, "n_rel_1_b")) == initiation(101, "n_rel_1_b")
    finally:
        await domain.teardown()


async def test_the_101st_session_is_refused_and_listed_the_rest_served(ends):
    a, b = ends
    entries = [entry(f"rel_{i}", a.getsockname(), b.getsockname()) for i in range(101)]
    domain = RelayDomain("127.0.0.1", 0)
    try:
        result = await converge(domain, model({"relay_config": {"sessions": entries}}))  # the older shape
        assert sum(c.correction().type == "relay_session_added" for c in result.changes) == 100
        assert [r["session_id"] for r in domain.status()["refused"]] == ["rel_100"]
    finally:
        await domain.teardown()


async def test_a_port_in_use_is_an_error_line_and_nothing_else_breaks(ends):
    a, _ = ends
    domain = RelayDomain("127.0.0.1", a.getsockname()[1])
    # UDP: the end's socket holds the port without SO_REUSEADDR, so the relay cannot bind it
    result = await converge(domain, model({}))
    assert any("cannot listen on 127.0.0.1:" in e for e in result.errors), result.errors
    await domain.teardown()


def test_a_bad_relay_event_is_refused_with_its_field():
    from plexd.state.relay_block import parse_session

    with pytest.raises(WireFormatError, match="peer_a_endpoint"):
        parse_session({"session_id": "r", "peer_a_id": "a", "peer_a_endpoint": "nowhere", "peer_b_id": "b",
                       "peer_b_endpoint": "192.0.2.1:1", "expires_at": LATER}, "payload")


def test_live_elements_reads_both_maps_back_into_pairs():
    listed = [{"map": {"name": "fwd_addr", "elem": [[{"concat": ["192.0.2.1", 40001]}, "192.0.2.2"]]}},
              {"map": {"name": "fwd_port", "elem": [[{"concat": ["192.0.2.1", 40001]}, 51820]]}}]
    assert live_elements(listed) == {("192.0.2.1", 40001): ("192.0.2.2", 51820)}
