"""User access and site-to-site, their pure parts: the blocks of either contract with their limits and refusals
(fuzzed), the forwarding ledger (against a directory laid out like /proc/sys/net/ipv4/conf: writing the real
knobs of this machine from a unit test is not something a test may do), the interface diff, the specs' refusals,
the firewall's guards and the devplane's routed prefixes. The real interfaces are tested in
tests/e2e/test_bridge_interfaces_lab.py."""

from __future__ import annotations

import base64
import json
import os
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from plexd.bridge.fastpath import MARK
from plexd.bridge.forwarding import FAST_PATH_KEY, Forward, ForwardingLedger
from plexd.bridge.interface_keys import interface_key
from plexd.bridge.site_to_site import tunnel_specs
from plexd.bridge.user_access import access_specs
from plexd.bridge.wgif import InterfaceSeen, InterfaceSpec, WgInterface
from plexd.devplane.store import Node
from plexd.firewall.ruleset import BridgeGuards, TunnelGuard, desired_ruleset
from plexd.machine.links import LinkState, Underlay
from plexd.machine.wireguard import DeviceConfig, PeerConfig
from plexd.state.bridge_blocks import MAX_ACCESS_PEERS, MAX_TUNNELS, parse_site_to_site, parse_user_access
from plexd.state.desired import DesiredState
from plexd.state.model import Peer, Policy, PolicyRule, State
from plexd.state.policy import compile_policies


def key(i: int) -> str:
    return base64.b64encode(bytes([i % 256]) * 32).decode()


def access_doc(peers: list[dict]) -> dict:
    return {"bridge": {"user_access": {"enabled": True, "peers": peers}}}


def tunnel(i: int, **over) -> dict:
    return {"tunnel_id": f"s2s_{i}", "remote_endpoint": f"192.0.2.{i + 1}:51823", "remote_public_key": key(i),
            "local_subnets": ["172.20.0.0/16"], "remote_subnets": [f"172.{30 + i}.0.0/16"], **over}


# -- the blocks ------------------------------------------------------------------------------------------------


def test_both_contracts_give_the_same_user_access_and_null_means_nothing_desired():
    peer = {"public_key": key(1), "allowed_ips": ["10.100.250.5/32"], "label": "alice"}
    newer = parse_user_access(access_doc([peer]))
    older = parse_user_access({"user_access_config": {"enabled": True, "peers": [peer]}})
    assert newer == older and newer.enabled and newer.interface == "wg-access" and newer.listen_port == 51822
    assert [p.allowed_ips for p in newer.peers] == [("10.100.250.5/32",)]
    assert parse_user_access({"bridge": {"user_access": None}}).enabled is False
    assert parse_user_access({"bridge": None}).enabled is False
    state = State.from_wire({"peers": [], "bridge": {"user_access": None, "site_to_site": None}})
    assert state.user_access is not None and not state.user_access.enabled
    assert State.from_wire({"peers": []}).user_access is None  # no block: nothing said, nothing changes


def test_the_51st_access_peer_and_bad_entries_are_refused_by_index_and_the_others_apply():
    peers = [{"public_key": key(i), "allowed_ips": [f"10.100.{200 + i // 250}.{i % 250 + 1}/32"]}
             for i in range(MAX_ACCESS_PEERS + 1)]
    peers += [{"public_key": key(0), "allowed_ips": ["10.100.251.1/32"]},  # a duplicate key
              {"public_key": "not-a-key", "allowed_ips": ["10.100.251.2/32"]},
              {"public_key": key(200), "allowed_ips": ["nonsense"]}, "not an object"]
    access = parse_user_access(access_doc(peers))
    assert len(access.peers) == MAX_ACCESS_PEERS
    reasons = "\n".join(access.refused)
    assert f"limit of {MAX_ACCESS_PEERS} access peers" in reasons and "duplicate public_key" in reasons
    assert "peers[52].public_key" in reasons and "is not a WireGuard key" in reasons
    assert "peers[53].allowed_ips[0]" in reasons and "'nonsense' is not a CIDR" in reasons
    assert "peers[54]: must be an object" in reasons


