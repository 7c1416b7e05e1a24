"""The pure diff: property tests (hypothesis) and named cases. No I/O."""

from __future__ import annotations

import base64
import ipaddress
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.public import PrivateKey

from plexd.machine.links import LinkState
from plexd.machine.wireguard import DeviceConfig, PeerConfig, clamp_private_key
from plexd.mesh.mesh_plan import (
    ROAMING_WINDOW,
    AddressExtra,
    AddressMissing,
    InterfaceMissing,
    LinkDown,
    MtuWrong,
    Observed,
    PeerAdded,
    PeerAllowedIpsChanged,
    PeerEndpointChanged,
    PeerKeepaliveChanged,
    PeerKeyChanged,
    PeerPskChanged,
    PeerRemoved,
    PrivateKeyWrong,
    RouteExtra,
    RouteMissing,
    UserspaceProcessGone,
    device_update,
    diff,
    first_contacts,
    link_ops,
    rekey_kicks,
    simulate,
    target,
)
from plexd.state.desired import DesiredState
from plexd.state.model import Peer


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


KEYS = [_b64(bytes(PrivateKey(bytes([i + 1]) * 32).public_key)) for i in range(8)]
PRIVATE = [_b64(bytes([0x40 + i]) * 32) for i in range(3)]
NOW = 1_800_000_000.0
ENDPOINTS = ["", "10.0.0.1:51820", "10.0.0.2:51821", "[fd00::1]:51820"]
CIDRS = ["10.100.0.1/32", "10.100.0.2/32", "10.100.1.0/24", "fd00::2/128", "192.168.5.0/24"]
ADDRS = ["10.100.9.9/32", "10.100.9.8/32", "fd10::9/128"]


def state(peers=(), *, mesh_ip="10.100.9.9", mesh_ip6=None, keepalive=25) -> DesiredState:
    d = DesiredState.initial(interface="wg0", listen_port=51820, mtu=1420, private_key=PRIVATE[0], mesh_ip=mesh_ip,
                             mesh_ip6=mesh_ip6, persistent_keepalive=keepalive)
    return d.with_peers(peers)


def converged(d: DesiredState) -> Observed:
    t = target(d)
    return Observed(device=t.device, link=LinkState(index=3, kind="tun", mtu=t.mtu, up=True, addresses=t.addresses,
                                                    routes=t.routes, rules=t.rule_families))


# --- strategies ---------------------------------------------------------------------------------------------

peer_st = st.builds(
    lambda i, k, ep, ips, psk: Peer(id=f"n_{i}", public_key=KEYS[k], mesh_ip=f"10.100.0.{i + 1}", endpoint=ep,
                                    allowed_ips=tuple(ips), psk=psk),
    st.integers(0, 7), st.integers(0, 7), st.sampled_from(ENDPOINTS), st.lists(st.sampled_from(CIDRS), max_size=3),
    st.sampled_from(["", KEYS[7]]),
)
desired_st = st.builds(lambda peers, v6, ka: state(peers, mesh_ip6=v6, keepalive=ka),
                       st.lists(peer_st, max_size=6), st.sampled_from([None, "fd10::9"]), st.sampled_from([0, 25]))
live_peer_st = st.builds(
    lambda k, ep, ips, psk, ka, hs: PeerConfig(public_key=KEYS[k], endpoint=ep, allowed_ips=frozenset(ips), psk=psk,
                                               persistent_keepalive=ka, last_handshake=hs),
    st.integers(0, 7), st.sampled_from(ENDPOINTS), st.sets(st.sampled_from(CIDRS), max_size=3),
    st.sampled_from(["", KEYS[7]]), st.sampled_from([0, 25]),
    st.sampled_from([0.0, NOW - 10, NOW - ROAMING_WINDOW - 1]),
)
device_st = st.one_of(st.none(), st.builds(
    lambda pk, port, peers: DeviceConfig(private_key=pk, listen_port=port, peers={p.public_key: p for p in peers}),
    st.sampled_from(["", clamp_private_key(PRIVATE[0]), clamp_private_key(PRIVATE[1])]),
    st.sampled_from([0, 51820, 40000]), st.lists(live_peer_st, max_size=6)))
