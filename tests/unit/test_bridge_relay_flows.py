"""The relay's flow table against someone who shares a side's IP (a host behind the same CGNAT, or spoofing it):
a side's address moves only on proof (the counterpart answering an initiation from the new port, or a packet
carrying an index of the established flow), pending initiations are bounded per side, and an initiation from a
port nobody proved reaches one counterpart at most. Crafted datagrams, no sockets."""

from __future__ import annotations

import struct
from datetime import UTC, datetime, timedelta

from plexd.bridge.flows import PENDING_PER_SIDE, SESSION_LIFETIME, FlowTable
from plexd.bridge.sessions import parse_session

A_ADDR, B_ADDR = ("198.51.100.7", 40001), ("203.0.113.9", 51820)
C_ADDR, D_ADDR = ("192.0.2.44", 7000), ("192.0.2.55", 8000)
EVIL = (A_ADDR[0], 55555)  # behind A's IP, another port
LATER = datetime.now(UTC) + timedelta(hours=1)


def session(sid="ab", a="n_a", a_ep=A_ADDR, b="n_b", b_ep=B_ADDR):
    return parse_session({"session_id": sid, "peer_a_id": a, "peer_a_endpoint": f"{a_ep[0]}:{a_ep[1]}",
                          "peer_b_id": b, "peer_b_endpoint": f"{b_ep[0]}:{b_ep[1]}",
                          "expires_at": LATER.strftime("%Y-%m-%dT%H:%M:%SZ")})


def initiation(sender: int) -> bytes:
    return bytes([1, 0, 0, 0]) + struct.pack("<I", sender) + b"\x11" * 140


def response(sender: int, receiver: int) -> bytes:
    return bytes([2, 0, 0, 0]) + struct.pack("<II", sender, receiver) + b"\x22" * 80


def data(receiver: int) -> bytes:
    return bytes([4, 0, 0, 0]) + struct.pack("<I", receiver) + b"\x44" * 56


def established(now: float = 1.0) -> FlowTable:
    """A pair that completed a handshake: A's index 100, B's 200."""
    table = FlowTable()
    table.set_sessions([session()])
    assert table.route(initiation(100), A_ADDR, now) == [B_ADDR]
    assert table.route(response(200, 100), B_ADDR, now) == [A_ADDR]
    return table


def test_a_junk_initiation_from_the_sides_ip_moves_nothing_and_the_pairs_traffic_goes_on():
    table = established()
    for n in range(50):  # one datagram, or many
        assert table.route(initiation(9000 + n), (EVIL[0], EVIL[1] + n), 2.0) in ([], [B_ADDR])
    flow = table.flows["ab"]
    assert flow.sides[0].address == A_ADDR
    assert table.route(data(100), B_ADDR, 3.0) == [A_ADDR]  # B -> A still reaches A
    assert table.route(data(200), A_ADDR, 3.0) == [B_ADDR]
    assert table.route(initiation(300), B_ADDR, 3.0) == [A_ADDR]  # B's rekey too: nothing learned from the junk
    assert flow.counters.address_changes == 0


def test_a_response_only_counts_from_where_the_initiation_was_sent():
    table = established()
    table.route(initiation(666), EVIL, 2.0)
    # "Answered" from B's IP but not B's address: not the counterpart that got the initiation.
    assert table.route(response(777, 666), (B_ADDR[0], 1234), 2.0) == []
    assert table.flows["ab"].sides[0].address == A_ADDR
    assert table.route(data(100), B_ADDR, 3.0) == [A_ADDR]


def test_a_flood_of_initiations_from_one_ip_evicts_no_other_sides_pending_initiation():
    table = FlowTable()
    table.set_sessions([session(), session("cd", "n_c", C_ADDR, "n_d", D_ADDR)])
    assert table.route(initiation(500), C_ADDR, 1.0) == [D_ADDR]
    for n in range(5000):
        table.route(initiation(10_000 + n), (A_ADDR[0], 1024 + n), 1.5)
    assert table.route(response(600, 500), D_ADDR, 2.0) == [C_ADDR]  # C's handshake completes
    assert table.flows["cd"].stable
    assert table.route(data(600), C_ADDR, 3.0) == [D_ADDR]
    assert all(len(side.pending) <= PENDING_PER_SIDE for f in table.flows.values() for side in f.sides)