def test_the_11th_tunnel_duplicates_and_other_providers_are_refused_with_reasons():
    tunnels = [tunnel(i) for i in range(MAX_TUNNELS + 1)]
    tunnels += [tunnel(0, listen_port=52000, interface_name="wg-s2s-x"), tunnel(20, provider_type="ipsec"),
                tunnel(21, interface_name="eth0"), tunnel(22, remote_endpoint="nowhere")]
    s2s = parse_site_to_site({"site_to_site_config": {"enabled": True, "tunnels": tunnels}})
    assert [t.interface for t in s2s.tunnels] == [f"wg-s2s-{i + 1}" for i in range(MAX_TUNNELS)]
    assert [t.listen_port for t in s2s.tunnels][:2] == [51823, 51824]
    reasons = "\n".join(s2s.refused)
    assert f"limit of {MAX_TUNNELS} site-to-site tunnels" in reasons and "duplicate tunnel_id 's2s_0'" in reasons
    assert "'ipsec' is not supported" in reasons and "'eth0' must start with 'wg-s2s-'" in reasons
    assert "tunnels[14].remote_endpoint" in reasons


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
                        ["enabled", "peers", "tunnels", "public_key", "allowed_ips", "tunnel_id", "remote_endpoint",
                         "remote_public_key", "remote_subnets", "local_subnets", "interface_name", "listen_port",
                         "psk", "provider_type", "user_access", "site_to_site"]), inner, max_size=5), max_leaves=30))
def test_any_block_parses_to_a_value_or_refusals_never_an_exception(doc):
    for state in ({"bridge": doc}, {"bridge": {"user_access": doc, "site_to_site": doc}},
                  {"user_access_config": doc, "site_to_site_config": doc}):
        access, s2s = parse_user_access(state), parse_site_to_site(state)
        assert len(access.peers) <= MAX_ACCESS_PEERS and len(s2s.tunnels) <= MAX_TUNNELS
        assert all(isinstance(r, str) and r for r in access.refused + s2s.refused)


# -- the forwarding ledger -------------------------------------------------------------------------------------


def knobs(tmp_path, **values: str) -> str:
    proc = tmp_path / "conf"
    for name, value in values.items():
        (proc / name).mkdir(parents=True)
        (proc / name / "forwarding").write_text(value + "\n")
    return str(proc)


def knob(proc: str, name: str) -> str:
    with open(os.path.join(proc, name, "forwarding")) as f:
        return f.read().strip()


def test_the_ledger_turns_knobs_on_and_puts_back_only_what_it_changed_when_the_last_holder_lets_go(tmp_path):
    proc = knobs(tmp_path, plexd0="0", lan1="1", eth9="0")
    ledger = ForwardingLedger(tmp_path / "data", proc)
    assert ledger.enable(Forward("plexd0"), "wg-access") and not ledger.enable(Forward("lan1"), "wg-s2s-1")
    ledger.enable(Forward("plexd0"), "wg-s2s-1")
    assert knob(proc, "plexd0") == "1" and knob(proc, "lan1") == "1"
    assert ledger.release("wg-access") == [] and knob(proc, "plexd0") == "1"  # the tunnel still needs it
    # A restart in between: the original value is on disk, written before the knob was.
    again = ForwardingLedger(tmp_path / "data", proc)
    assert again.saved == {"plexd0": "0"}
    again.enable(Forward("plexd0"), "wg-s2s-1")
    assert again.release("wg-s2s-1") == []
    assert knob(proc, "plexd0") == "0" and knob(proc, "lan1") == "1"  # put back; the one already on untouched
    assert json.loads((tmp_path / "data" / "bridge" / "forwarding.json").read_text()) == {}
    for bad in ("all", "default", "../x", ""):
        try:
            ledger.enable(Forward(bad), "x")
        except ValueError as e:
            assert "not an interface name" in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_after_a_restart_a_removed_interfaces_knobs_are_put_back_unless_a_wanted_one_holds_them(tmp_path):
    # Holders live in memory: after a restart only the file knows a tunnel turned plexd0 and its LAN on. When
    # that tunnel goes, every recorded knob no wanted interface holds (said again by the domains' observe) is
    # put back.
    proc = knobs(tmp_path, plexd0="0", eth1="0")
    first = ForwardingLedger(tmp_path / "data", proc)
    first.enable(Forward("plexd0"), "wg-s2s-1")
    first.enable(Forward("eth1"), "wg-s2s-1")
    restarted = ForwardingLedger(tmp_path / "data", proc)
    restarted.hold(Forward("plexd0"), "wg-access")  # user access is still wanted and needs the mesh interface
    assert restarted.release("wg-s2s-1") == []
    assert knob(proc, "eth1") == "0" and knob(proc, "plexd0") == "1"
    assert restarted.release("wg-access") == []
    assert knob(proc, "plexd0") == "0" and restarted.saved == {}


class ScriptedNft:
    """nftables as the ledger uses it: scripts applied, and the table listed back (its rules' comments)."""

    def __init__(self) -> None:
        self.scripts: list[str] = []
        self.comments: list[str] | None = None  # None: no table
        self.refuse = False

    def run_script(self, script: str) -> None:
        if self.refuse:
            raise OSError("nftables refused the change")
        self.scripts.append(script)
        self.comments = re.findall(r'comment "([^"]+)"', script) if "chain forward" in script else None

    def list_table(self, family: str, name: str) -> list[dict] | None:
        assert (family, name) == ("inet", "plexd_bridge")
        return None if self.comments is None else [{"rule": {"comment": c}} for c in self.comments]