link_st = st.one_of(st.none(), st.builds(
    lambda mtu, up, addrs, routes, main, rules: LinkState(index=3, kind="tun", mtu=mtu, up=up,
                                                          addresses=frozenset(addrs), routes=frozenset(routes),
                                                          main_routes=frozenset(main), rules=frozenset(rules)),
    st.sampled_from([1420, 1500]), st.booleans(), st.sets(st.sampled_from(ADDRS)), st.sets(st.sampled_from(CIDRS)),
    st.sets(st.sampled_from(CIDRS), max_size=2), st.sets(st.sampled_from([4, 6]))))
observed_st = st.builds(
    lambda dev, link, gone, names: Observed(device=dev, link=link if dev is not None else None, process_gone=gone,
                                            peer_names={KEYS[k]: f"n_{i}" for k, i in names.items()}),
    device_st, link_st, st.booleans(), st.dictionaries(st.integers(0, 7), st.integers(0, 7), max_size=4))


# --- properties ---------------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(desired_st, observed_st)
def test_applying_the_plan_converges(d: DesiredState, obs: Observed) -> None:
    after = simulate(obs, diff(d, obs, NOW))
    assert diff(d, after, NOW) == []


@settings(max_examples=300, deadline=None)
@given(desired_st, observed_st)
def test_applying_the_plan_yields_the_desired_state_when_nothing_roams(d: DesiredState, obs: Observed) -> None:
    later = NOW + 10 * ROAMING_WINDOW  # every handshake is old: no endpoint is protected
    after = simulate(obs, diff(d, obs, later))
    t = target(d)
    assert after.device is not None and after.link is not None
    assert after.device.private_key == t.device.private_key
    assert after.device.listen_port == t.device.listen_port
    # endpoints: a desired "" leaves whatever was learned; everything else must match exactly
    for key, want in t.device.peers.items():
        got = after.device.peers[key]
        assert replace(got, endpoint=want.endpoint if not want.endpoint else got.endpoint) == want
    assert set(after.device.peers) == set(t.device.peers)
    assert (after.link.addresses, after.link.routes, after.link.mtu, after.link.up) == (
        t.addresses, t.routes, t.mtu, True)
    # routes only in the mesh table, reachable through its rules; nothing of ours left in the main table
    assert after.link.main_routes == frozenset() and t.rule_families <= after.link.rules


@settings(max_examples=200, deadline=None)
@given(desired_st)
def test_diff_of_a_converged_machine_is_empty(d: DesiredState) -> None:
    assert diff(d, converged(d), NOW) == []


@settings(max_examples=300, deadline=None)
@given(desired_st, observed_st)
def test_only_changed_peers_are_written(d: DesiredState, obs: Observed) -> None:
    changes = diff(d, obs, NOW)
    written = {u.public_key for u in device_update(changes).peers}
    live = obs.device.peers if obs.device is not None else {}
    want = target(d).device.peers
    unchanged = {k for k in want if k in live and want[k] == live[k]}
    assert not written & unchanged
    for c in changes:
        assert c.correction_type and c.detail


# --- cases --------------------------------------------------------------------------------------------------

PA = Peer(id="n_a", public_key=KEYS[1], mesh_ip="10.100.0.2", endpoint="10.0.0.2:51820", allowed_ips=("10.100.0.2/32",))
PB = Peer(id="n_b", public_key=KEYS[2], mesh_ip="10.100.0.3", endpoint="10.0.0.3:51820", allowed_ips=())


def test_fresh_device_plans_everything_in_order() -> None:
    d = state([PA, PB])
    changes = diff(d, Observed(device=None, link=None), NOW)
    assert isinstance(changes[0], InterfaceMissing)
    kinds = [type(c).__name__ for c in changes]
    assert kinds.count("PeerAdded") == 2
    assert {c.correction_type for c in changes} >= {"interface_created", "peer_added", "address_added", "route_added",
                                                    "mtu_updated", "link_up", "private_key_updated",
                                                    "listen_port_updated"}
    # a peer without allowed IPs gets its mesh IP
    assert target(d).device.peers[KEYS[2]].allowed_ips == frozenset({"10.100.0.3/32"})
    # 10.100.0.2/32 and 10.100.0.3/32 are covered by one route
    assert [(op.action, op.value) for op in link_ops(changes)] == [
        ("mtu", 1420), ("up", None), ("addr_add", "10.100.9.9/32"), ("rule_add", 4), ("route_add", "10.100.0.2/31")]


