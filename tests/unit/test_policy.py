"""The policy engine (pure): visibility, the rules a node applies, bad rules skipped with their names; and the
firewall diff's rule ordering, property-tested against a model of how nftables inserts and deletes."""

from __future__ import annotations

import json

from engine_helpers import converge
from hypothesis import given, settings
from hypothesis import strategies as st

from plexd.firewall import plan as fwplan
from plexd.firewall.ruleset import (
    ChainSpec,
    LiveChain,
    LiveRule,
    LiveTable,
    Ruleset,
    RuleSpec,
    SessionGate,
    desired_ruleset,
)
from plexd.state.desired import DesiredState
from plexd.state.model import Peer, Policy, PolicyRule, State
from plexd.state.policy import compile_policies

NODES = {"n_a": "10.100.0.1", "n_b": "10.100.0.2", "n_c": "10.100.0.3", "n_d": "10.100.1.4"}


def compiled(policies, me="n_a"):
    return compile_policies(tuple(policies), me, (NODES[me],))


def peer(node_id):
    return Peer(node_id, "k", NODES[node_id])


def visible(policies, me="n_a"):
    c = compiled(policies, me)
    return sorted(n for n in NODES if n != me and c.sees(peer(n)))


def rule(src, dst, port=0, protocol="", action="allow"):
    return PolicyRule(src, dst, port, protocol, action)


def test_no_policies_means_no_peers_and_allow_all_means_all():
    assert visible([]) == []
    assert visible([Policy("all", (rule("*", "*"),))]) == ["n_b", "n_c", "n_d"]


def test_allows_are_bidirectional_for_visibility_and_deny_never_hides():
    pol = [Policy("p", (rule("n_b", "n_a", 22, "tcp"), rule("n_a", "n_c", action="deny")))]
    assert visible(pol, "n_a") == ["n_b"]
    assert visible(pol, "n_b") == ["n_a"]  # the other end sees it too
    assert visible(pol, "n_c") == []


def test_cidr_ends_inside_the_mesh_range():
    pol = [Policy("p", (rule("10.100.1.0/24", "n_a"),))]
    assert visible(pol) == ["n_d"]
    c = compiled(pol)
    assert [r.src.value for r in c.inbound()] == ["10.100.1.0/24"]


def test_forwarded_rules_leave_out_only_those_to_this_node_alone():
    """Routed traffic is never addressed to this node's own mesh IP: forward needs no copy of those rules (and a
    smaller table makes libnftables' positioned inserts cheaper)."""
    pol = [Policy("p", (rule("n_b", "n_a", 22, "tcp"), rule("n_b", "*", 53), rule("n_b", "10.100.1.0/24"),
                        rule("n_b", "n_c", 80, "tcp"), rule("*", "n_a", action="deny")))]
    c = compiled(pol)
    assert [r.dst.value or r.dst.kind for r in c.forwarded()] == ["any", "10.100.1.0/24", "n_c"]
    assert [r.dst.value or r.dst.kind for r in c.inbound()] == ["n_a", "any", "n_a"]  # n_a is not in the /24


def test_bad_rules_are_skipped_by_name_and_the_rest_applies():
    wire = {"policies": [
        {"id": "web", "rules": [
            {"src": "n_b", "dst": "n_a", "protocol": "sctp", "action": "allow"},
            {"src": "n_b", "dst": "n_a", "action": "maybe"},
            {"src": "n_b", "dst": "n_a", "port": 70000, "protocol": "tcp", "action": "allow"},
            {"src": "192.168.0.0/24", "dst": "n_a", "action": "allow"},
            {"src": "n_b", "dst": "n_a", "port": "22", "action": "allow"},
            {"src": "n_b", "dst": "n_a", "port": 22, "protocol": "icmp", "action": "allow"},
            {"src": "", "dst": "n_a", "action": "allow"},
            {"src": "n_c", "dst": "n_a", "port": 443, "protocol": "tcp", "action": "allow"},
            {"src": "n_b", "dst": "n_a"},
        ]},
        ["not", "a", "policy"],
        {"id": "web", "rules": [{"src": "*", "dst": "*", "action": "allow"}]},
    ]}
    c = compiled(State.from_wire(wire).policies)
    reasons = [str(s) for s in c.skipped]
    assert reasons[0] == "policy web rule 0: unknown protocol 'sctp' (tcp, udp, icmp or \"\" for any)"
    assert reasons[1] == "policy web rule 1: unknown action 'maybe' (allow or deny)"
    assert reasons[2] == "policy web rule 2: port 70000 is out of range (0 for any, or 1-65535)"
    assert reasons[3] == "policy web rule 3: src 192.168.0.0/24 is outside the mesh range 10.100.0.0/16"
    assert reasons[4].startswith("policy web rule 4: policies[0].rules[4].port")
    assert reasons[5].startswith("policy web rule 5: a port needs protocol tcp or udp")
    assert reasons[6].startswith("policy web rule 6: src is empty")
    assert reasons[7] == "policy web rule 8: action is missing (allow or deny)"
    assert reasons[8].startswith("policy (no id): policies[1]")
    assert reasons[9] == "policy web: a policy with this id came earlier; this one is ignored"
    assert [(r.policy_id, r.index) for r in c.rules] == [("web", 7)]
    assert visible(State.from_wire(wire).policies) == ["n_c"]