def limit_rules(script: str) -> list[str]:
    return [re.sub(r' comment ".*"', "", line.strip()) for line in script.splitlines()
            if line.strip().startswith("iifname")]


def test_forwarding_reaches_only_what_the_policy_and_the_tunnels_name(tmp_path):
    # A policy rule's `dst *` matched any destination, and what a local subnet's LAN sent was not filtered at all:
    # an access peer reached the bridge's LAN, remote sites and the Internet through it, a LAN host the Internet.
    nft, now = ScriptedNft(), [0.0]
    names = ("wg-access", "plexd0", "wg-s2s-1", "lan1")
    proc = knobs(tmp_path, **dict.fromkeys(names, "0"))
    ledger = ForwardingLedger(tmp_path / "data", proc, guard=nft, clock=lambda: now[0])
    d = desired(user_access={"enabled": True, "peers": [{"public_key": key(1), "allowed_ips": ["10.100.250.5/32"]}]},
                site_to_site={"enabled": True, "tunnels": [tunnel(0, local_subnets=["192.168.7.0/24"])]})
    specs = [*access_specs(str(tmp_path), "plexd0")(d, UNDERLAY).specs.values(),
             *tunnel_specs(str(tmp_path), "plexd0", ("10.100.0.0/16",), False)(d, UNDERLAY).specs.values()]
    for spec in specs:
        for forward in spec.forwarding:
            ledger.enable(forward, spec.name)
    assert limit_rules(nft.scripts[-1]) == [
        'iifname "lan1" ct state established,related accept',  # replies of allowed flows, everywhere
        'iifname "lan1" ip daddr 172.30.0.0/16 accept',  # a local subnet's hosts: its remote site only
        'iifname "lan1" counter drop',
        'iifname "plexd0" ct state established,related accept',
        'iifname "plexd0" ip daddr 10.100.250.5/32 accept',  # the mesh: the access peers and the remote site
        'iifname "plexd0" ip daddr 172.30.0.0/16 accept',
        'iifname "plexd0" counter drop',
        'iifname "wg-access" ct state established,related accept',
        'iifname "wg-access" ip daddr 10.100.0.0/16 accept',  # an access peer: the mesh range, all a policy names
        'iifname "wg-access" counter drop',
        'iifname "wg-s2s-1" ct state established,related accept',
        'iifname "wg-s2s-1" ip daddr 192.168.7.0/24 accept',  # the remote site: its local subnets
        'iifname "wg-s2s-1" counter drop']
    assert [knob(proc, n) for n in names] == ["1"] * 4
    applied = len(nft.scripts)
    assert all(ledger.is_on(n) and not ledger.limit_drift(n) for n in names) and len(nft.scripts) == applied

    # The table flushed (`nft flush ruleset`, a firewall reload): drift, put back by the next converge.
    nft.comments, now[0] = None, 5.0
    assert ledger.is_on("wg-access") and ledger.limit_drift("wg-access") == "missing"
    ledger.enable(specs[0].forwarding[0], "wg-access")
    assert limit_rules(nft.scripts[-1]) == limit_rules(nft.scripts[applied - 1])
    assert ledger.limit_drift("wg-access") == ""

    # The tunnel goes: its knobs are put back, and so are its limits.
    assert ledger.release("wg-s2s-1") == [] and knob(proc, "lan1") == "0"
    assert [r for r in limit_rules(nft.scripts[-1]) if "accept" in r and "ct state" not in r] == [
        'iifname "plexd0" ip daddr 10.100.250.5/32 accept', 'iifname "wg-access" ip daddr 10.100.0.0/16 accept']

    # An access peer more: the mesh interface's limit differs from the one in place until the next converge.
    wider = Forward("plexd0", ("10.100.250.5/32", "10.100.250.6/32"))
    ledger.hold(wider, "wg-access")
    assert ledger.limit_drift("plexd0") == "differs" and ledger.limit_drift("wg-access") == ""
    ledger.enable(wider, "wg-access")
    assert 'iifname "plexd0" ip daddr 10.100.250.6/32 accept' in limit_rules(nft.scripts[-1])
    assert ledger.limit_drift("plexd0") == ""

    # The last holder gone, the table goes.
    assert ledger.release("wg-access") == [] and nft.comments is None and knob(proc, "plexd0") == "0"


