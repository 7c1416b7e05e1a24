"""What a control plane may not ask, valid signature or not: each refused for the offending peer or prefix, with
the reason, while the rest applies (pure tests on the desired model, plus a property test)."""

from __future__ import annotations

import base64
import ipaddress
import os

from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.public import PrivateKey

from plexd.state.desired import DesiredState, canonical_key
from plexd.state.model import Peer, State
from plexd.state.route_limits import Coverage, Guarded, RouteLimits

CP = ipaddress.ip_address("198.51.100.10")
UNDERLAY = ipaddress.ip_address("192.0.2.5")
LIMITS = RouteLimits(frozenset({CP, UNDERLAY}))


def key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def model(limits: RouteLimits = LIMITS) -> DesiredState:
    d = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, mesh_ip="10.100.0.1",
                             private_key=base64.b64encode(bytes(PrivateKey.generate())).decode())
    return d.with_route_limits(limits)


def peer(n: int, *allowed: str, endpoint: str = "", mesh_ip: str | None = None, **kw) -> Peer:
    mesh = f"10.100.0.{n}" if mesh_ip is None else mesh_ip
    return Peer(id=f"n_{n}", public_key=kw.get("public_key") or key(), mesh_ip=mesh, endpoint=endpoint,
                allowed_ips=allowed or (f"{mesh}/32",))


def refused(d: DesiredState) -> dict[tuple[str, str], str]:
    return {(pid, prefix): why for pid, prefix, why in d.refused_routes}


def test_a_default_route_is_refused_the_rest_of_the_peer_applies():
    d = model().with_peer(peer(2, "10.100.0.2/32", "0.0.0.0/0"))
    assert d.peers["n_2"].allowed_ips == ("10.100.0.2/32",)
    assert "a default route" in refused(d)[("n_2", "0.0.0.0/0")]
    d = model().with_peer(peer(3, "10.100.0.3/32", "::/0"))
    assert d.peers["n_3"].allowed_ips == ("10.100.0.3/32",) and ("n_3", "::/0") in refused(d)


def test_a_default_route_split_in_halves_over_two_peers_is_refused():
    d = model(RouteLimits(guarded=())).with_state(State(peers=(peer(2, "10.100.0.2/32", "0.0.0.0/1"),
                                                     peer(3, "10.100.0.3/32", "128.0.0.0/1"))))
    routes = {p for x in d.peers.values() for p in x.allowed_ips}
    assert not {"0.0.0.0/1", "128.0.0.0/1"} <= routes
    assert any("amounts to a default route" in why for why in refused(d).values())


def test_exit_routes_only_when_configured_and_never_over_the_control_plane():
    limits = RouteLimits(frozenset({CP}), allow_exit_routes=True)
    d = model(limits).with_peer(peer(2, "10.100.0.2/32", "0.0.0.0/0"))
    # allowed as an exit route... except that 0/0 holds the control plane's address, which is never routed
    assert "0.0.0.0/0" not in d.peers["n_2"].allowed_ips and "198.51.100.10" in refused(d)[("n_2", "0.0.0.0/0")]
    d = model(RouteLimits(frozenset(), allow_exit_routes=True)).with_peer(peer(2, "10.100.0.2/32", "0.0.0.0/0"))
    assert "0.0.0.0/0" in d.peers["n_2"].allowed_ips


def test_the_control_plane_and_underlay_addresses_never_enter_the_tunnel():
    d = model().with_state(State(peers=(peer(2, "10.100.0.2/32", "198.51.100.0/24"),
                                        peer(3, "10.100.0.3/32", "192.0.2.5/32"))))
    assert d.peers["n_2"].allowed_ips == ("10.100.0.2/32",) and d.peers["n_3"].allowed_ips == ("10.100.0.3/32",)
    assert "198.51.100.10" in refused(d)[("n_2", "198.51.100.0/24")]
    assert "192.0.2.5" in refused(d)[("n_3", "192.0.2.5/32")]
    # a peer whose only route is a protected address (its mesh IP) is refused whole
    d = model().with_peer(peer(4, mesh_ip="198.51.100.10"))
    assert "n_4" not in d.peers and "control plane" in dict(d.rejected)["n_4"]


