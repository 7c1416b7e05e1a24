"""The relay's pure parts: session parsing and limits, the WireGuard header and its mac1, the flow table (by index,
not by source ip:port), leases refreshed during a control-plane outage. Handshakes carry the mac1 WireGuard puts on
them, computed here from the spec with hashlib (tests/unit/test_bridge_relay_flows.py: what it keeps out). The
relay's sockets are tested for real in tests/e2e/test_relay_lab.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import socket
import struct
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.public import PrivateKey

from plexd.base.clock import FakeClock
from plexd.base.errors import WireFormatError
from plexd.bridge import wgheader
from plexd.bridge.flows import INDICES_PER_SIDE, FlowTable
from plexd.bridge.relay import Relay
from plexd.state.relay_block import MAX_SESSIONS, RelaySessionSet, parse_session

NOW = datetime(2025, 1, 15, 10, 30, tzinfo=UTC)
A_ADDR, B_ADDR, C_ADDR = ("198.51.100.7", 40001), ("203.0.113.9", 51820), ("192.0.2.44", 7000)


def public_key(node: str) -> str:
    """A node's WireGuard public key (base64), the same for the same name."""
    return base64.b64encode(bytes(PrivateKey(hashlib.sha256(node.encode()).digest()).public_key)).decode()


def doc(sid="rel_1", a="n_a", a_ep="198.51.100.7:40001", b="n_b", b_ep="203.0.113.9:51820",
        expires=NOW + timedelta(hours=1)):
    return {"session_id": sid, "peer_a_id": a, "peer_a_endpoint": a_ep, "peer_b_id": b, "peer_b_endpoint": b_ep,
            "expires_at": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "peer_a_public_key": public_key(a), "peer_b_public_key": public_key(b)}


def with_mac1(message: bytes, to: str) -> bytes:
    """`message` with the mac1 WireGuard puts on a handshake for node `to`: BLAKE2s-128 keyed with
    BLAKE2s-256("mac1----" || to's public key), over the bytes before it (the last 32 are mac1 and mac2)."""
    key = hashlib.blake2s(b"mac1----" + base64.b64decode(public_key(to))).digest()
    at = len(message) - 32
    return message[:at] + hashlib.blake2s(message[:at], key=key, digest_size=16).digest() + message[at + 16:]


def initiation(sender: int, to: str = "n_b") -> bytes:
    return with_mac1(bytes([1, 0, 0, 0]) + struct.pack("<I", sender) + b"\x11" * 140, to)


def response(sender: int, receiver: int, to: str = "n_a") -> bytes:
    return with_mac1(bytes([2, 0, 0, 0]) + struct.pack("<II", sender, receiver) + b"\x22" * 80, to)


def cookie(receiver: int) -> bytes:
    return bytes([3, 0, 0, 0]) + struct.pack("<I", receiver) + b"\x33" * 56


def data(receiver: int, size: int = 64) -> bytes:
    return bytes([4, 0, 0, 0]) + struct.pack("<I", receiver) + b"\x44" * (size - 8)


# Sessions


def test_session_parses_state_entry_and_event_payload_alike():
    s = parse_session(doc())
    assert (s.session_id, s.peer_a_endpoint, s.peer_b_endpoint) == ("rel_1", A_ADDR, B_ADDR)
    assert s.ttl(NOW) == 300.0
    assert s.ttl(NOW + timedelta(minutes=58)) == 120.0
    assert parse_session(doc(a_ep="[2001:db8::1]:51820")).peer_a_endpoint == ("2001:db8::1", 51820)
    assert (s.peer_a_public_key, s.peer_b_public_key) == (public_key("n_a"), public_key("n_b"))
    bare = {k: v for k, v in doc().items() if not k.endswith("_public_key")}  # optional: a bridge's peers have them
    assert parse_session(bare).peer_a_public_key == ""