def test_a_rule_naming_an_unknown_node_is_kept_and_named():
    c = compiled([Policy("p", (rule("n_zz", "n_a", 22, "tcp"),))])
    assert len(c.rules) == 1
    [unknown] = c.unknown_nodes({"n_b": peer("n_b")})
    assert str(unknown).startswith("policy p rule 0: src names node n_zz, which is not a known node")


def test_visibility_filters_the_device_but_not_the_model():
    d = DesiredState.initial(interface="plexd0", listen_port=1, mtu=1420, private_key="", mesh_ip="10.100.0.1",
                             node_id="n_a", enforce_policy=True)
    d = d.with_peers([Peer("n_b", "B" * 43 + "=", "10.100.0.2"), Peer("n_c", "C" * 43 + "=", "10.100.0.3")])
    d = d.with_policies([Policy("p", (rule("n_b", "n_a"),))])
    assert set(d.peers) == {"n_b", "n_c"} and set(d.shown_peers) == {"n_b"}
    assert d.shown_peer("n_c") is None
    from plexd.mesh.mesh_plan import target

    assert set(target(d).peer_ids.values()) == {"n_b"}


ends = st.sampled_from(["*", *NODES, "10.100.0.0/30", "10.100.1.0/24"])
rules_st = st.lists(st.builds(rule, ends, ends, st.sampled_from([0, 22]), st.sampled_from(["", "tcp", "icmp"]),
                              st.sampled_from(["allow", "deny"])), max_size=6)


@settings(max_examples=200, deadline=None)
@given(rules_st, st.sampled_from(list(NODES)), st.sampled_from(list(NODES)))
def test_visibility_is_symmetric_and_deny_rules_never_change_it(rules, x, y):
    pol = [Policy("p", tuple(rules))]
    if x != y:
        assert compiled(pol, x).sees(peer(y)) == compiled(pol, y).sees(peer(x))
    allows_only = [Policy("p", tuple(r for r in rules if r.action == "allow"))]
    assert visible(pol, x) == visible(allows_only, x)


@settings(max_examples=200, deadline=None)
@given(rules_st, rules_st)
def test_adding_rules_never_hides_a_peer(first, more):
    assert set(visible([Policy("p", tuple(first))])) <= set(visible([Policy("p", tuple(first + more))]))


@settings(max_examples=100, deadline=None)
@given(rules_st)
def test_every_usable_rule_reaches_the_forward_chain_and_the_chains_end_in_default_deny(rules):
    c = compiled([Policy("p", tuple(rules))])
    rs = desired_ruleset(c, "plexd0", NODES, log_denied=False)
    for chain in rs.chains.values():
        assert chain.rules[0].label == "established" and chain.rules[-1].label == "default deny"
        assert len({r.key for r in chain.rules}) == len(chain.rules)  # keys are unique in a chain
    assert {s.node for s in rs.sets.values()} == c.referenced_nodes()


def test_a_session_listener_gets_the_policy_rules_of_the_service_it_stands_for():
    """Who may reach a session is who the policy lets reach its service (tcp/22 for SSH, the target port for
    TCP): those inbound rules, in order, denies too, matched on the listener's socket mark instead of the port."""
    c = compiled([Policy("p", (rule("n_b", "n_a", 22, "tcp", "deny"), rule("n_b", "n_a", 22, "udp"),
                               rule("*", "n_a"), rule("n_c", "n_a", 5432, "tcp"), rule("n_d", "n_b", 22, "tcp")))])
    gates = (SessionGate("ses_ssh", 0x706C0001, 22), SessionGate("ses_db", 0x706C0002, 5432))
    chain = desired_ruleset(c, "plexd0", NODES, False, gates).chains["input"]
    sessions = [(r.label.split()[1], json.loads(r.expr_json)) for r in chain.rules if r.label.startswith("session")]
    assert [(sid, e[1]["match"]["right"], e[-1]) for sid, e in sessions] == [
        ("ses_ssh", 0x706C0001, {"drop": None}),  # n_b is denied tcp/22, so it is denied the session
        ("ses_ssh", 0x706C0001, {"accept": None}),  # "*" any protocol
        ("ses_db", 0x706C0002, {"accept": None}),
        ("ses_db", 0x706C0002, {"accept": None}),  # n_c: tcp/5432
    ]
    labels = [r.label for r in chain.rules]
    assert labels.index(chain.rules[1].label) == 1 and labels[0] == "established"  # right after established
    assert all(r.label.startswith("session") for r in chain.rules[1:5])
    assert not any("socket" in r.expr_json for r in desired_ruleset(c, "plexd0", NODES, False).chains["input"].rules)
    no_say = compiled([Policy("p", (rule("n_b", "n_a", 80, "tcp"),))])
    only_web = desired_ruleset(no_say, "plexd0", NODES, False, gates).chains["input"]
    assert not any(r.label.startswith("session") for r in only_web.rules)  # nobody: the default deny