def test_an_initiation_from_a_port_nobody_proved_reaches_one_counterpart_at_most():
    table = FlowTable()
    peers = [(f"192.0.2.{k}", 51820) for k in range(1, 51)]
    table.set_sessions([session(f"a{k}", b=f"n_{k}", b_ep=peer) for k, peer in enumerate(peers)])
    assert len(table.route(initiation(7), EVIL, 1.0)) <= 1
    # From the address A is known at: every session of A's (one node relayed to several peers from one port).
    assert sorted(table.route(initiation(8), A_ADDR, 1.0)) == sorted(peers)


def test_a_port_remap_is_followed_once_the_counterpart_answers_the_new_ports_initiation():
    table = established()
    assert table.route(initiation(101), EVIL, 2.0) == [B_ADDR]
    assert table.flows["ab"].sides[0].address == A_ADDR  # an initiation alone proves nothing
    assert table.route(data(100), B_ADDR, 2.0) == [A_ADDR]
    assert table.route(response(201, 101), B_ADDR, 2.5) == [EVIL]  # B answered it: A is there now
    assert table.flows["ab"].sides[0].address == EVIL
    assert table.route(data(101), B_ADDR, 3.0) == [EVIL]
    assert table.route(data(201), EVIL, 3.0) == [B_ADDR]
    assert table.flows["ab"].counters.address_changes == 1


def test_a_proven_side_gets_its_counterparts_initiations_at_its_proven_address_only():
    table = established()
    table.route(initiation(666), EVIL, 2.0)
    assert table.route(initiation(300), B_ADDR, 2.5) == [A_ADDR]


def test_sides_silent_past_wireguards_key_lifetime_learn_new_ports_from_their_initiations():
    """Both NATs remapped while the pair was idle: no session through the relay is left to divert, and each side's
    initiation is the only way to find the other."""
    table = established()
    later = 1.0 + SESSION_LIFETIME + 1
    a2, b2 = (A_ADDR[0], 31001), (B_ADDR[0], 42002)
    assert table.route(initiation(110), a2, later) == [B_ADDR]  # lost at B's NAT
    assert table.route(initiation(210), b2, later) == [a2]  # reaches A where its own initiation came from
    assert table.route(response(111, 210), a2, later) == [b2]
    assert [s.address for s in table.flows["ab"].sides] == [a2, b2]
    assert table.route(data(111), b2, later + 1) == [a2]


def test_an_index_someone_was_shown_before_the_side_was_proven_cannot_move_it_later():
    """First contact must send B's initiation where A's latest initiation came from, unproven: whoever is there
    sees B's index. Once the real A's handshake moves A, that index proves nothing."""
    table = FlowTable()
    table.set_sessions([session()])
    table.route(initiation(666), EVIL, 1.0)  # someone behind A's IP, first
    assert table.route(initiation(200), B_ADDR, 1.0) == [EVIL]
    assert table.route(response(667, 200), EVIL, 1.0) == [B_ADDR]  # "answered" (B drops it: not A's keys)
    assert table.route(initiation(202), B_ADDR, 1.5) == [EVIL]  # B's retry
    assert table.route(initiation(100), A_ADDR, 2.0) == [B_ADDR]  # the real A
    assert table.route(response(201, 100), B_ADDR, 2.0) == [A_ADDR]
    assert table.route(data(200), EVIL, 3.0) == []  # B's index it saw
    assert table.route(response(669, 202), EVIL, 3.0) == []  # an initiation it was sent, answered late
    assert table.flows["ab"].sides[0].address == A_ADDR
    assert table.route(data(100), B_ADDR, 3.0) == [A_ADDR]
    assert table.route(initiation(203), B_ADDR, 3.0) == [A_ADDR]


def test_an_initiation_from_a_nodes_proven_port_reaches_its_sessions_that_have_not_followed_it():
    """A's NAT remapped; its session with B followed (data), its idle one with C did not: A's initiation for C
    from the new port must still reach C, or neither end could ever find the other again."""
    table = FlowTable()
    table.set_sessions([session(), session("ac", b="n_c", b_ep=C_ADDR)])
    for peer, a_index, peer_index in ((B_ADDR, 100, 200), (C_ADDR, 300, 400)):
        assert peer in table.route(initiation(a_index), A_ADDR, 1.0)
        assert table.route(response(peer_index, a_index), peer, 1.0) == [A_ADDR]
    moved = (A_ADDR[0], 31001)
    assert table.route(data(200), moved, 2.0) == [B_ADDR]  # an index of ab from A's new port
    assert sorted(table.route(initiation(301), moved, 3.0)) == sorted([B_ADDR, C_ADDR])
    assert table.route(response(401, 301), C_ADDR, 3.0) == [moved]
    assert [f.sides[0].address for f in table.flows.values()] == [moved, moved]