@pytest.mark.parametrize("field,value,named", [
    ("session_id", "", "session.session_id"),
    ("peer_a_id", 5, "session.peer_a_id"),
    ("peer_b_id", "n_a", "session.peer_b_id"),
    ("peer_a_endpoint", "198.51.100.7", "session.peer_a_endpoint"),
    ("peer_a_endpoint", "host.example:80", "session.peer_a_endpoint"),
    ("peer_b_endpoint", "203.0.113.9:70000", "session.peer_b_endpoint"),
    ("peer_b_endpoint", "0.0.0.0:5", "session.peer_b_endpoint"),
    ("expires_at", "tomorrow", "session.expires_at"),
    ("peer_a_public_key", "not a key", "session.peer_a_public_key"),
    ("peer_b_public_key", base64.b64encode(bytes(31)).decode(), "session.peer_b_public_key"),
])
def test_bad_session_error_names_the_field(field, value, named):
    bad = doc()
    bad[field] = value
    with pytest.raises(WireFormatError) as e:
        parse_session(bad)
    assert e.value.path == named


def test_both_state_shapes_give_one_set_and_bad_entries_are_refused_alone():
    newer = {"bridge": {"relay": {"sessions": [doc("r1"), doc("r2", b_ep="nope"), doc("r3")]}}}
    older = {"relay_config": {"sessions": [doc("r1"), doc("r2", b_ep="nope"), doc("r3")]}}
    for state in (newer, older):
        got = RelaySessionSet.from_state(state)
        assert list(got.sessions) == ["r1", "r3"]
        assert [r.session_id for r in got.refused] == ["r2"]
        assert "relay.sessions[1].peer_b_endpoint" in got.refused[0].reason
    assert len(RelaySessionSet.from_state({"bridge": {"relay": None}})) == 0


def test_the_101st_session_and_duplicates_are_refused_the_rest_untouched():
    entries = [doc(f"r{i}") for i in range(MAX_SESSIONS + 1)] + [doc("r0")]
    got = RelaySessionSet.from_state({"bridge": {"relay": {"sessions": entries}}})
    assert list(got.sessions) == [f"r{i}" for i in range(MAX_SESSIONS)]
    assert [(r.session_id, "limit of 100" in r.reason) for r in got.refused] == [("r100", True), ("r0", False)]
    assert "duplicate session_id" in got.refused[1].reason


def test_events_assign_replace_and_revoke():
    got = RelaySessionSet()
    assert got.assigned(doc("r1")) is None
    assert got.assigned(doc("r1", b_ep="203.0.113.9:1")) is None  # a newer assignment of the same id
    assert got.sessions["r1"].peer_b_endpoint == ("203.0.113.9", 1)
    assert got.revoked({"session_id": "r1"}) is True
    assert got.revoked({"session_id": "r1"}) is False
    with pytest.raises(WireFormatError, match=r"relay_session_revoked\.session_id"):
        got.revoked({})


# The WireGuard header


def test_header_of_each_message_type():
    assert wgheader.parse(initiation(7)) == wgheader.WgHeader(1, 7, None)
    assert wgheader.parse(response(8, 7)) == wgheader.WgHeader(2, 8, 7)
    assert wgheader.parse(cookie(7)) == wgheader.WgHeader(3, None, 7)
    assert wgheader.parse(data(0xFFFFFFFF, 32)) == wgheader.WgHeader(4, None, 0xFFFFFFFF)
    # A full-MTU packet of a 1420 tunnel: wireguard-go pads to 16 only up to the MTU (1452 = 16 + 1420 + 16).
    assert wgheader.parse(data(9, 1452)) == wgheader.WgHeader(4, None, 9)


# A handshake wireguard-go v0.0.20220316 sent between two devices (captured through a UDP middleman): its mac1s
# verify with public keys alone, an initiation's with its responder's, a response's with its initiator's.
GO_INITIATOR = "EYx6XgWrsDpAHue1+wSFj2pSyxWemXc7kfwyy6m+2mM="
GO_RESPONDER = "E0RchSgZLm+9KHoX5d+styiu4hH9C6JFt2IbQdyw0jk="
GO_INITIATION = bytes.fromhex(
    "01000000b2e818d0a25799031e0464682007c4705a689bf6714a4e905acf66391bd6cfd010755d42798f74a87ed7a83f155845bd2fe960"
    "90ac36e3b6c9719b4ba050d3c92802b8d860600b2fbabe13a2f62a0e77407048ce76300b75f5d807aa580f278a5f595ad3c8f73c91b10b5c"
    "1839908085edce885ab34797ee918ee7a3bc288e1600000000000000000000000000000000")
GO_RESPONSE = bytes.fromhex(
    "0200000010899da7b2e818d0bba17562b2a40085d6115a1f11d9af09f8bd1dfb247bc33cfc941b4cb83cd735bd8258be52ff4fc41c64c9"
    "f0fa8760fa8d63441b85261e515e666589199c3c2400000000000000000000000000000000")


