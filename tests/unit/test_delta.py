"""The event path's diff (`plexd.mesh.delta`): applied on top of a converged machine it leaves nothing for the full
diff to find, touches only what the events changed, and keeps routes collapsed. Pure; no I/O."""

from __future__ import annotations

import base64
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.public import PrivateKey

from plexd.machine.links import LinkState
from plexd.machine.wireguard import DeviceConfig
from plexd.mesh.delta import peer_delta, touched_peers
from plexd.mesh.mesh_plan import (
    Observed,
    PeerAdded,
    PeerEndpointChanged,
    PeerKeyChanged,
    PeerRemoved,
    RouteExtra,
    RouteMissing,
    diff,
    simulate,
)
from plexd.state.desired import DesiredState
from plexd.state.model import Peer

NOW = 1_800_000_000.0
KEYS = [base64.b64encode(bytes(PrivateKey(bytes([i + 1]) * 32).public_key)).decode() for i in range(12)]
PRIVATE = base64.b64encode(bytes([0x41]) * 32).decode()
CIDRS = ["10.100.1.0/24", "10.100.1.7/32", "192.168.5.0/24", "10.100.0.0/30", "fd00::2/128"]
ENDPOINTS = ["", "10.0.0.1:51820", "10.0.0.2:51821"]


def model(peers=()) -> DesiredState:
    d = DesiredState.initial(interface="wg0", listen_port=51820, mtu=1420, private_key=PRIVATE,
                             mesh_ip="10.100.9.9")
    return d.with_peers(peers)


def converged(d: DesiredState) -> Observed:
    """The machine after a full converge to `d` (from nothing), as the converger's baseline holds it."""
    empty = Observed(device=DeviceConfig(), link=LinkState(index=3, kind="tun", mtu=0, up=False))
    return simulate(empty, diff(d, empty, NOW))


def peer(i: int, key: int | None = None, endpoint: str = "", allowed: tuple[str, ...] = ()) -> Peer:
    return Peer(id=f"n_{i}", public_key=KEYS[i if key is None else key], mesh_ip=f"10.100.0.{i + 4}",
                endpoint=endpoint, allowed_ips=allowed)


peer_st = st.builds(lambda i, k, ep, ips: peer(i, k, ep, tuple(ips)), st.integers(0, 9), st.integers(0, 11),
                    st.sampled_from(ENDPOINTS), st.lists(st.sampled_from(CIDRS), max_size=2))
edit_st = st.one_of(
    st.builds(lambda p: ("add", p), peer_st),
    st.builds(lambda i: ("remove", f"n_{i}"), st.integers(0, 9)),
    st.builds(lambda i, ep: ("endpoint", f"n_{i}", ep), st.integers(0, 9), st.sampled_from(ENDPOINTS[1:])),
)


def apply_edit(d: DesiredState, edit) -> DesiredState:
    if edit[0] == "add":
        return d.with_peer(edit[1])
    if edit[0] == "remove":
        return d.without_peer(edit[1])
    return d.with_peer_endpoint(edit[1], edit[2])


@settings(max_examples=400, deadline=None)
@given(st.lists(peer_st, max_size=8), st.lists(edit_st, min_size=1, max_size=6))
def test_a_delta_on_a_converged_machine_leaves_nothing_for_the_full_diff(start, edits):
    old = model(start)
    believed = converged(old)
    new = old
    for e in edits:
        new = apply_edit(new, e)
    changes = peer_delta(old, new, believed, NOW)
    assert changes is not None
    after = simulate(believed, changes)
    assert diff(new, after, NOW) == []
    # Only the peers the edits named appear in the delta.
    named = {e[1].id if e[0] == "add" else e[1] for e in edits}
    assert {c.peer_id for c in changes if hasattr(c, "peer_id")} <= named


def test_nothing_changed_is_no_change():
    d = model([peer(0), peer(1)])
    assert peer_delta(d, d, converged(d), NOW) == []
    assert touched_peers(d, d) == []


def test_a_device_setting_change_is_left_to_the_full_converge():
    d = model([peer(0)])
    assert peer_delta(d, replace(d, listen_port=51999), converged(d), NOW) is None
    assert peer_delta(d, replace(d, persistent_keepalive=0), converged(d), NOW) is None