def test_a_lan_already_forwarding_is_left_alone_and_no_knob_goes_on_without_its_limit(tmp_path):
    nft = ScriptedNft()
    proc = knobs(tmp_path, lan1="1", **{"wg-s2s-1": "0"})
    ledger = ForwardingLedger(tmp_path / "data", proc, guard=nft)
    ledger.enable(Forward("lan1", ("172.30.0.0/16",), lan=True), "wg-s2s-1")  # this machine's router already
    assert nft.comments is None and ledger.limits() == {}
    nft.refuse = True
    try:
        ledger.enable(Forward("wg-s2s-1", ("192.168.7.0/24",)), "wg-s2s-1")
    except OSError as e:
        assert "cannot be put in place" in str(e)
    else:
        raise AssertionError("a knob went on without its limit")
    assert knob(proc, "wg-s2s-1") == "0" and knob(proc, "lan1") == "1"


def test_the_relay_fast_paths_packets_pass_first_and_that_rule_gone_is_drift(tmp_path):
    # The fast path forwards relayed packets untracked (no `established` to match) and marked. Arriving on the
    # relay's interface, also a LAN whose forwarding plexd turned on for a tunnel, they met that LAN's drop.
    nft, now = ScriptedNft(), [0.0]
    proc = knobs(tmp_path, eth0="0")
    ledger = ForwardingLedger(tmp_path / "data", proc, guard=nft, clock=lambda: now[0])
    lan = Forward("eth0", ("172.30.0.0/16",), lan=True)
    ledger.enable(lan, "wg-s2s-1")
    chain = [line.strip() for line in nft.scripts[-1].splitlines()]
    first = chain.index("type filter hook forward priority filter; policy accept;") + 1
    assert chain[first] == f'meta mark {MARK:#x} accept comment "{FAST_PATH_KEY}"'  # before every interface's
    assert chain[first + 1] == 'iifname "eth0" ct state established,related accept'
    nft.comments.remove(FAST_PATH_KEY)  # deleted by hand
    now[0] = 5.0
    assert ledger.limit_drift("eth0") == "missing"
    ledger.enable(lan, "wg-s2s-1")
    assert FAST_PATH_KEY in nft.comments and ledger.limit_drift("eth0") == ""


def test_a_malformed_prefix_is_an_error_line_never_an_exception_out_of_observe_or_teardown(tmp_path):
    nft = ScriptedNft()
    proc = knobs(tmp_path, plexd0="0", **{"wg-access": "0"})
    ledger = ForwardingLedger(tmp_path / "data", proc, guard=nft)
    ledger.enable(Forward("wg-access", ("10.100.0.0/16",)), "wg-access")
    bad = Forward("plexd0", ("10.100.250.5/33",))
    ledger.hold(bad, "wg-s2s-1")  # what an observe says a wanted interface needs
    assert ledger.limit_drift("plexd0") == "missing"  # observe: not known to be in place, not a ValueError
    try:
        ledger.enable(bad, "wg-s2s-1")  # apply: OSError, an error line (`WgInterface.apply`)
    except OSError as e:
        assert "cannot be put in place" in str(e) and "10.100.250.5/33" in str(e)
    else:
        raise AssertionError("a malformed limit was put in place")
    assert knob(proc, "plexd0") == "0"  # its knob stays off
    [error] = ledger.release("wg-access")  # teardown: its knob goes back, the limits it cannot write a line
    assert "cannot be put in place" in error and knob(proc, "wg-access") == "0"


def test_a_corrupt_ledger_is_reported_and_the_daemon_goes_on(tmp_path, caplog):
    (tmp_path / "bridge").mkdir()
    (tmp_path / "bridge" / "forwarding.json").write_text("{not json")
    assert ForwardingLedger(tmp_path, knobs(tmp_path)).saved == {}
    assert "will not be restored" in caplog.text


async def test_an_interface_that_cannot_be_removed_is_kept_and_removed_at_the_next_try(tmp_path):
    from plexd.base.errors import PlexdError
    from plexd.bridge.interfaces import InterfacesDomain, Wanted

    class Backend:
        interface = "wg-s2s-1"
        fail = True
        deleted = 0

        async def observe(self):
            return None

        async def delete_device(self):
            if Backend.fail:
                raise PlexdError("device busy")
            Backend.deleted += 1

    class LinksStandIn:
        async def delete_link(self):
            pass

        async def underlay(self):
            return UNDERLAY

    (tmp_path / "bridge").mkdir()
    (tmp_path / "bridge" / "s2s.interfaces").write_text('["wg-s2s-1"]')  # made before a restart
    ledger = ForwardingLedger(tmp_path, knobs(tmp_path))
    domain = InterfacesDomain("s2s", "site-to-site", lambda d, u: Wanted({}), lambda d: d.site_to_site,
                              lambda name: WgInterface(Backend(), LinksStandIn(), ledger),  # type: ignore[arg-type]
                              LinksStandIn(), ledger, str(tmp_path))  # type: ignore[arg-type]
    nothing = desired()
    first = await domain.apply(nothing, domain.plan(nothing, seen := await domain.observe(nothing)), seen)
    assert first.changes == () and any("device busy" in e for e in first.errors)
    assert json.loads((tmp_path / "bridge" / "s2s.interfaces").read_text()) == ["wg-s2s-1"]  # not forgotten
    Backend.fail = False
    second = await domain.apply(nothing, domain.plan(nothing, seen := await domain.observe(nothing)), seen)
    assert [c.correction().type for c in second.changes] == ["bridge_interface_removed"] and second.errors == ()
    assert Backend.deleted == 1 and json.loads((tmp_path / "bridge" / "s2s.interfaces").read_text()) == []