def test_wireguard_gos_own_handshake_verifies_and_is_relayed():
    initiator, responder = (wgheader.mac1_key(base64.b64decode(k)) for k in (GO_INITIATOR, GO_RESPONDER))
    assert wgheader.mac1_ok(GO_INITIATION, responder) and not wgheader.mac1_ok(GO_INITIATION, initiator)
    assert wgheader.mac1_ok(GO_RESPONSE, initiator) and not wgheader.mac1_ok(GO_RESPONSE, responder)
    table = FlowTable()
    table.set_sessions([parse_session({**doc(), "peer_a_public_key": GO_INITIATOR, "peer_b_public_key": GO_RESPONDER})])
    assert table.route(GO_INITIATION, A_ADDR, 1.0) == [B_ADDR]
    assert table.route(GO_RESPONSE, B_ADDR, 1.0) == [A_ADDR]
    assert table.flows["rel_1"].stable


@pytest.mark.parametrize("packet", [
    b"", b"\x01\x00\x00", initiation(1)[:-1], response(1, 2) + b"\x00", cookie(1)[:60],
    data(1, 16), data(1, 31), b"\x05\x00\x00\x00" + b"\x00" * 60, b"\x04\x01\x00\x00" + b"\x00" * 60,
])
def test_not_wireguard_is_none(packet):
    assert wgheader.parse(packet) is None


@settings(max_examples=500, deadline=None)
@given(packets=st.lists(st.tuples(st.binary(max_size=200), st.sampled_from([A_ADDR, B_ADDR, C_ADDR])),
                        max_size=30))
def test_arbitrary_bytes_never_raise_only_drop_and_count(packets):
    table = FlowTable()
    table.set_sessions([parse_session(doc())])
    for packet, source in packets:
        header = wgheader.parse(packet)
        before = table.drops.malformed
        targets = table.route(packet, source, 0.0)
        assert all(t in (A_ADDR, B_ADDR) for t in targets)
        if header is None:
            assert targets == [] and table.drops.malformed == before + 1


# The flow table


def handshake(table, a_index=100, b_index=200, a=A_ADDR, b=B_ADDR, a_id="n_a", b_id="n_b"):
    assert table.route(initiation(a_index, to=b_id), a, 1.0) == [b]
    assert table.route(response(b_index, a_index, to=a_id), b, 1.0) == [a]


def test_a_handshake_binds_indices_and_data_flows_by_receiver_index():
    table = FlowTable()
    table.set_sessions([parse_session(doc())])
    handshake(table)
    assert table.flows["rel_1"].stable
    assert table.route(data(200), A_ADDR, 2.0) == [B_ADDR]
    assert table.route(data(100, 128), B_ADDR, 3.0) == [A_ADDR]
    assert table.route(cookie(100), B_ADDR, 3.0) == [A_ADDR]
    c = table.flows["rel_1"].counters
    assert (c.packets_a_to_b, c.bytes_a_to_b, c.packets_b_to_a, c.bytes_b_to_a) == (2, 148 + 64, 3, 92 + 128 + 64)
    assert c.last_activity == 3.0


def test_a_nat_port_remap_keeps_the_flow_and_moves_the_side():
    table = FlowTable()
    table.set_sessions([parse_session(doc())])
    handshake(table)
    remapped = (A_ADDR[0], 55555)
    assert table.route(data(200), remapped, 2.0) == [B_ADDR]
    assert table.flows["rel_1"].sides[0].address == remapped
    assert table.route(data(100), B_ADDR, 2.0) == [remapped]  # replies go to the new port
    # The next rekey comes from the new port with a new index, and is still this session's.
    handshake(table, a_index=101, b_index=201, a=remapped)
    assert table.route(data(201), remapped, 3.0) == [B_ADDR]
    assert table.flows["rel_1"].counters.address_changes == 1


def test_a_known_index_from_another_ip_is_refused_and_counted():
    table = FlowTable()
    table.set_sessions([parse_session(doc())])
    handshake(table)
    assert table.route(data(200), C_ADDR, 2.0) == []
    assert table.drops.spoofed == 1
    assert table.flows["rel_1"].sides[0].address == A_ADDR