def test_process_gone_is_named_as_such() -> None:
    changes = diff(state([PA]), Observed(device=None, link=None, process_gone=True), NOW)
    assert isinstance(changes[0], UserspaceProcessGone)
    assert changes[0].correction().to_wire() == {"type": "userspace_restarted",
                                       "detail": "interface wg0: userspace WireGuard process was not running, "
                                                 "restarted"}


def test_endpoint_detail_and_roaming_window() -> None:
    d = state([PA])
    obs = converged(d)
    moved = replace(obs.device.peers[KEYS[1]], endpoint="5.6.7.8:51820", last_handshake=0)
    obs = replace(obs, device=replace(obs.device, peers={KEYS[1]: moved}))
    (c,) = diff(d, obs, NOW)
    assert isinstance(c, PeerEndpointChanged)
    assert c.correction().to_wire() == {"type": "peer_updated",
                                        "detail": "peer n_a: endpoint 5.6.7.8:51820 != 10.0.0.2:51820"}
    # keepalive off then on in the same transaction, so wireguard-go handshakes with the new endpoint at once
    kick, update = device_update([c]).peers
    assert (kick.persistent_keepalive, kick.endpoint, kick.update_only) == (0, None, True)
    assert (update.persistent_keepalive, update.endpoint, update.update_only) == (25, "10.0.0.2:51820", True)
    # a recent handshake means the peer roamed: leave the endpoint alone
    roamed = replace(moved, last_handshake=NOW - ROAMING_WINDOW + 1)
    assert diff(d, replace(obs, device=replace(obs.device, peers={KEYS[1]: roamed})), NOW) == []
    stale = replace(moved, last_handshake=NOW - ROAMING_WINDOW - 1)
    assert len(diff(d, replace(obs, device=replace(obs.device, peers={KEYS[1]: stale})), NOW)) == 1


def test_first_contacts_are_the_changes_that_make_wireguard_handshake_and_held_ones_are_not_kicked() -> None:
    fresh = diff(state([PA]), Observed(device=DeviceConfig(), link=None), NOW)
    (added,) = [c for c in fresh if isinstance(c, PeerAdded)]
    assert first_contacts(fresh) == {KEYS[1]: 25}
    assert first_contacts(diff(state([replace(PA, endpoint="")]), converged(state([])), NOW)) == {}  # nowhere to send
    assert first_contacts(diff(state([PA], keepalive=0), converged(state([])), NOW)) == {}  # no keepalive, no kick
    # held: the peer is added with its keepalive off (WireGuard sends nothing yet) ...
    (u,) = device_update([added], held={KEYS[1]}).peers
    assert (u.update_only, u.endpoint, u.persistent_keepalive) == (False, "10.0.0.2:51820", 0)
    # ... while the machine is believed as it will be once the held kick has gone out
    assert simulate(converged(state([])), [added]).device.peers[KEYS[1]].persistent_keepalive == 25
    moved = replace(converged(state([PA])).device.peers[KEYS[1]], endpoint="5.6.7.8:51820")
    obs = replace(converged(state([PA])), device=DeviceConfig(peers={KEYS[1]: moved}))
    (c,) = [c for c in diff(state([PA]), obs, NOW) if isinstance(c, PeerEndpointChanged)]
    assert first_contacts([c]) == {KEYS[1]: 25}
    (only,) = device_update([c], held={KEYS[1]}).peers  # the endpoint without the off-and-on toggle, and off
    assert (only.endpoint, only.persistent_keepalive) == ("10.0.0.2:51820", 0)


def test_a_held_peer_known_before_its_endpoint_is_not_kicked_when_the_endpoint_arrives() -> None:
    """The events' path: `peer_added` without an endpoint (its keepalive 0 on the device: nowhere to send), then
    the endpoint. That is an endpoint change and a keepalive change from 0 to 25, which WireGuard takes as a
    kick: held, the transaction must leave the keepalive off (both lab nodes initiated, and the handshakes
    crossed, while it turned it on)."""
    known = converged(state([replace(PA, endpoint="")]))
    assert known.device.peers[KEYS[1]].persistent_keepalive == 0
    changes = diff(state([PA]), known, NOW)
    assert {type(c) for c in changes} == {PeerEndpointChanged, PeerKeepaliveChanged}
    assert first_contacts(changes) == {KEYS[1]: 25}
    (held,) = device_update(changes, held={KEYS[1]}).peers
    assert (held.endpoint, held.persistent_keepalive) == ("10.0.0.2:51820", 0)
    # leading, the same changes are the off-and-on kick
    off, on = device_update(changes).peers
    assert (off.persistent_keepalive, on.endpoint, on.persistent_keepalive) == (0, "10.0.0.2:51820", 25)