# -- keys ------------------------------------------------------------------------------------------------------


def test_the_interface_key_is_made_once_and_kept(tmp_path):
    first = interface_key(tmp_path, "access")
    assert interface_key(tmp_path, "access") == first and interface_key(tmp_path, "s2s_1") != first
    assert (tmp_path / "bridge" / "access.key").stat().st_mode & 0o777 == 0o600
    (tmp_path / "bridge" / "access.key").write_text("garbage")
    try:
        interface_key(tmp_path, "access")
    except OSError as e:
        assert "not valid base64" in str(e) and "remove it to make a new one" in str(e)
    else:
        raise AssertionError("a corrupt key was replaced silently")


# -- the diff --------------------------------------------------------------------------------------------------


class NoBackend:
    interface = "wg-access"


def spec(peers: dict[str, PeerConfig], routes: frozenset[str]) -> InterfaceSpec:
    return InterfaceSpec("user access", "wg-access", key(9), 51822, peers, routes,
                         (Forward("wg-access", ("10.100.0.0/16",)), Forward("plexd0", tuple(routes))))


def test_the_diff_names_every_difference_and_nothing_when_the_machine_matches(tmp_path):
    iface = WgInterface(NoBackend(), None, ForwardingLedger(tmp_path))  # type: ignore[arg-type]
    want = {key(1): PeerConfig(key(1), allowed_ips=frozenset({"10.100.250.5/32"}))}
    routes = frozenset({"10.100.250.5/32"})
    link = LinkState(index=7, kind="tun", mtu=1420, up=True, routes=routes, rules=frozenset({4}))
    live = DeviceConfig(private_key=key(9), listen_port=51822, peers=dict(want))
    assert iface.plan(spec(want, routes), InterfaceSeen(live, link)) == []
    drifted = DeviceConfig(private_key=key(8), listen_port=1, peers={
        key(1): PeerConfig(key(1), allowed_ips=frozenset({"10.100.250.6/32"})), key(2): PeerConfig(key(2))})
    lines = [str(c.correction()) for c in iface.plan(spec(want, routes), InterfaceSeen(
        drifted, LinkState(index=7, kind="tun", mtu=1420, up=False), frozenset({"plexd0"}),
        {"wg-access": "missing"}))]
    assert lines == [
        "bridge_interface_updated: user access wg-access: private key is not the kept one; restored",
        "bridge_interface_updated: user access wg-access: listen port 1; set to 51822",
        f"bridge_peer_updated: user access wg-access: peer {key(1)[:8]}…: differs; updated",
        f"bridge_peer_updated: user access wg-access: peer {key(2)[:8]}…: not wanted; removed",
        "bridge_interface_updated: user access wg-access: link down; set up",
        "bridge_route_updated: user access wg-access: the IPv4 rule to the mesh routing table is missing; added",
        "bridge_route_updated: user access wg-access: route 10.100.250.5/32 missing; added",
        "bridge_forwarding_limited: user access wg-access: forwarding limit for wg-access missing; put back",
        "bridge_forwarding_enabled: user access wg-access: net.ipv4.conf.plexd0.forwarding was off; on",
    ]
    assert [str(c.correction()) for c in iface.plan(spec(want, routes), InterfaceSeen(
        live, link, limits_drift={"plexd0": "differs"}))] == [
        "bridge_forwarding_limited: user access wg-access: forwarding limit for plexd0 differs; updated"]
    # A device to make: its own interface's knob and limit come with it, the others' are said.
    assert [str(c.correction()) for c in iface.plan(spec(want, routes), InterfaceSeen(
        None, None, frozenset({"wg-access"}), {"plexd0": "missing"}))] == [
        "bridge_interface_created: user access wg-access: created",
        "bridge_forwarding_limited: user access wg-access: forwarding limit for plexd0 missing; put back"]


# -- the specs: what the machine and the mesh refuse ------------------------------------------------------------


