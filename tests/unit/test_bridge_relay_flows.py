"""The relay's flow table against someone who shares a side's IP (a host behind the same CGNAT, or spoofing it).

Handshakes are WireGuard-shaped and carry the mac1 WireGuard puts on them, computed here from the spec with hashlib
and keys made with nacl: an initiation's keyed by its responder's public key, a response's by its initiator's. A
stranger does not know the pair's keys: its handshakes verify for no one, are dropped and counted, and move or evict
nothing. Someone who does know them (a mesh member) still cannot move a side without proof (the counterpart
answering, or an index of the established flow). Crafted datagrams, no sockets."""

from __future__ import annotations

import base64
import hashlib
import struct
from datetime import UTC, datetime, timedelta

from nacl.public import PrivateKey

from plexd.bridge import wgheader
from plexd.bridge.flows import INDICES_PER_SIDE, PENDING_PER_SIDE, SESSION_LIFETIME, FlowTable
from plexd.bridge.relay import Relay
from plexd.state.relay_block import parse_session

A_ADDR, B_ADDR = ("198.51.100.7", 40001), ("203.0.113.9", 51820)
C_ADDR, D_ADDR = ("192.0.2.44", 7000), ("192.0.2.55", 8000)
EVIL = (A_ADDR[0], 55555)  # behind A's IP, another port
EVIL_B = (B_ADDR[0], 6666)  # behind B's IP, another port
LATER = datetime.now(UTC) + timedelta(hours=1)
PRIVATE: dict[str, PrivateKey] = {}


def public_key(node: str) -> str:
    """Node `node`'s WireGuard public key (base64); `rotate` gives it another."""
    private = PRIVATE.setdefault(node, PrivateKey.generate())
    return base64.b64encode(bytes(private.public_key)).decode()


def rotate(node: str) -> str:
    PRIVATE[node] = PrivateKey.generate()
    return public_key(node)