# -- the chain diff keeps order with the fewest changes, whatever the live chain looks like -----------------------


def _spec(k: int) -> RuleSpec:
    return RuleSpec(f"plexd:{k:04x}", f"plexd:{k:04x} r{k}", "[]", f"r{k}")


def _apply(live: list[tuple[int, str]], changes) -> list[str]:
    """nftables' semantics: delete by handle, insert before a handle, add at the end; new handles grow."""
    rows = list(live)
    next_handle = max((h for h, _ in rows), default=0) + 1
    for c in changes:
        if isinstance(c, fwplan.RuleExtra):
            rows = [r for r in rows if r[0] != c.handle]
        elif isinstance(c, fwplan.RuleMissing):
            new = (next_handle, c.rule.key)
            next_handle += 1
            if c.before is None:
                rows.append(new)
            else:
                at = next(i for i, r in enumerate(rows) if r[0] == c.before)
                rows.insert(at, new)
    return [k for _, k in rows]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 30), unique=True, max_size=15), st.lists(st.integers(0, 40), max_size=20))
def test_chain_diff_reaches_the_wanted_order(wanted, live_keys):
    want = Ruleset({"input": ChainSpec("input", "input", tuple(_spec(k) for k in wanted))}, {})
    live_rules = tuple(LiveRule(h + 1, f"plexd:{k:04x} x" if k < 35 else "foreign") for h, k in enumerate(live_keys))
    live = LiveTable({"input": LiveChain("input", ("filter", "input", 0, "accept"), live_rules)}, {})
    changes = fwplan.diff(want, live)
    result = _apply([(r.handle, r.key or "foreign") for r in live_rules], changes)
    assert result == [f"plexd:{k:04x}" for k in wanted]
    kept = len(live_rules) - sum(isinstance(c, fwplan.RuleExtra) for c in changes)
    # Never more deletions than needed: an in-order live chain loses nothing.
    if [r.key for r in live_rules] == [f"plexd:{k:04x}" for k in wanted]:
        assert changes == []
    assert kept <= len(wanted)


async def test_nftables_missing_is_one_clear_error_and_degraded_never_silent(monkeypatch, caplog):
    # The import itself fails here (sys.modules entry None is how Python spells "not installed").
    import sys

    from plexd.controlplane.client import HeartbeatRequest
    from plexd.firewall.firewall_domain import FirewallDomain

    monkeypatch.setitem(sys.modules, "nftables", None)
    fw = FirewallDomain("plexd0")
    d = DesiredState.initial(interface="plexd0", listen_port=1, mtu=1420, private_key="", mesh_ip="10.100.0.1",
                             node_id="n_a", enforce_policy=True)
    d = d.with_peers([Peer("n_b", "B" * 43 + "=", "10.100.0.2"), Peer("n_c", "C" * 43 + "=", "10.100.0.3")])
    d = d.with_policies([Policy("p", (rule("n_b", "n_a"),))])
    first = await converge(fw, d, full=True)
    await converge(fw, d, full=True)
    assert fw.enforcement == "degraded"
    assert "the Python module nftables is missing (pip install pip-nftables)" in fw.reason
    assert first.errors == (fw.reason,)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "policy enforcement unavailable" in errors[0].getMessage()  # said once, at start
    assert set(d.shown_peers) == {"n_b"}  # visibility still applies: n_c never reaches the device
    from datetime import UTC, datetime

    body = HeartbeatRequest("n_a", datetime.now(UTC), "degraded", "1s", "", status_reason=fw.reason).to_wire()
    assert body["status"] == "degraded" and "nftables is missing" in body["status_reason"]

    # The module installed while plexd runs: the next look (every REPROBE_INTERVAL) finds it, no restart needed.
    # (A stand-in for the module that appears: the real one is in this process already, under the test's None.)
    class Appeared:
        transactions: list = []

        def probe(self) -> None:
            pass

        def list_table(self, family, name):
            return None  # no table yet: the diff creates it

        def run(self, commands) -> None:
            self.transactions.append(commands)

        def run_script(self, script) -> None:
            self.transactions.append(script)

    monkeypatch.setattr(fw, "nft", Appeared())
    monkeypatch.setattr(fw, "_probed_at", 0.0)  # the interval has passed
    again = await converge(fw, d, full=True)
    assert fw.unavailable == "" and fw.enforcement == "enforced"
    assert [c.correction_type for c in again.changes] == ["firewall_table_added"]
    assert len(Appeared.transactions) == 1


def test_set_elements_are_compared_in_one_form_so_a_v4_mapped_address_does_not_flap():
    # nft prints ::ffff:10.100.0.2 where Python writes ::ffff:a64:2: compared as text, the element was added and
    # then deleted at every converge.
    from plexd.firewall.ruleset import parse_table

    live = parse_table([{"table": {"family": "inet", "name": "plexd"}},
                        {"set": {"name": "node_n_b", "type": "ipv6_addr", "elem": ["::ffff:10.100.0.2",
                                                                                 "FD00::0001"]}}])
    assert live is not None and live.sets["node_n_b"].elements == {"::ffff:a64:2", "fd00::1"}