def desired(**blocks) -> DesiredState:
    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key=key(9),
                                mesh_ip="10.100.0.1", node_id="n_bridge")
    state = State.from_wire({"peers": [Peer("n_a", key(3), "10.100.0.2", "", ("10.100.0.2/32",)).to_wire()],
                             "bridge": blocks})
    return base.with_state(state)


UNDERLAY = Underlay(frozenset({"192.168.7.2/24"}), frozenset(), frozenset({("192.168.7.2/24", "lan1")}))


def test_access_peers_holding_a_node_or_this_machines_network_or_everything_are_refused(tmp_path):
    specs = access_specs(str(tmp_path), "plexd0")
    d = desired(user_access={"enabled": True, "peers": [
        {"public_key": key(1), "allowed_ips": ["10.100.250.5/32"], "label": "ok"},
        {"public_key": key(2), "allowed_ips": ["10.100.0.0/24"], "label": "holds-a"},
        {"public_key": key(4), "allowed_ips": ["192.168.7.0/25"], "label": "lan"},
        {"public_key": key(5), "allowed_ips": ["0.0.0.0/0"], "label": "all"},
        {"public_key": key(6), "allowed_ips": ["10.100.250.5/32"], "label": "twice"}]})
    wanted = specs(d, UNDERLAY)
    [only] = wanted.specs.values()
    assert list(only.peers) == [key(1)] and only.routes == {"10.100.250.5/32"}
    assert only.forwarding == (Forward("wg-access", ("10.100.0.0/16",)), Forward("plexd0", ("10.100.250.5/32",)))
    text = "\n".join(wanted.refused)
    assert "holds-a: refused: 10.100.0.0/24: holds the mesh address 10.100.0.1 of a node" in text
    assert "lan: refused: 192.168.7.0/25: overlaps this machine's own network 192.168.7.0/24" in text
    assert "all: refused: 0.0.0.0/0: a default route" in text and "twice: refused" in text
    assert wanted.status["public_key"] == interface_key(tmp_path, "access")[1]


def test_tunnels_overlapping_the_mesh_or_routing_everything_are_refused_unless_the_operator_allows(tmp_path):
    doc = {"enabled": True, "tunnels": [tunnel(0), tunnel(1, remote_subnets=["10.100.5.0/24"]),
                                        tunnel(2, remote_subnets=["0.0.0.0/0"], local_subnets=["192.168.7.0/24"])]}
    wanted = tunnel_specs(str(tmp_path), "plexd0", ("10.100.0.0/16",), False)(desired(site_to_site=doc), UNDERLAY)
    assert list(wanted.specs) == ["wg-s2s-1"]
    text = "\n".join(wanted.refused)
    assert "s2s_1: refused: remote subnet 10.100.5.0/24: overlaps the mesh (10.100.0.0/16)" in text
    assert "s2s_2: refused: remote subnet 0.0.0.0/0: a default route (bridge.site_to_site.allow_default_route" in text
    allowed = tunnel_specs(str(tmp_path), "plexd0", ("10.100.0.0/16",), True)(desired(site_to_site=doc), UNDERLAY)
    assert list(allowed.specs) == ["wg-s2s-1", "wg-s2s-3"]
    assert allowed.specs["wg-s2s-3"].forwarding == (  # the local subnet's LAN too
        Forward("wg-s2s-3", ("192.168.7.0/24",)), Forward("plexd0", ("0.0.0.0/0",)),
        Forward("lan1", ("0.0.0.0/0",), lan=True))
    [peer] = allowed.specs["wg-s2s-1"].peers.values()
    assert peer.endpoint == "192.0.2.1:51823" and peer.allowed_ips == {"172.30.0.0/16"}


def test_a_bridge_interface_never_takes_the_mesh_interfaces_name_or_a_port_another_part_listens_on(tmp_path):
    # An access block naming the mesh interface would have its key and peers written over the mesh's: the node off
    # the mesh. A tunnel's name is the site-to-site domain's: two domains would fight over one device.
    def refused(wanted) -> str:
        assert wanted.specs == {}
        return "\n".join(wanted.refused)

    access = access_specs(str(tmp_path), "wg-mesh", {51821: "the relay"})
    assert "user access: refused: interface wg-mesh is the mesh interface" in refused(access(desired(
        user_access={"enabled": True, "interface_name": "wg-mesh"}), UNDERLAY))
    assert "named like a site-to-site tunnel's" in refused(access(desired(
        user_access={"enabled": True, "interface_name": "wg-s2s-1"}), UNDERLAY))
    assert "listen_port 51820 is the mesh interface's" in refused(access(desired(
        user_access={"enabled": True, "listen_port": 51820}), UNDERLAY))
    assert "listen_port 51821 is the relay's" in refused(access(desired(
        user_access={"enabled": True, "listen_port": 51821}), UNDERLAY))
    both = desired(user_access={"enabled": True, "listen_port": 51900},
                   site_to_site={"enabled": True, "tunnels": [tunnel(0, listen_port=51900), tunnel(1)]})
    assert list(access(both, UNDERLAY).specs) == ["wg-access"]  # on a clash the tunnel yields, not both
    tunnels = tunnel_specs(str(tmp_path), "wg-s2s-2", ("10.100.0.0/16",), False, {51821: "the relay"})(both, UNDERLAY)
    assert tunnels.specs == {}
    text = "\n".join(tunnels.refused)
    assert "s2s_0: refused: listen_port 51900 is user access's" in text
    assert "s2s_1: refused: interface wg-s2s-2 is the mesh interface" in text
    assert access(desired(user_access={"enabled": True}), UNDERLAY).specs  # the defaults clash with nothing