def session(sid="ab", a="n_a", a_ep=A_ADDR, b="n_b", b_ep=B_ADDR, keys=True):
    doc = {"session_id": sid, "peer_a_id": a, "peer_a_endpoint": f"{a_ep[0]}:{a_ep[1]}",
           "peer_b_id": b, "peer_b_endpoint": f"{b_ep[0]}:{b_ep[1]}",
           "expires_at": LATER.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if keys:
        doc |= {"peer_a_public_key": public_key(a), "peer_b_public_key": public_key(b)}
    return parse_session(doc)


def with_mac1(message: bytes, to: str) -> bytes:
    """WireGuard's mac1 for node `to`: BLAKE2s-128 keyed with BLAKE2s-256("mac1----" || to's public key), over the
    message up to it (mac1 and mac2 are the last 32 bytes of both handshake messages)."""
    key = hashlib.blake2s(b"mac1----" + base64.b64decode(public_key(to))).digest()
    at = len(message) - 32
    return message[:at] + hashlib.blake2s(message[:at], key=key, digest_size=16).digest() + message[at + 16:]


def initiation(sender: int, to: str = "n_b") -> bytes:
    """148 bytes: type, sender, ephemeral, encrypted static and timestamp (random here), mac1, mac2 (zero)."""
    body = bytes([1, 0, 0, 0]) + struct.pack("<I", sender) + bytes(PrivateKey.generate().public_key) + b"\x11" * 76
    return with_mac1(body + bytes(32), to)


def response(sender: int, receiver: int, to: str = "n_a") -> bytes:
    """92 bytes: type, sender, receiver, ephemeral, encrypted nothing, mac1, mac2 (zero)."""
    body = bytes([2, 0, 0, 0]) + struct.pack("<II", sender, receiver) + bytes(PrivateKey.generate().public_key)
    return with_mac1(body + b"\x22" * 16 + bytes(32), to)


def junk_initiation(sender: int) -> bytes:
    """WireGuard-shaped, of the right length, but with a mac1 nobody's key gives."""
    return bytes([1, 0, 0, 0]) + struct.pack("<I", sender) + b"\x11" * 140


def junk_response(sender: int, receiver: int) -> bytes:
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


def test_mac1_is_checked_with_the_receivers_public_key_and_any_changed_byte_fails_it():
    message = initiation(7, to="n_b")
    key = wgheader.mac1_key(base64.b64decode(public_key("n_b")))
    assert wgheader.mac1_ok(message, key)
    assert not wgheader.mac1_ok(message, wgheader.mac1_key(base64.b64decode(public_key("n_a"))))
    assert not wgheader.mac1_ok(message[:50] + bytes([message[50] ^ 1]) + message[51:], key)
    assert not wgheader.mac1_ok(junk_initiation(7), key)
    answer = response(8, 7, to="n_a")
    assert wgheader.mac1_ok(answer, wgheader.mac1_key(base64.b64decode(public_key("n_a"))))
    assert not wgheader.mac1_ok(answer, key)


# (1) A junk response, or a junk initiation from an unproven port, proves nothing.


def test_a_junk_initiation_from_a_sides_ip_is_dropped_and_does_not_become_where_its_counterpart_is_sent():
    """Before: B not live, its latest initiation's port (the attacker's) got A's initiations."""
    table = FlowTable()
    table.set_sessions([session()])
    assert table.route(junk_initiation(666), EVIL_B, 1.0) == []
    assert table.drops.bad_mac1 == 1
    assert not table.flows["ab"].sides[1].pending
    assert table.route(initiation(100), A_ADDR, 1.0) == [B_ADDR]  # B's listed address, not the attacker's


def test_a_junk_response_from_where_the_initiation_was_sent_proves_nothing_and_the_real_one_still_does():
    """First contact behind symmetric NATs: A's initiation goes where B's came from. Someone who can send from
    there (spoofing it, or sharing B's IP and NAT mapping) answers first with junk: before, that "proved" both
    sides and used up A's pending initiation, so the real response was dropped."""
    table = FlowTable()
    table.set_sessions([session()])
    b_real = (B_ADDR[0], 42002)
    assert table.route(initiation(200, to="n_a"), b_real, 1.0) == [A_ADDR]  # lost at A's NAT
    assert table.route(initiation(100, to="n_b"), A_ADDR, 1.0) == [b_real]
    assert table.route(junk_response(666, 100), b_real, 1.1) == []
    assert table.route(response(667, 100, to="n_b"), b_real, 1.1) == []  # a mac1 for the wrong side: junk too
    assert table.drops.bad_mac1 == 2
    assert not table.flows["ab"].stable and table.flows["ab"].sides[1].address == B_ADDR
    assert table.route(response(201, 100), b_real, 1.2) == [A_ADDR]  # B's real answer
    assert [s.address for s in table.flows["ab"].sides] == [A_ADDR, b_real]
    assert table.route(data(100), b_real, 2.0) == [A_ADDR]
    assert table.route(data(666), b_real, 2.0) == []


def test_a_junk_initiation_from_the_sides_ip_moves_nothing_and_the_pairs_traffic_goes_on():
    table = established()
    for n in range(50):  # one datagram, or many
        assert table.route(junk_initiation(9000 + n), (EVIL[0], EVIL[1] + n), 2.0) == []
    assert table.drops.bad_mac1 == 50
    flow = table.flows["ab"]
    assert flow.sides[0].address == A_ADDR and not flow.sides[0].pending
    assert table.route(data(100), B_ADDR, 3.0) == [A_ADDR]  # B -> A still reaches A
    assert table.route(data(200), A_ADDR, 3.0) == [B_ADDR]
    assert table.route(initiation(300, to="n_a"), B_ADDR, 3.0) == [A_ADDR]  # B's rekey: nothing learned from junk
    assert flow.counters.address_changes == 0


# (2) Nobody behind a side's IP can evict the side's own pending initiations.


def test_junk_initiations_from_a_sides_ip_cannot_evict_its_pending_initiation():
    """Before: the junk took the side's pending slots (8, oldest out), so the real response was dropped."""
    table = established()
    assert table.route(initiation(300, to="n_a"), B_ADDR, 2.0) == [A_ADDR]  # B rekeys
    for n in range(3 * PENDING_PER_SIDE):
        table.route(junk_initiation(10_000 + n), (EVIL_B[0], EVIL_B[1] + n), 2.1)
    assert table.route(response(101, 300, to="n_b"), A_ADDR, 2.5) == [B_ADDR]  # A's answer still completes it
    assert table.route(data(101), B_ADDR, 3.0) == [A_ADDR]


def test_initiations_from_another_port_cannot_evict_a_sides_fresh_ones_even_with_a_good_mac1():
    """Someone who knows A's public key (a mesh member) makes initiations that verify. From a port B is not at,
    they never push out B's own fresh ones; the bound holds."""
    table = established()
    assert table.route(initiation(300, to="n_a"), B_ADDR, 2.0) == [A_ADDR]
    for n in range(3 * PENDING_PER_SIDE):
        table.route(initiation(10_000 + n, to="n_a"), (EVIL_B[0], EVIL_B[1] + n), 2.1)
    side = table.flows["ab"].sides[1]
    assert len(side.pending) == PENDING_PER_SIDE and 300 in side.pending
    assert table.route(response(101, 300, to="n_b"), A_ADDR, 2.5) == [B_ADDR]
    assert table.flows["ab"].sides[1].address == B_ADDR


def test_a_flood_of_initiations_from_one_ip_evicts_no_other_sides_pending_initiation():
    table = FlowTable()
    table.set_sessions([session(), session("cd", "n_c", C_ADDR, "n_d", D_ADDR)])
    assert table.route(initiation(500, to="n_d"), C_ADDR, 1.0) == [D_ADDR]
    for n in range(2000):
        table.route(junk_initiation(10_000 + n), (A_ADDR[0], 1024 + n), 1.5)
    assert table.route(response(600, 500, to="n_c"), D_ADDR, 2.0) == [C_ADDR]  # C's handshake completes
    assert table.flows["cd"].stable
    assert table.route(data(600), C_ADDR, 3.0) == [D_ADDR]
    assert all(len(side.pending) <= PENDING_PER_SIDE for f in table.flows.values() for side in f.sides)


def test_a_side_whose_own_old_initiations_went_unanswered_still_gets_through_from_a_new_port():
    """Its pending initiations from its address are protected only while fresh: after its NAT remaps, the new
    port's are kept, or a side whose peer was away a while could never handshake again."""
    table = established()
    for n in range(PENDING_PER_SIDE):
        table.route(initiation(300 + n, to="n_a"), B_ADDR, 2.0 + n)  # A is away: unanswered
    b2 = (B_ADDR[0], 42002)
    assert table.route(initiation(400, to="n_a"), b2, 200.0) == [A_ADDR]
    assert table.route(response(101, 400, to="n_b"), A_ADDR, 200.1) == [b2]
    assert table.flows["ab"].sides[1].address == b2


# (3) An initiation goes to the one counterpart it is for: no fan-out, no guessing.


def test_an_initiation_goes_to_the_one_peer_its_mac1_is_for_even_from_the_nodes_own_address():
    """Before: from A's known address to all of A's sessions (one spoofed datagram, 50 copies); from any other
    port of A's IP to one picked by the sender index."""
    table = FlowTable()
    peers = {f"n_{k}": (f"192.0.2.{k}", 51820) for k in range(1, 51)}
    table.set_sessions([session(f"a{k}", b=node, b_ep=peer) for k, (node, peer) in enumerate(peers.items())])
    assert table.route(junk_initiation(7), A_ADDR, 1.0) == []  # spoofed from A's exact address
    assert table.route(junk_initiation(8), EVIL, 1.0) == []
    assert table.drops.bad_mac1 == 2
    assert table.route(initiation(9, to="n_17"), A_ADDR, 1.0) == [peers["n_17"]]
    assert table.route(initiation(10, to="n_42"), EVIL, 1.0) == [peers["n_42"]]
    assert sum(f.counters.packets_a_to_b for f in table.flows.values()) == 2


def test_after_a_nat_remap_each_idle_session_is_found_again_at_the_first_initiation():
    """A's NAT remapped while its sessions were idle: every peer's next initiation from the new port reaches it
    at once (before, one counterpart per retry, picked by the sender index: minutes with many sessions)."""
    table = FlowTable()
    peers = {f"n_{k}": (f"192.0.2.{k}", 51820) for k in range(1, 21)}
    table.set_sessions([session(f"a{k}", b=node, b_ep=peer) for k, (node, peer) in enumerate(peers.items())])
    for k, (node, peer) in enumerate(peers.items()):
        assert peer in table.route(initiation(100 + k, to=node), A_ADDR, 1.0)
        assert table.route(response(500 + k, 100 + k), peer, 1.0) == [A_ADDR]
    moved = (A_ADDR[0], 31001)
    for k, (node, peer) in enumerate(peers.items()):
        sender = 1001 + 3 * k  # before: the counterpart at sender % 20, n_2 for the first
        assert table.route(initiation(sender, to=node), moved, 60.0) == [peer], node
        assert table.route(response(2000 + k, sender), peer, 60.0) == [moved]
    assert all(f.sides[0].address == moved for f in table.flows.values())


def test_two_nodes_behind_one_ip_with_the_same_peer_are_told_apart_by_the_responses_mac1():
    """A and C share an IP and both have a session with B: an initiation for B from there verifies in both, so
    it reaches B once and waits in both; B's response carries the mac1 of its initiator's key, which says whose."""
    shared = A_ADDR[0]
    c_addr = (shared, 40002)
    table = FlowTable()
    table.set_sessions([session(), session("cb", a="n_c", a_ep=c_addr)])
    c_real = (shared, 9999)
    assert table.route(initiation(300, to="n_b"), c_real, 1.0) == [B_ADDR]
    assert table.route(response(400, 300, to="n_c"), B_ADDR, 1.0) == [c_real]
    assert table.flows["cb"].sides[0].address == c_real and table.flows["cb"].stable
    assert table.flows["ab"].sides[0].address == A_ADDR and not table.flows["ab"].stable


# What worked still works.


def test_a_rekey_from_the_same_addresses_adds_indices_and_the_old_ones_route_until_replaced():
    table = established()
    assert table.route(initiation(300, to="n_a"), B_ADDR, 120.0) == [A_ADDR]  # B initiates this time
    assert table.route(response(101, 300, to="n_b"), A_ADDR, 120.0) == [B_ADDR]
    assert table.route(data(101), B_ADDR, 121.0) == [A_ADDR]
    assert table.route(data(300), A_ADDR, 121.0) == [B_ADDR]
    assert table.route(data(100), B_ADDR, 121.0) == [A_ADDR]  # the old keypair, still in flight
    for n in range(INDICES_PER_SIDE):
        assert table.route(initiation(700 + n), A_ADDR, 200.0 + n) == [B_ADDR]
        assert table.route(response(800 + n, 700 + n), B_ADDR, 200.0 + n) == [A_ADDR]
    assert table.route(data(100), B_ADDR, 210.0) == []
    assert table.flows["ab"].counters.address_changes == 0


def test_a_port_remap_is_followed_once_the_counterpart_answers_the_new_ports_initiation():
    table = established()
    moved = (A_ADDR[0], 31001)
    assert table.route(initiation(101), moved, 2.0) == [B_ADDR]
    assert table.flows["ab"].sides[0].address == A_ADDR  # an initiation alone proves nothing
    assert table.route(data(100), B_ADDR, 2.0) == [A_ADDR]
    assert table.route(response(201, 101), B_ADDR, 2.5) == [moved]  # B answered it: A is there now
    assert table.flows["ab"].sides[0].address == moved
    assert table.route(data(101), B_ADDR, 3.0) == [moved]
    assert table.route(data(201), moved, 3.0) == [B_ADDR]
    assert table.flows["ab"].counters.address_changes == 1


def test_sides_silent_past_wireguards_key_lifetime_learn_new_ports_from_their_initiations():
    """Both NATs remapped while the pair was idle: no session through the relay is left to divert, and each side's
    initiation is the only way to find the other."""
    table = established()
    later = 1.0 + SESSION_LIFETIME + 1
    a2, b2 = (A_ADDR[0], 31001), (B_ADDR[0], 42002)
    assert table.route(initiation(110), a2, later) == [B_ADDR]  # lost at B's NAT
    assert table.route(initiation(210, to="n_a"), b2, later) == [a2]  # reaches A where its own initiation came from
    assert table.route(response(111, 210, to="n_b"), a2, later) == [b2]
    assert [s.address for s in table.flows["ab"].sides] == [a2, b2]
    assert table.route(data(111), b2, later + 1) == [a2]


def test_an_initiation_from_a_nodes_proven_port_reaches_its_sessions_that_have_not_followed_it():
    """A's NAT remapped; its session with B followed (data), its idle one with C did not: A's initiation for C
    from the new port must still reach C, or neither end could ever find the other again."""
    table = FlowTable()
    table.set_sessions([session(), session("ac", b="n_c", b_ep=C_ADDR)])
    for node, peer, a_index, peer_index in (("n_b", B_ADDR, 100, 200), ("n_c", C_ADDR, 300, 400)):
        assert peer in table.route(initiation(a_index, to=node), A_ADDR, 1.0)
        assert table.route(response(peer_index, a_index), peer, 1.0) == [A_ADDR]
    moved = (A_ADDR[0], 31001)
    assert table.route(data(200), moved, 2.0) == [B_ADDR]  # an index of ab from A's new port
    assert table.route(initiation(301, to="n_c"), moved, 3.0) == [C_ADDR]
    assert table.route(response(401, 301), C_ADDR, 3.0) == [moved]
    assert [f.sides[0].address for f in table.flows.values()] == [moved, moved]


# Someone who knows the keys (a mesh member behind the same IP) still needs proof.


def test_a_response_only_counts_from_where_the_initiation_was_sent():
    table = established()
    assert table.route(initiation(666), EVIL, 2.0) == [B_ADDR]  # a good mac1: whoever sent it knows B's key
    # "Answered" from B's IP but not B's address: not the counterpart that got the initiation.
    assert table.route(response(777, 666), (B_ADDR[0], 1234), 2.0) == []
    assert table.flows["ab"].sides[0].address == A_ADDR
    assert table.route(data(100), B_ADDR, 3.0) == [A_ADDR]


def test_a_proven_side_gets_its_counterparts_initiations_at_its_proven_address_only():
    table = established()
    table.route(initiation(666), EVIL, 2.0)
    assert table.route(initiation(300, to="n_a"), B_ADDR, 2.5) == [A_ADDR]


def test_an_index_a_key_holder_was_shown_before_the_side_was_proven_cannot_move_it_later():
    """First contact sends B's initiation where A's latest one came from, unproven. A key holder there sees B's
    index (and can answer with a good mac1); once the real A's handshake moves A, that index proves nothing."""
    table = FlowTable()
    table.set_sessions([session()])
    table.route(initiation(666), EVIL, 1.0)  # a key holder behind A's IP, first
    assert table.route(initiation(200, to="n_a"), B_ADDR, 1.0) == [EVIL]
    assert table.route(response(667, 200, to="n_b"), EVIL, 1.0) == [B_ADDR]  # (B drops it: not A's static key)
    assert table.route(initiation(202, to="n_a"), B_ADDR, 1.5) == [EVIL]  # B's retry
    assert table.route(initiation(100), A_ADDR, 2.0) == [B_ADDR]  # the real A
    assert table.route(response(201, 100), B_ADDR, 2.0) == [A_ADDR]
    assert table.route(data(200), EVIL, 3.0) == []  # B's index it saw
    assert table.route(response(669, 202, to="n_b"), EVIL, 3.0) == []  # an initiation it was sent, answered late
    assert table.flows["ab"].sides[0].address == A_ADDR
    assert table.route(data(100), B_ADDR, 3.0) == [A_ADDR]
    assert table.route(initiation(203, to="n_a"), B_ADDR, 3.0) == [A_ADDR]


# Where the keys come from.


def test_keys_come_from_the_peers_first_then_the_session_and_a_side_with_none_gets_no_handshake():
    table = FlowTable()
    table.set_sessions([session(keys=False), session("cd", "n_c", C_ADDR, "n_d", D_ADDR, keys=False)])
    table.set_peer_keys({"n_a": public_key("n_a"), "n_b": public_key("n_b"), "n_c": public_key("n_c")})
    assert table.route(initiation(100), A_ADDR, 1.0) == [B_ADDR]
    assert table.route(response(200, 100), B_ADDR, 1.0) == [A_ADDR]
    assert table.flows["ab"].keyless == [] and table.flows["cd"].keyless == ["n_d"]
    assert table.route(initiation(300, to="n_d"), C_ADDR, 1.0) == []  # n_d's key is unknown: nothing verifies
    assert table.route(initiation(400, to="n_c"), D_ADDR, 1.0) == []  # and nothing from n_d is taken either
    assert table.drops.bad_mac1 == 2

    # A rotated key: handshakes with the old one stop verifying; the established indices still route.
    old = public_key("n_b")
    table.set_peer_keys({"n_a": public_key("n_a"), "n_b": rotate("n_b"), "n_c": public_key("n_c")})
    assert table.route(initiation(101), A_ADDR, 2.0) == [B_ADDR]  # made with n_b's new key
    assert table.route(data(100), B_ADDR, 2.0) == [A_ADDR]
    stale = table.flows["ab"].sides[1].mac1_key
    assert stale == wgheader.mac1_key(base64.b64decode(public_key("n_b"))) != wgheader.mac1_key(
        base64.b64decode(old))

    # The session's own key fills in for a node that is not a peer; a peer's key wins over it.
    table.set_sessions([session(keys=False), session("cd", "n_c", C_ADDR, "n_d", D_ADDR)])
    assert table.flows["cd"].keyless == []
    assert table.route(initiation(301, to="n_d"), C_ADDR, 3.0) == [D_ADDR]
    table.set_peer_keys({"n_c": public_key("n_c"), "n_d": public_key("n_b")})
    assert table.route(initiation(302, to="n_d"), C_ADDR, 3.0) == []


def test_the_relays_status_says_why_a_session_relays_no_handshake():
    relay = Relay()
    relay.set_sessions([session(keys=False)])
    relay.set_peer_keys({"n_a": public_key("n_a")})
    [status] = relay.status()["sessions"]
    assert "no WireGuard public key for n_b" in status["handshakes_refused"]
    relay.set_peer_keys({"n_a": public_key("n_a"), "n_b": public_key("n_b")})
    assert relay.status()["sessions"][0]["handshakes_refused"] is None