def test_a_keepalive_turned_on_for_a_peer_whose_endpoint_the_device_has_is_a_first_contact() -> None:
    """The device has the endpoint already (the model's endpoint left and came back unchanged, or the mesh's
    keepalive setting was turned on): keepalive 0 -> 25 is WireGuard's kick on both nodes, so it is held too."""
    live = converged(state([PA], keepalive=0))
    assert live.device.peers[KEYS[1]].endpoint == "10.0.0.2:51820"
    (c,) = diff(state([PA]), live, NOW)
    assert isinstance(c, PeerKeepaliveChanged) and c.kicks
    assert first_contacts([c]) == {KEYS[1]: 25}
    (u,) = device_update([c], held={KEYS[1]}).peers
    assert u.persistent_keepalive == 0
    # from a keepalive already on to another value: WireGuard sends nothing, no kick
    elsewhere = replace(live, device=replace(live.device, peers={KEYS[1]: replace(
        live.device.peers[KEYS[1]], persistent_keepalive=30)}))
    assert first_contacts(diff(state([PA]), elsewhere, NOW)) == {}


def test_a_new_private_key_kicks_every_kept_alive_peer_in_the_same_transaction() -> None:
    """After a key swap, a handshake initiation to every peer goes out at once under the new key (the peers
    drop it in a rotation: they do not know the key yet); WireGuard then sends no other for 5 s, so our data
    cannot start one that crosses the peer's own initiation once it learns the key."""
    quiet = replace(PB, endpoint="")  # nowhere to send: not kicked
    fresh = Peer(id="n_c", public_key=KEYS[3], mesh_ip="10.100.0.4", endpoint="10.0.0.4:51820", allowed_ips=())
    d = state([PA, quiet, fresh])
    live = converged(state([PA, quiet]))
    obs = replace(live, device=replace(live.device, private_key=PRIVATE[1]))
    changes = diff(d, obs, NOW)
    assert {PrivateKeyWrong, PeerAdded} <= {type(c) for c in changes}
    kicks = rekey_kicks(changes, d)
    assert kicks == {KEYS[1]: 25}  # n_c is created in this transaction: its creation is its kick
    u = device_update(changes, rekeyed=kicks)
    assert u.private_key == PRIVATE[0]
    by_key = [(p.public_key, p.persistent_keepalive, p.update_only) for p in u.peers]
    assert by_key.index((KEYS[1], 0, True)) < by_key.index((KEYS[1], 25, True))  # off, then on
    assert rekey_kicks([c for c in changes if not isinstance(c, PrivateKeyWrong)], d) == {}
    # without a key change the mesh's whole target is not built: an event's delta stays O(change)
    event = d.with_peer(replace(PA, endpoint="10.0.0.9:51820"))
    assert rekey_kicks([c for c in changes if not isinstance(c, PrivateKeyWrong)], event) == {}
    assert "_plan_target" not in event.__dict__
    # a peer held for its first contact stays held
    assert all(p.public_key != KEYS[1] for p in device_update(changes, held={KEYS[1]}, rekeyed=kicks).peers)


def test_field_changes_of_one_peer_are_one_update_only_block() -> None:
    d = state([replace(PA, psk=KEYS[7])])
    obs = converged(state([PA], keepalive=0))
    changes = diff(d, obs, NOW)
    assert {type(c) for c in changes} == {PeerPskChanged, PeerKeepaliveChanged}
    (u,) = device_update(changes).peers
    assert u.update_only and u.psk == KEYS[7] and u.persistent_keepalive == 25 and u.endpoint is None
    assert "preshared key differs" in changes[0].detail + changes[1].detail
    assert KEYS[7] not in repr(changes)  # key material never in reprs or details


def test_allowed_ips_change_replaces_the_set() -> None:
    d = state([replace(PA, allowed_ips=("10.100.0.2/32", "10.100.5.0/24"))])
    changes = diff(d, converged(state([PA])), NOW)
    assert any(isinstance(c, PeerAllowedIpsChanged) for c in changes)
    assert RouteMissing("wg0", "10.100.5.0/24") in changes
    (u,) = device_update(changes).peers
    assert u.allowed_ips == frozenset({"10.100.0.2/32", "10.100.5.0/24"})