def test_bridge_routes_pass_the_mesh_route_guard_so_no_block_cuts_the_bridge_off(tmp_path):
    # The routes go in the mesh's table, looked up before the main one: they steer the daemon's own traffic too.
    import dataclasses
    import ipaddress

    from plexd.state.route_limits import RouteLimits

    control_plane = "203.0.113.5"
    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key=key(9),
                                mesh_ip="10.100.0.1", node_id="n_bridge")
    base = dataclasses.replace(base, route_limits=RouteLimits(protected=frozenset({ipaddress.ip_address(
        control_plane)})))

    def with_blocks(**blocks) -> DesiredState:
        peer = Peer("n_a", key(3), "10.100.0.2", "198.51.100.7:51820", ("10.100.0.2/32",))
        relayed = Peer("n_r", key(5), "10.100.0.3", "198.51.100.80:51820", ("10.100.0.3/32",),
                       fallback_endpoint="100.64.9.9:51821")
        return base.with_state(State.from_wire({"peers": [peer.to_wire(), relayed.to_wire()], "bridge": blocks}))

    access = access_specs(str(tmp_path), "plexd0")(with_blocks(user_access={"enabled": True, "peers": [
        {"public_key": key(1), "allowed_ips": [f"{control_plane}/32"], "label": "cp"},
        {"public_key": key(2), "allowed_ips": ["198.51.100.0/24"], "label": "endpoint"},
        {"public_key": key(6), "allowed_ips": ["100.64.9.0/24"], "label": "relay"},  # a peer's relay address too
        {"public_key": key(4), "allowed_ips": ["10.100.250.0/24"], "label": "ok"}]}), UNDERLAY)
    text = "\n".join(access.refused)
    assert "relay: refused: 100.64.9.0/24: would route the endpoint 100.64.9.9 of peer n_r" in text
    assert f"cp: refused: {control_plane}/32: would route {control_plane} (the control plane" in text
    assert "endpoint: refused: 198.51.100.0/24: would route the endpoint 198.51.100.7 of peer n_a" in text
    assert list(access.specs["wg-access"].peers) == [key(4)]

    tunnels = tunnel_specs(str(tmp_path), "plexd0", ("10.100.0.0/16",), False)(with_blocks(site_to_site={
        "enabled": True, "tunnels": [
            tunnel(0, remote_subnets=["64.0.0.0/3"]),  # an eighth of IPv4: over mesh.max_route_percent
            tunnel(1, remote_subnets=["192.0.2.0/24"]),  # holds its own remote end 192.0.2.2
            tunnel(2, remote_subnets=["172.40.0.0/16"]),
            tunnel(3, remote_subnets=["10.128.0.0/9"])]}), UNDERLAY)  # a private /9: no share of public space
    text = "\n".join(tunnels.refused)
    assert "s2s_0: refused: remote subnet 64.0.0.0/3: together with the other peers' routes it" in text
    assert "s2s_1: refused: remote subnet 192.0.2.0/24: would route the endpoint 192.0.2.2 of peer tunnel s2s_1" in text
    assert list(tunnels.specs) == ["wg-s2s-3", "wg-s2s-4"]
    # The private /9 claimed first does not eat the public share of the next (it counts public space only), and
    # Python's wider is_private (240.0.0.0/4) is not taken for private.
    ordered = tunnel_specs(str(tmp_path), "plexd0", ("10.100.0.0/16",), False)(with_blocks(site_to_site={
        "enabled": True, "tunnels": [tunnel(0, remote_subnets=["10.128.0.0/9"]),
                                     tunnel(1, remote_subnets=["8.8.0.0/16"]),
                                     tunnel(2, remote_subnets=["240.0.0.0/4"])]}), UNDERLAY)
    assert list(ordered.specs) == ["wg-s2s-1", "wg-s2s-2"]
    assert "s2s_2: refused: remote subnet 240.0.0.0/4: together with the other peers' routes" in ordered.refused[0]


# -- the firewall and the devplane ---------------------------------------------------------------------------------