def test_unknown_packets_are_dropped_and_counted_by_kind():
    table = FlowTable()
    table.set_sessions([parse_session(doc())])
    assert table.route(initiation(1), C_ADDR, 1.0) == []
    assert table.route(data(999), A_ADDR, 1.0) == []
    assert table.route(response(5, 999), B_ADDR, 1.0) == []
    assert table.route(b"hello", A_ADDR, 1.0) == []
    assert (table.drops.unknown_source, table.drops.unknown_index, table.drops.malformed) == (1, 2, 1)


def test_one_node_in_two_sessions_is_not_one_peer_per_bridge():
    """A sends both its sessions' initiations from one port; each one's mac1 says which peer it is for."""
    table = FlowTable()
    table.set_sessions([parse_session(doc("ab")),
                        parse_session(doc("ac", b="n_c", b_ep=f"{C_ADDR[0]}:{C_ADDR[1]}"))])
    assert table.route(initiation(100, to="n_b"), A_ADDR, 1.0) == [B_ADDR]
    assert table.route(initiation(101, to="n_c"), A_ADDR, 1.0) == [C_ADDR]
    assert table.route(response(300, 101), C_ADDR, 1.0) == [A_ADDR]
    assert table.route(response(200, 100), B_ADDR, 1.0) == [A_ADDR]
    assert table.route(data(200), A_ADDR, 2.0) == [B_ADDR]
    assert table.route(data(300), A_ADDR, 2.0) == [C_ADDR]
    assert table.flows["ab"].counters.packets_a_to_b == 2  # its initiation and one data packet, nothing of ac's
    assert table.flows["ac"].counters.packets_b_to_a == 1


def test_old_indices_are_forgotten_and_removed_sessions_route_nothing():
    table = FlowTable()
    table.set_sessions([parse_session(doc())])
    for n in range(INDICES_PER_SIDE + 1):
        handshake(table, a_index=100 + n, b_index=200 + n)
    assert table.route(data(200), A_ADDR, 1.0) == []
    assert table.route(data(200 + INDICES_PER_SIDE), A_ADDR, 1.0) == [B_ADDR]
    table.set_sessions([parse_session(doc(expires=NOW + timedelta(hours=2)))])  # same pair: keeps its flow
    assert table.route(data(200 + INDICES_PER_SIDE), A_ADDR, 1.0) == [B_ADDR]
    table.set_sessions([])
    assert table.route(data(200 + INDICES_PER_SIDE), A_ADDR, 1.0) == []


def test_a_withdrawn_session_assigned_again_resumes_and_another_pair_starts_afresh():
    table = FlowTable()
    table.set_sessions([parse_session(doc())])
    handshake(table)
    table.set_sessions([])
    assert table.route(data(200), A_ADDR, 2.0) == []  # withdrawn: nothing passes
    table.set_sessions([parse_session(doc())])
    assert table.route(data(200), A_ADDR, 3.0) == [B_ADDR]  # the same pair again: what it learned stands
    table.set_sessions([])
    table.set_sessions([parse_session(doc(b="n_other"))])  # the same id for another pair: learns anew
    assert table.route(data(200), A_ADDR, 4.0) == []


# Leases


def test_sessions_expire_at_their_ttl_only_while_the_control_plane_is_reachable():
    clock = FakeClock(NOW)
    reachable = [True]
    relay = Relay(cp_reachable=lambda: reachable[0], clock=clock)
    relay.set_sessions([parse_session(doc("long")), parse_session(doc("short", expires=NOW + timedelta(seconds=60)))])
    clock.advance(61)
    assert relay.sweep() == ["short"]
    reachable[0] = False
    clock.advance(3600)  # an hour-long outage: the session is refreshed, not expired
    assert relay.sweep() == []
    assert list(relay.table.flows) == ["long"]
    reachable[0] = True
    assert relay.sweep() == []  # back: its lease was refreshed during the outage
    clock.advance(301)
    assert relay.sweep() == ["long"]  # not listed again by the reachable control plane


def test_a_session_listed_past_its_expiry_is_never_served_not_even_through_an_outage():
    clock = FakeClock(NOW)
    reachable = [True]
    relay = Relay(cp_reachable=lambda: reachable[0], clock=clock)
    relay.set_sessions([parse_session(doc("ab")), parse_session(doc(
        "old", a="n_c", a_ep="192.0.2.1:1", b="n_d", b_ep="192.0.2.2:2", expires=NOW - timedelta(hours=2)))])
    assert list(relay.table.flows) == ["ab"]
    assert relay.table.route(initiation(100), ("192.0.2.1", 1), 1.0) == []  # nothing forwarded for it
    reachable[0] = False
    relay.sweep()
    assert list(relay.table.flows) == ["ab"]