def test_public_key_change_removes_and_re_adds() -> None:
    old = state([PA])
    new = state([replace(PA, public_key=KEYS[3])])
    obs = replace(converged(old), peer_names={KEYS[1]: "n_a"})
    (c,) = diff(new, obs, NOW)
    assert isinstance(c, PeerKeyChanged) and c.correction_type == "peer_updated"
    assert c.detail.startswith("peer n_a: public key ")
    ups = device_update([c]).peers
    assert ups[0].remove and ups[0].public_key == KEYS[1]
    assert not ups[1].remove and ups[1].public_key == KEYS[3] and not ups[1].update_only
    # without the name table it is an honest remove + add
    kinds = {type(x) for x in diff(new, converged(old), NOW)}
    assert kinds == {PeerRemoved, PeerAdded}


def test_extra_peer_named_by_label_or_fingerprint() -> None:
    d = state([PA])
    obs = converged(state([PA, PB]))
    c, *routes = diff(d, obs, NOW)
    assert routes == [RouteExtra("wg0", "10.100.0.2/31"), RouteMissing("wg0", "10.100.0.2/32")]
    assert isinstance(c, PeerRemoved) and c.detail == f"peer {KEYS[2][:8]}…: on the device but not desired"
    c, *_ = diff(d, replace(obs, peer_names={KEYS[2]: "n_b"}), NOW)
    assert c.correction().to_wire() == {"type": "peer_removed", "detail": "peer n_b: on the device but not desired"}


def test_link_drift() -> None:
    d = state([PA], mesh_ip6="fd10::9")
    obs = converged(d)
    link = replace(obs.link, mtu=1500, up=False, addresses=frozenset({"10.100.9.9/32", "10.1.1.1/24"}),
                   routes=obs.link.routes | {"10.9.0.0/16"})
    changes = diff(d, replace(obs, link=link), NOW)
    assert set(changes) == {MtuWrong("wg0", 1420, 1500), LinkDown("wg0"), AddressExtra("wg0", "10.1.1.1/24"),
                            AddressMissing("wg0", "fd10::9/128"), RouteExtra("wg0", "10.9.0.0/16")}
    assert AddressMissing("wg0", "fd10::9/128").detail == "interface wg0: address fd10::9/128 missing"


def test_default_route_and_own_address_are_not_routed() -> None:
    d = state([replace(PA, allowed_ips=("0.0.0.0/0", "10.100.9.9/32", "10.100.0.2/32"))])
    assert target(d).routes == frozenset({"10.100.0.2/32"})


def test_hostnames_normalized_and_ipv6_endpoint() -> None:
    d = state([replace(PA, endpoint="[FD00:0::1]:51820")])
    assert target(d).device.peers[KEYS[1]].endpoint == "[fd00::1]:51820"


def test_routes_cover_exactly_the_allowed_ips_with_few_prefixes() -> None:
    peers = [Peer(id=f"n_{i}", public_key=_b64(bytes(PrivateKey(bytes([i + 100]) * 32).public_key)),
                  mesh_ip=f"10.128.0.{i}", allowed_ips=(f"10.128.0.{i}/32",)) for i in range(2, 130)]
    routes = target(state(peers)).routes
    assert routes == frozenset({"10.128.0.2/31", "10.128.0.4/30", "10.128.0.8/29", "10.128.0.16/28",
                                "10.128.0.32/27", "10.128.0.64/26", "10.128.0.128/31"})
    covered = {ip for r in routes for ip in ipaddress.ip_network(r)}
    assert {str(ip) for ip in covered} == {f"10.128.0.{i}" for i in range(2, 130)}


def test_a_v4_mapped_endpoint_is_written_as_wireguard_prints_it():
    # Python 3.11 prints ::ffff:1.2.3.4 as ::ffff:102:304, wireguard-go and inet_ntop as ::ffff:1.2.3.4: the endpoint
    # of a peer without a recent handshake was set again, and reported as drift, at every reconcile.
    from plexd.mesh.mesh_plan import normalize_endpoint

    assert normalize_endpoint("[::ffff:1.2.3.4]:51820") == "[::ffff:1.2.3.4]:51820"
    assert normalize_endpoint("[::FFFF:102:304]:51820") == "[::ffff:1.2.3.4]:51820"
    assert normalize_endpoint("[fd00::1]:5") == "[fd00::1]:5" and normalize_endpoint("1.2.3.4:5") == "1.2.3.4:5"