def test_a_peers_endpoint_is_never_routed_into_the_tunnel():
    a = peer(2, endpoint="203.0.113.7:51820")
    d = model().with_state(State(peers=(a, peer(3, "10.100.0.3/32", "203.0.113.0/24"))))
    assert d.peers["n_3"].allowed_ips == ("10.100.0.3/32",)
    assert "endpoint 203.0.113.7 of peer n_2" in refused(d)[("n_3", "203.0.113.0/24")]
    d = model().with_peer(peer(5, "10.100.0.5/32", "203.0.113.9/32", endpoint="203.0.113.9:51820"))
    assert ("n_5", "203.0.113.9/32") in refused(d)  # its own endpoint: a routing loop


def test_whether_a_prefix_may_cover_an_endpoint_never_depends_on_which_peer_came_first():
    # The endpoint was checked against the newcomer's own prefixes only: a covering prefix already in place stayed,
    # and the endpoint's tunnel packets went into the tunnel (a loop), depending on list or event order.
    covering, endpoint_peer = peer(3, "10.100.0.3/32", "203.0.113.0/24"), peer(2, endpoint="203.0.113.7:51820")
    for order in ((covering, endpoint_peer), (endpoint_peer, covering)):
        d = model().with_state(State(peers=order))
        assert d.peers["n_3"].allowed_ips == ("10.100.0.3/32",), order
        assert "endpoint 203.0.113.7 of peer n_2" in refused(d)[("n_3", "203.0.113.0/24")]
    # by events: the endpoint's peer arrives after the covering prefix, or its endpoint moves into it
    d = model().with_peer(covering).with_peer(endpoint_peer)
    assert d.peers["n_3"].allowed_ips == ("10.100.0.3/32",) and ("n_3", "203.0.113.0/24") in refused(d)
    d = model().with_peer(covering).with_peer(peer(2, endpoint="198.51.100.20:51820"))
    assert "203.0.113.0/24" in d.peers["n_3"].allowed_ips
    d = d.with_peer_endpoint("n_2", "203.0.113.9:4500")
    assert d.peers["n_3"].allowed_ips == ("10.100.0.3/32",) and "203.0.113.9" in refused(d)[("n_3", "203.0.113.0/24")]


def test_a_peer_refused_outright_protects_no_endpoint_whatever_its_place():
    covering = peer(3, "10.100.0.3/32", "203.0.113.0/24")
    broken = peer(2, endpoint="203.0.113.7:51820", public_key="not a key")
    for order in ((covering, broken), (broken, covering)):
        d = model().with_state(State(peers=order))
        assert "n_2" not in d.peers and "203.0.113.0/24" in d.peers["n_3"].allowed_ips, order


def test_a_relay_endpoint_and_a_shared_nat_address_stay_protected():
    relayed = Peer(id="n_2", public_key=key(), mesh_ip="10.100.0.2", endpoint="198.51.100.20:51820",
                   fallback_endpoint="203.0.113.50:51821", allowed_ips=("10.100.0.2/32",))
    d = model().with_state(State(peers=(relayed, peer(3, "10.100.0.3/32", "203.0.113.0/24"))))
    assert "endpoint 203.0.113.50 of peer n_2" in refused(d)[("n_3", "203.0.113.0/24")]
    # two peers behind one NAT address: the one leaving must not unprotect it for the other
    a, b = peer(4, endpoint="203.0.113.7:40001"), peer(5, endpoint="203.0.113.7:40002")
    d = model().with_state(State(peers=(a, b))).without_peer("n_4")
    d = d.with_peer(peer(6, "10.100.0.6/32", "203.0.113.0/24"))
    assert d.peers["n_6"].allowed_ips == ("10.100.0.6/32",) and "of peer n_5" in refused(d)[("n_6", "203.0.113.0/24")]