def test_sequential_peers_collapse_into_one_route_and_a_removal_splits_it():
    d = model([peer(0), peer(1), peer(2)])  # 10.100.0.4-6
    believed = converged(d)
    grown = d.with_peer(peer(3))  # 10.100.0.7: completes 10.100.0.4/30
    changes = peer_delta(d, grown, believed, NOW)
    assert [type(c) for c in changes] == [PeerAdded, RouteMissing, RouteExtra, RouteExtra]
    believed = simulate(believed, changes)
    assert believed.link.routes == {"10.100.0.4/30"}
    shrunk = grown.without_peer("n_1")  # 10.100.0.5 leaves: the /30 is cut around it
    changes = peer_delta(grown, shrunk, believed, NOW)
    after = simulate(believed, changes)
    assert after.link.routes == {"10.100.0.4/32", "10.100.0.6/31"}
    assert [type(c) for c in changes] == [PeerRemoved, RouteMissing, RouteMissing, RouteExtra]
    assert diff(shrunk, after, NOW) == []


def test_a_key_rotation_replaces_the_peer_and_an_endpoint_change_is_one_update():
    d = model([peer(0, endpoint="10.0.0.1:51820")])
    believed = converged(d)
    rotated = d.with_peer(peer(0, key=5, endpoint="10.0.0.1:51820"))
    assert [type(c) for c in peer_delta(d, rotated, believed, NOW)] == [PeerKeyChanged]
    moved = d.with_peer_endpoint("n_0", "10.0.0.2:51821")
    (change,) = peer_delta(d, moved, believed, NOW)
    assert isinstance(change, PeerEndpointChanged) and change.want == "10.0.0.2:51821"


def test_a_route_still_needed_by_another_peer_stays():
    wide = peer(0, allowed=("10.100.1.0/24",))
    inner = peer(1, allowed=("10.100.1.7/32",))
    d = model([wide, inner])
    believed = converged(d)
    gone = d.without_peer("n_1")
    changes = peer_delta(d, gone, believed, NOW)
    assert [type(c) for c in changes] == [PeerRemoved]
    assert diff(gone, simulate(believed, changes), NOW) == []


def test_an_endpoint_the_model_moved_wins_over_roaming_but_a_roamed_peer_is_otherwise_left_alone():
    """A fresh handshake means the peer may have roamed (the device knows better than a stale model): the full
    diff leaves its endpoint alone. But when the model itself moves the endpoint (the NAT endpoint exchange, a
    peer_endpoint_changed event), that is news: the peer's old mapping is gone and it cannot reach us first."""
    d = model([peer(0, endpoint="10.0.0.1:51820"), peer(1, endpoint="10.0.0.1:51820")])
    believed = converged(d)
    live = dict(believed.device.peers)
    for i in (0, 1):  # both handshook a moment ago, and peer 1 roamed to another address
        live[KEYS[i]] = replace(live[KEYS[i]], last_handshake=NOW - 5,
                                endpoint="10.0.0.9:40000" if i == 1 else live[KEYS[i]].endpoint)
    recent = replace(believed, device=replace(believed.device, peers=live))
    moved = d.with_peer_endpoint("n_0", "10.0.0.2:51821")
    (change,) = peer_delta(d, moved, recent, NOW)
    assert isinstance(change, PeerEndpointChanged) and (change.peer_id, change.want) == ("n_0", "10.0.0.2:51821")
    # peer 1 is touched (its allowed IPs change) but its endpoint did not move in the model: roaming wins
    widened = d.with_peer(peer(1, endpoint="10.0.0.1:51820", allowed=("192.168.5.0/24",)))
    assert not any(isinstance(c, PeerEndpointChanged) for c in peer_delta(d, widened, recent, NOW))
    assert not any(isinstance(c, PeerEndpointChanged) for c in diff(d, recent, NOW))


def test_a_full_diff_that_gets_to_a_moved_endpoint_first_applies_it_over_roaming():
    """The event path knew a moved endpoint was news; the full diff did not. When the full converge got there
    first (no baseline: a peer's host name did not resolve; or the periodic reconcile ran between the edit and
    its apply), the switch was left undone while the handshake was fresh, and the baseline then held the new
    model: the device stayed on the old path, the model said the new one, and nothing would ever apply it."""
    d = model([peer(0, endpoint="10.0.0.1:51820"), peer(1, endpoint="10.0.0.1:51820")])
    believed = converged(d)
    live = {k: replace(p, last_handshake=NOW - 5) for k, p in believed.device.peers.items()}
    recent = replace(believed, device=replace(believed.device, peers=live))
    applied = {k: p.endpoint for k, p in believed.device.peers.items()}  # what the last apply left
    moved = d.with_peer_endpoint("n_0", "10.0.0.2:51821")  # a path switch, seen first by a full converge
    changes = [c for c in diff(moved, recent, NOW, applied) if isinstance(c, PeerEndpointChanged)]
    assert [(c.peer_id, c.want) for c in changes] == [("n_0", "10.0.0.2:51821")]
    # without a record (a fresh start), a roamed peer is still left alone
    assert not any(isinstance(c, PeerEndpointChanged) for c in diff(moved, recent, NOW))