def test_the_access_interface_is_policed_by_the_policy_and_a_tunnel_reaches_only_its_local_subnets():
    policies = (Policy("p", (PolicyRule("10.100.250.5/32", "n_a", 0, "icmp", "allow"),
                             PolicyRule("n_b", "n_a", 22, "tcp", "allow"))),)
    compiled = compile_policies(policies, "n_bridge", ("10.100.0.1",))
    ruleset = desired_ruleset(compiled, "plexd0", {"n_a": "10.100.0.2", "n_b": "10.100.0.3"}, False,
                              bridge=BridgeGuards("wg-access", (TunnelGuard("wg-s2s-1", ("172.20.0.0/16",)),)))
    forward = [r.expr_json for r in ruleset.chains["forward"].rules]
    on = lambda iface: [e for e in forward if f'"right":"{iface}"' in e]  # noqa: E731
    assert len(on("plexd0")) == 4  # established, both policy rules, default deny
    access = on("wg-access")
    assert len(access) == 3 and '"addr":"10.100.250.5"' not in access[1] and "10.100.250.5" in access[1]
    assert '"drop"' in access[-1]  # the node-to-node rule is not copied: an access peer is never a node
    tunnel_rules = on("wg-s2s-1")
    assert len(tunnel_rules) == 3 and '"addr":"172.20.0.0","len":16' in tunnel_rules[1]
    assert len([e for e in (r.expr_json for r in ruleset.chains["input"].rules) if "wg-s2s-1" in e]) == 2


def test_the_devplane_routes_a_bridges_access_prefixes_and_remote_subnets_to_it():
    node = Node(id="n_br", hostname="br", public_key=key(1), mesh_ip="10.100.0.9", secret="s", registered_at="")
    node.bridge = {"user_access": {"peers": [{"public_key": key(2), "allowed_ips": ["10.100.250.5/32"]}]},
                   "site_to_site": {"tunnels": [{"remote_subnets": ["172.30.0.0/16"]}]}}
    assert node.peer()["allowed_ips"] == ["10.100.0.9/32", "10.100.250.5/32", "172.30.0.0/16"]
    node.bridge = {"user_access": {"enabled": False, "peers": [{"allowed_ips": ["10.100.250.5/32"]}]}}
    assert node.peer()["allowed_ips"] == ["10.100.0.9/32"]


def test_a_node_says_once_that_it_does_not_serve_a_bridge_block(caplog):
    from plexd.converge.engine import Engine
    from plexd.node.mesh import _note_bridge_block

    noted: set[str] = set()
    state = State.from_wire({"peers": [], "bridge": {"user_access": {"peers": []}, "site_to_site": None}})
    caplog.set_level("INFO", "plexd.node.mesh")
    for _ in range(3):
        _note_bridge_block(state, Engine([]), noted)
    assert [r.getMessage() for r in caplog.records] == [
        "the state has a bridge block (user_access), which only a bridge serves (mode: bridge); ignored here"]
    _note_bridge_block(State.from_wire({"peers": [], "bridge": None}), Engine([]), set())
    assert len(caplog.records) == 1  # nothing wanted: nothing to say


def test_plexd_status_shows_a_bridges_parts_with_the_keys_the_other_ends_need():
    from plexd.node.status_text import _bridge_lines

    lines = _bridge_lines({
        "relay": {"listening": True, "port": 51821, "sessions": [{}], "refused": [
            {"session_id": "r9", "reason": "relay session 'r9': limit of 100 sessions reached"}]},
        "user_access": {"interface": "wg-access", "listen_port": 51822, "public_key": key(1), "peer_count": 2,
                        "refused": ["user access peer bob: refused: 0.0.0.0/0: a default route"]},
        "site_to_site": {"tunnels": [{"tunnel_id": "s2s_1", "interface": "wg-s2s-1", "listen_port": 51823,
                                      "public_key": key(2), "remote_subnets": ["172.30.0.0/16"]}], "refused": []},
        "ingress": {"rules": [{}, {}], "ports": [{}], "connections": 3, "refused": []}})
    text = "\n".join(lines)
    assert "relay:          listening on port 51821, 1 session(s)" in text
    assert f"user access:    wg-access port 51822, public key {key(1)}, 2 peer(s)" in text
    assert f"s2s_1: wg-s2s-1 port 51823, public key {key(2)}, remote 172.30.0.0/16" in text
    assert "ingress:        2 rule(s) on 1 port(s), 3 connection(s) now" in text
    assert "refused: relay session 'r9': limit of 100 sessions reached" in text
    assert "refused: user access peer bob: refused: 0.0.0.0/0: a default route" in text
    assert _bridge_lines({"firewall": {"enforcement": "enforced"}}) == []  # a node: nothing of the sort