def test_mesh_addresses_belong_to_one_peer():
    a = peer(2)
    d = model().with_state(State(peers=(a, peer(3, mesh_ip="10.100.0.2"), peer(4, mesh_ip="10.100.0.1"))))
    rejected = dict(d.rejected)
    assert set(d.peers) == {"n_2"}
    assert rejected["n_3"] == "mesh IP 10.100.0.2 already belongs to peer n_2"
    assert rejected["n_4"] == "mesh IP 10.100.0.1 is this node's own"
    # the same prefix would move a's address to the thief (WireGuard keeps one owner per prefix)...
    d = model().with_state(State(peers=(a, peer(6, "10.100.0.6/32", "10.100.0.2/32"))))
    assert "claims 10.100.0.2/32, which is routed to peer n_2" in refused(d)[("n_6", "10.100.0.2/32")]
    d = model().with_peer(peer(7, "10.100.0.7/32", "10.100.0.1/32"))
    assert "this node's own mesh address" in refused(d)[("n_7", "10.100.0.1/32")]
    # ...while a wider prefix takes nothing: the longest prefix wins, a's /32 stays a's
    d = model().with_state(State(peers=(a, peer(5, "10.100.0.5/32", "10.100.0.0/24"))))
    assert d.peers["n_5"].allowed_ips == ("10.100.0.5/32", "10.100.0.0/24") and d.refused_routes == ()


def test_keys_written_differently_are_one_key():
    raw = os.urandom(32)
    canonical = base64.b64encode(raw).decode()
    sloppy = canonical[:42] + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"[
        ("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".index(canonical[42]) | 1)] + "="
    assert base64.b64decode(sloppy) == raw  # the same 32 bytes
    assert canonical_key(sloppy) == canonical
    d = model().with_peer(peer(2, public_key=sloppy))
    assert d.peers["n_2"].public_key == canonical  # what WireGuard reports: no endless peer_updated
    d = d.with_peer(peer(3, public_key=canonical))
    assert dict(d.rejected)["n_3"] == "public key is already used by peer n_2"
    own = model()
    assert dict(own.with_peer(peer(4, public_key=own.public_key)).rejected)["n_4"] == \
        "public key is this node's own key"


def test_a_removed_peer_takes_its_refusals_with_it():
    d = model().with_peer(peer(2, "10.100.0.2/32", "0.0.0.0/0"))
    assert d.refused_routes
    assert d.without_peer("n_2").refused_routes == ()


cidr = st.builds(lambda a, n: str(ipaddress.ip_network(f"{ipaddress.IPv4Address(a)}/{n}", strict=False)),
                 st.integers(0, 2**32 - 1), st.integers(0, 32))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(cidr, min_size=1, max_size=4), min_size=1, max_size=8))
def test_whatever_is_asked_no_accepted_route_covers_a_protected_address_or_half_the_space(routes):
    d = model().with_state(State(peers=tuple(peer(i + 2, *r) for i, r in enumerate(routes))))
    accepted = [ipaddress.ip_network(p) for x in d.peers.values() for p in x.allowed_ips]
    for net in accepted:
        assert CP not in net and UNDERLAY not in net
    assert len(accepted) == len(set(accepted))  # one owner per prefix
    covered = sum(n.num_addresses for n in ipaddress.collapse_addresses(accepted))
    assert covered <= 2**32 * LIMITS.max_route_percent / 100
    assert not any(n.overlaps(ipaddress.ip_network("169.254.0.0/16")) for n in accepted)
    # every asked-for prefix is either routed or named as refused
    for x, r in zip(d.peers.values(), routes, strict=False):
        named = {p for pid, p, _ in d.refused_routes if pid == x.id}
        assert set(r) <= set(x.allowed_ips) | named