@contextlib.asynccontextmanager
async def relay_and_two_sides(listen: str):
    """A relay listening on `listen` and two IPv4 loopback sockets it has a session between."""
    relay = Relay(listen, 0, clock=FakeClock(NOW))
    await relay.start()
    a, b = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    try:
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
        relay.set_sessions([parse_session(doc(a_ep=f"127.0.0.1:{a.getsockname()[1]}",
                                              b_ep=f"127.0.0.1:{b.getsockname()[1]}"))])
        yield relay, a, b
    finally:
        a.close()
        b.close()
        await relay.stop()


async def test_the_relay_forwards_between_real_sockets_on_loopback():
    async with relay_and_two_sides("127.0.0.1") as (relay, a, b):
        loop = asyncio.get_running_loop()
        target = ("127.0.0.1", relay.port)
        await loop.sock_sendto(a, initiation(100), target)
        assert await asyncio.wait_for(loop.sock_recvfrom(b, 2048), 5) == (initiation(100), target)
        await loop.sock_sendto(b, response(200, 100), target)
        assert await asyncio.wait_for(loop.sock_recvfrom(a, 2048), 5) == (response(200, 100), target)
        await loop.sock_sendto(a, b"junk", target)
        await loop.sock_sendto(a, data(200), target)
        assert await asyncio.wait_for(loop.sock_recvfrom(b, 2048), 5) == (data(200), target)
        status = relay.status()
        assert status["dropped"]["malformed"] == 1
        assert status["sessions"][0]["packets_a_to_b"] == 2 and status["sessions"][0]["stable"]
    assert not relay.listening


async def test_a_relay_listening_on_all_ipv6_addresses_serves_ipv4_sides_too():
    async with relay_and_two_sides("::") as (relay, a, b):
        loop = asyncio.get_running_loop()
        await loop.sock_sendto(a, initiation(100), ("127.0.0.1", relay.port))
        got, sender = await asyncio.wait_for(loop.sock_recvfrom(b, 2048), 5)
        assert got == initiation(100) and sender == ("127.0.0.1", relay.port)
        assert relay.status()["dropped"]["unknown_source"] == 0


def test_behind_port_randomising_nats_the_initiations_teach_the_real_ports():
    """The control plane lists ports the relay never sees (symmetric NAT): each side's initiation from its IP
    moves that side to the port it really uses, so the other side's initiation reaches it."""
    table = FlowTable()
    table.set_sessions([parse_session(doc())])
    a_real, b_real = (A_ADDR[0], 31001), (B_ADDR[0], 42002)
    assert table.route(initiation(100), a_real, 1.0) == [B_ADDR]  # lost at B's NAT: B's real port is unknown
    assert table.route(initiation(200, to="n_a"), b_real, 1.0) == [a_real]  # reaches A through A's mapping
    assert table.route(response(101, 200, to="n_b"), a_real, 1.0) == [b_real]
    assert table.route(data(101), b_real, 2.0) == [a_real]
    assert table.route(data(200), a_real, 2.0) == [b_real]
    assert table.flows["rel_1"].stable


def test_two_nodes_behind_one_ip_do_not_move_each_other():
    table = FlowTable()
    shared_ip = A_ADDR[0]
    table.set_sessions([parse_session(doc("ab")),
                        parse_session(doc("cb", a="n_c", a_ep=f"{shared_ip}:40002", b="n_d",
                                          b_ep=f"{C_ADDR[0]}:{C_ADDR[1]}"))])
    # From a port neither was proven at: the session whose counterpart's key verifies the mac1, and only it.
    assert table.route(initiation(101, to="n_d"), (shared_ip, 9999), 1.0) == [C_ADDR]
    assert table.route(initiation(100, to="n_b"), (shared_ip, 9999), 1.0) == [B_ADDR]
    assert [f.sides[0].address for f in table.flows.values()] == [A_ADDR, (shared_ip, 40002)]
    assert table.route(response(200, 100), B_ADDR, 1.0) == [(shared_ip, 9999)]
    assert table.flows["ab"].sides[0].address == (shared_ip, 9999)
    assert table.flows["cb"].sides[0].address == (shared_ip, 40002)


# The kernel fast path plan (applied for real in tests/e2e/test_relay_lab.py)


def test_fast_path_elements_are_both_directions_of_stable_ipv4_flows_only():
    from plexd.bridge.fastpath import desired_elements

    table = FlowTable()
    table.set_sessions([parse_session(doc("ab")), parse_session(doc("cd", a="n_c", a_ep="192.0.2.1:1", b="n_d",
                                                                     b_ep="[2001:db8::2]:2")),
                        parse_session(doc("ef", a="n_e", a_ep="192.0.2.5:5", b="n_f", b_ep="192.0.2.6:6"))])
    handshake(table)
    handshake(table, 300, 400, ("192.0.2.1", 1), ("2001:db8::2", 2), "n_c", "n_d")  # stable, one side is IPv6
    assert desired_elements(table.flows.values()) == {A_ADDR: B_ADDR, B_ADDR: A_ADDR}  # ef: no handshake yet


def test_a_node_in_two_sessions_from_one_port_stays_in_userspace_and_the_other_sides_do_not():
    # One key (A's address) with two destinations: the kernel map would send all of A's packets to one of them.
    from plexd.bridge.fastpath import desired_elements

    table = FlowTable()
    table.set_sessions([parse_session(doc("ab")),
                        parse_session(doc("ac", b="n_c", b_ep=f"{C_ADDR[0]}:{C_ADDR[1]}"))])
    assert table.route(initiation(100, to="n_b"), A_ADDR, 1.0) == [B_ADDR]
    assert table.route(response(200, 100), B_ADDR, 1.0) == [A_ADDR]
    assert table.route(initiation(300, to="n_c"), A_ADDR, 1.0) == [C_ADDR]
    assert table.route(response(400, 300), C_ADDR, 1.0) == [A_ADDR]
    assert all(f.stable for f in table.flows.values())
    assert desired_elements(table.flows.values()) == {B_ADDR: A_ADDR, C_ADDR: A_ADDR}


def test_fast_path_element_changes_are_the_difference_only():
    from plexd.bridge.fastpath import element_commands

    moved = (A_ADDR[0], 55555)
    current = {A_ADDR: B_ADDR, B_ADDR: A_ADDR}
    desired = {moved: B_ADDR, B_ADDR: moved}
    commands = element_commands(desired, current)
    assert element_commands(current, current) == []
    verbs = [(next(iter(c)), c[next(iter(c))]["element"]["name"]) for c in commands]
    assert verbs == [("delete", "fwd_addr"), ("delete", "fwd_port"), ("add", "fwd_addr"), ("add", "fwd_port")]
    deleted = commands[0]["delete"]["element"]["elem"]
    added_ports = commands[3]["add"]["element"]["elem"]
    assert deleted == [[{"concat": list(A_ADDR)}, B_ADDR[0]], [{"concat": list(B_ADDR)}, A_ADDR[0]]]
    assert added_ports == [[{"concat": list(moved)}, B_ADDR[1]], [{"concat": list(B_ADDR)}, 55555]]


def test_fast_path_rule_matches_only_transport_data_to_the_relay():
    from plexd.bridge.fastpath import TRANSPORT_WORD, table_commands

    pre = next(c["add"]["rule"] for c in table_commands("192.0.2.100", 51821)
               if "rule" in c.get("add", {}) and c["add"]["rule"]["chain"] == "prerouting")
    rights = [e["match"]["right"] for e in pre["expr"] if "match" in e]
    assert rights == ["192.0.2.100", 51821, TRANSPORT_WORD]
    # the map lookups are the membership test, before any change to the packet (kernel 6.1 refuses a map matched
    # as a set: the kernel tier found it)
    kinds = [next(iter(e)) for e in pre["expr"]]
    assert kinds[3:] == ["mangle", "mangle", "notrack", "mangle", "counter"]
    assert [pre["expr"][i]["mangle"]["value"]["map"]["data"] for i in (3, 4)] == ["@fwd_addr", "@fwd_port"]
    assert TRANSPORT_WORD.to_bytes(4, "big") == data(1)[:4][:1] + b"\0\0\0"
    with pytest.raises(ValueError, match="IPv4"):
        from plexd.bridge.fastpath import KernelFastPath
        KernelFastPath("2001:db8::1", 51821, nft=object())