def test_guarded_prefixes_are_refused_by_name_and_opened_only_by_the_allow_list():
    limits = RouteLimits(frozenset({CP}), guarded=(Guarded(ipaddress.ip_network("10.255.255.53/32"), "the resolver"),
                                                   Guarded(ipaddress.ip_network("192.168.7.0/24"), "this node's LAN"),
                                                   *RouteLimits().guarded))
    d = model(limits).with_state(State(peers=(
        peer(2, "10.100.0.2/32", "169.254.169.254/32"), peer(3, "10.100.0.3/32", "169.254.10.0/24"),
        peer(4, "10.100.0.4/32", "10.255.0.0/16"), peer(5, "10.100.0.5/32", "192.168.7.128/25"),
        peer(6, "10.100.0.6/32", "fe80::/64"), peer(7, "10.100.0.7/32", "10.8.0.0/16"))))
    why = refused(d)
    assert "cloud metadata service 169.254.169.254" in why[("n_2", "169.254.169.254/32")]
    assert "link-local" in why[("n_3", "169.254.10.0/24")]
    assert "the resolver" in why[("n_4", "10.255.0.0/16")]  # a prefix over it, not only the /32
    assert "this node's LAN" in why[("n_5", "192.168.7.128/25")]  # a prefix inside it
    assert "link-local" in why[("n_6", "fe80::/64")]
    assert d.peers["n_7"].allowed_ips == ("10.100.0.7/32", "10.8.0.0/16")  # the rest applies
    assert all("mesh.allow_routes" in w for w in why.values())
    # the operator opens the LAN prefix (a site-to-site route over it): allowed; the control plane never
    opened = RouteLimits(limits.protected, guarded=limits.guarded,
                         allow=(ipaddress.ip_network("192.168.7.0/24"), ipaddress.ip_network("198.51.100.0/24")))
    d = model(opened).with_state(State(peers=(peer(5, "10.100.0.5/32", "192.168.7.128/25"),
                                             peer(8, "10.100.0.8/32", "198.51.100.0/24"))))
    assert d.peers["n_5"].allowed_ips == ("10.100.0.5/32", "192.168.7.128/25")
    assert "198.51.100.10" in refused(d)[("n_8", "198.51.100.0/24")]


def test_a_share_of_the_address_space_is_refused_however_it_is_split():
    # 16 × /4: the whole space in sixteenths, over sixteen peers
    d = model().with_state(State(peers=tuple(peer(10 + i, f"10.100.0.{10 + i}/32", f"{16 * i}.0.0.0/4")
                                             for i in range(16))))
    assert len(refused(d)) == 16 and all(x.allowed_ips == (f"{x.mesh_ip}/32",) for x in d.peers.values())
    assert all(("of the IPv4 address space" in w or "overlaps" in w or "would route" in w) for w in refused(d).values())
    # a /9 split into 128 /16s over 8 peers: the share counts addresses, not prefixes
    pieces = [f"44.{i}.0.0/16" for i in range(128)]
    d = model().with_state(State(peers=tuple(peer(20 + i, f"10.100.0.{20 + i}/32", *pieces[16 * i:16 * i + 16])
                                             for i in range(8))))
    accepted = [ipaddress.ip_network(p) for x in d.peers.values() for p in x.allowed_ips if p.startswith("44.")]
    assert 0 < sum(n.num_addresses for n in accepted) <= 2**32 * 0.001
    assert "mesh.max_route_percent is 0.1" in str(refused(d))
    # the operator may raise the share
    wide = RouteLimits(max_route_percent=1.0)
    d = model(wide).with_peer(peer(2, "10.100.0.2/32", "44.0.0.0/9"))
    assert "44.0.0.0/9" in d.peers["n_2"].allowed_ips


@settings(max_examples=200, deadline=None)
@given(st.lists(cidr, max_size=30), cidr)
def test_coverage_counts_what_collapsed_prefixes_cover(nets, extra):
    parsed = [ipaddress.ip_network(n) for n in nets]
    cov = Coverage(parsed)
    assert cov.total[4] == sum(n.num_addresses for n in ipaddress.collapse_addresses(parsed))
    new = ipaddress.ip_network(extra)
    assert cov.added_by(new) == sum(n.num_addresses for n in ipaddress.collapse_addresses([*parsed, new])) \
        - cov.total[4]
