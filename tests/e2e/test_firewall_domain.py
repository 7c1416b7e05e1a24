"""The firewall domain against real nftables in a namespace of its own: build, leave alone, restore, and take
the cheap path for events. Results are checked with `nft -j list ruleset` (the real tool), not with our parser.

The domain's libnftables contexts are created in a worker thread that has entered the namespace (a context works
in the namespace it was created in), so the test's own process stays where it is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import uuid

import pytest
from engine_helpers import converge
from pyroute2.netns import setns

from plexd.converge.engine import Mode
from plexd.firewall import plan as fwplan
from plexd.firewall.firewall_domain import FirewallDomain
from plexd.firewall.ruleset import desired_ruleset
from plexd.state.desired import DesiredState
from plexd.state.model import Peer, Policy, PolicyRule
from plexd.state.policy import compile_policies
from plexd.state.sessions_block import Session, SshTarget, TcpTarget

KEY = "aGVsbG8gd29ybGQgdGhpcyBpcyBhIHRlc3Qga2V5IQ=="


def _key(i: int) -> str:
    import base64

    return base64.b64encode(bytes([i % 256]) * 31 + bytes([i // 256])).decode()


@pytest.fixture
def netns():
    name = f"pxfw{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        # setns(2) moves only the calling thread: the pool's one thread lives in the namespace.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=setns, initargs=(name,))
        try:
            yield name, pool
        finally:
            pool.shutdown()
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def nft(ns: str, *args: str, check: bool = True) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", *args], capture_output=True, text=True,
                          check=check).stdout


def ruleset(ns: str) -> list[dict]:
    return json.loads(nft(ns, "-j", "list", "ruleset"))["nftables"]


def rules_of(ns: str, chain: str) -> list[str]:
    return [o["rule"].get("comment", "") for o in ruleset(ns)
            if "rule" in o and o["rule"]["table"] == "plexd" and o["rule"]["chain"] == chain]


def dports(ns: str, chain: str) -> list[int]:
    """The TCP destination ports the chain's rules match, in rule order."""
    listed = json.loads(nft(ns, "-j", "list", "chain", "inet", "plexd", chain))["nftables"]
    return [e["match"]["right"] for o in listed if "rule" in o for e in o["rule"]["expr"]
            if "match" in e and e["match"]["left"] == {"payload": {"protocol": "tcp", "field": "dport"}}]


def fresh_ruleset(desired: DesiredState):
    """The table for `desired` built whole, by a domain that has seen nothing before."""
    return FirewallDomain("plexd0").want(desired)


def domain_in(pool, **kw) -> FirewallDomain:
    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    return FirewallDomain("plexd0", run_blocking=run, **kw)


def model(policies, peers=(), node_id="n_self") -> DesiredState:
    d = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key=KEY, mesh_ip="10.100.0.1",
                             node_id=node_id, enforce_policy=True)
    d = d.with_peers(peers)
    return d.with_policies(policies)


SSH_ONLY = (Policy("ssh", (PolicyRule("n_a", "n_self", 22, "tcp", "allow"),)),)


async def test_builds_the_table_leaves_it_alone_and_restores_drift(netns):
    ns, pool = netns
    peers = [Peer("n_a", _key(1), "10.100.0.2"), Peer("n_c", _key(2), "10.100.0.3")]
    fw = domain_in(pool)
    desired = model(SSH_ONLY, peers)
    first = await converge(fw, desired, full=True)
    assert [c.correction_type for c in first.changes] == ["firewall_table_added"] and not first.errors
    assert fw.enforcement == "enforced"
    comments = rules_of(ns, "input")
    assert [c.split(" ", 1)[1] for c in comments] == ["established", "policy ssh", "default-deny"]
    sets = {o["set"]["name"]: o["set"].get("elem") for o in ruleset(ns) if "set" in o}
    assert sets == {"node_n_a": ["10.100.0.2"], "node_n_self": ["10.100.0.1"]}

    assert (await converge(fw, desired, full=True)).changes == ()  # nothing to do: nothing done

    # One deleted rule, one deleted set element: each restored, each named.
    handle = next(o["rule"]["handle"] for o in ruleset(ns)
                  if "rule" in o and o["rule"]["chain"] == "input" and "policy ssh" in o["rule"].get("comment", ""))
    nft(ns, "delete", "rule", "inet", "plexd", "input", "handle", str(handle))
    nft(ns, "delete", "element", "inet", "plexd", "node_n_a", "{ 10.100.0.2 }")
    fixed = await converge(fw, desired, full=True)
    lines = sorted(str(c.correction()) for c in fixed.changes)
    assert any(line.startswith("policy_added: policy ssh: chain input") for line in lines), lines
    assert any(line.startswith("firewall_set_element_added: firewall: set node_n_a") for line in lines), lines
    assert [c.split(" ", 1)[1] for c in rules_of(ns, "input")] == ["established", "policy ssh", "default-deny"]

    # plexd's default deny rewritten in place into an accept, its comment kept: the comment alone cannot tell.
    def verdicts(comment: str) -> list[str]:
        return [k for o in ruleset(ns) if "rule" in o and o["rule"]["chain"] == "input"
                and o["rule"].get("comment", "") == comment for e in o["rule"]["expr"] for k in e
                if k in ("accept", "drop", "reject")]

    deny = next(o["rule"] for o in ruleset(ns) if "rule" in o and o["rule"]["chain"] == "input"
                and o["rule"].get("comment", "").endswith(" default-deny"))
    denied = verdicts(deny["comment"])
    assert denied and "accept" not in denied
    nft(ns, "replace", "rule", "inet", "plexd", "input", "handle", str(deny["handle"]), "counter", "accept",
        "comment", f'"{deny["comment"]}"')
    assert verdicts(deny["comment"]) == ["accept"]  # the hole is real
    fixed = await converge(fw, desired, full=True)
    assert sorted(c.correction_type for c in fixed.changes) == ["firewall_rule_added", "firewall_rule_removed"]
    assert verdicts(deny["comment"]) == denied
    assert [c.split(" ", 1)[1] for c in rules_of(ns, "input")] == ["established", "policy ssh", "default-deny"]
    assert (await converge(fw, desired, full=True)).changes == ()  # and then left alone

    # A foreign rule slipped into our chain goes; the whole table deleted comes back.
    nft(ns, "add", "rule", "inet", "plexd", "input", "accept")
    fixed = await converge(fw, desired, full=True)
    assert [c.correction_type for c in fixed.changes] == ["firewall_rule_removed"]
    # A chain of someone else's reached by a jump from ours: deleting the chain first would fail every
    # transaction; the table is rebuilt instead.
    nft(ns, "add", "chain", "inet", "plexd", "intruder")
    nft(ns, "insert", "rule", "inet", "plexd", "input", "jump", "intruder")
    fixed = await converge(fw, desired, full=True)
    assert [c.correction_type for c in fixed.changes] == ["firewall_table_rebuilt"] and not fixed.errors
    assert "intruder" not in nft(ns, "list", "table", "inet", "plexd")
    assert [c.split(" ", 1)[1] for c in rules_of(ns, "input")] == ["established", "policy ssh", "default-deny"]
    # A dormant table keeps every rule and filters nothing: rebuilt too. (nft 1.0.6 cannot even list it as JSON:
    # the listing stops at "flags"; an unreadable listing of plexd's own table is rebuilt the same way.)
    nft(ns, "add", "table", "inet", "plexd", "{ flags dormant; }")
    assert "flags dormant" in nft(ns, "list", "table", "inet", "plexd")
    fixed = await converge(fw, desired, full=True)
    assert [c.correction_type for c in fixed.changes] == ["firewall_table_rebuilt"] and not fixed.errors
    assert "dormant" not in nft(ns, "list", "table", "inet", "plexd")
    assert fw.enforcement == "enforced"
    assert [c.split(" ", 1)[1] for c in rules_of(ns, "input")] == ["established", "policy ssh", "default-deny"]
    nft(ns, "delete", "table", "inet", "plexd")
    fixed = await converge(fw, desired, full=True)
    assert [c.correction_type for c in fixed.changes] == ["firewall_table_added"]
    nft(ns, "flush", "ruleset")
    fixed = await converge(fw, desired, full=True)
    assert [c.correction_type for c in fixed.changes] == ["firewall_table_added"]
    # forward holds no copy of a rule to this node alone: routed traffic is never addressed to it
    assert [c.split(" ", 1)[1] for c in rules_of(ns, "forward")] == ["established", "default-deny"]


async def test_a_missing_table_the_engine_may_not_restore_yet_is_said_degraded_not_enforced(netns):
    # A device already up at start is kept as it is until the first state pull (and an operator's hold keeps
    # everything): the firewall only plans then. With its table gone nothing filters, and status must say so.
    from plexd.converge.engine import Engine

    ns, pool = netns
    fw = domain_in(pool)
    engine = Engine([fw])
    desired = model(SSH_ONLY, [Peer("n_a", _key(1), "10.100.0.2")])
    await engine.converge(desired)
    assert fw.enforcement == "enforced"
    nft(ns, "delete", "table", "inet", "plexd")
    kept = await engine.converge(desired, Mode.KEPT)
    assert kept.mode is Mode.KEPT and "plexd" not in nft(ns, "list", "tables")  # planned, not applied
    assert fw.enforcement == "degraded" and "nothing filters the mesh" in fw.reason and "only planned" in fw.reason
    # the access sessions fail closed on this (a table in place but not current would not count)
    assert fw.unenforced == "firewall: table inet plexd missing"
    await engine.converge(desired)
    assert fw.enforcement == "enforced" and fw.reason == "" and fw.unenforced == ""
    assert [c.split(" ", 1)[1] for c in rules_of(ns, "input")] == ["established", "policy ssh", "default-deny"]


async def test_foreign_tables_are_never_touched(netns):
    ns, pool = netns
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], check=True, text=True, input=(
        "table ip nat {\n chain postrouting {\n  type nat hook postrouting priority srcnat;\n"
        "  oifname \"eth0\" masquerade\n }\n}\n"
        "table inet filter {\n chain input {\n  type filter hook input priority 0; policy accept;\n"
        "  tcp dport 8080 accept\n }\n}\n"))
    before = [o for o in ruleset(ns) if "metainfo" not in o]
    fw = domain_in(pool)
    await converge(fw, model(SSH_ONLY), full=True)
    await converge(fw, model(()), full=True)
    await fw.teardown()
    after = [o for o in ruleset(ns) if "metainfo" not in o]
    assert after == before  # plexd's table came and went; the others are byte for byte what they were


async def test_events_change_one_element_and_the_believed_table_recovers_from_outside_changes(netns):
    ns, pool = netns
    fw = domain_in(pool)
    policies = (Policy("ssh", (PolicyRule("n_a", "n_self", 22, "tcp", "allow"),
                               PolicyRule("n_b", "n_self", 0, "", "allow"))),)
    d0 = model(policies, [Peer("n_a", _key(1), "10.100.0.2")])
    await converge(fw, d0, full=True)
    d1 = d0.with_peer(Peer("n_b", _key(2), "10.100.0.4"))  # n_b joins: its set gets its address
    untouched = fw.want(d0).sets["node_n_a"]
    joined = await converge(fw, d1, full=False, touched=["n_b"])  # a peer event: only n_b's set is looked at
    assert fw.want(d1).sets["node_n_a"] is untouched  # not rebuilt: O(change), not O(rules)
    assert fw.want(d1) == fresh_ruleset(d1)  # and the same table as built whole
    assert [str(c.correction()) for c in joined.changes] == [
        "firewall_set_element_added: firewall: set node_n_b: node n_b address 10.100.0.4 missing"]
    # Someone deletes n_b's element behind our back; the event for n_b leaving must still apply (a retry after
    # reading the table), not fail.
    nft(ns, "delete", "element", "inet", "plexd", "node_n_b", "{ 10.100.0.4 }")
    left = await converge(fw, d1.without_peer("n_b"), full=False, touched=["n_b"])
    assert not left.errors and fw.enforcement == "enforced"
    assert fw.want(d1.without_peer("n_b")) == fresh_ruleset(d1.without_peer("n_b"))
    sets = {o["set"]["name"]: o["set"].get("elem") for o in ruleset(ns) if "set" in o}
    assert "elem" not in sets or sets["node_n_b"] is None

    # A one-rule policy change through the event path: one rule inserted in place, nothing else.
    changed = (Policy("ssh", (PolicyRule("n_a", "n_self", 22, "tcp", "allow"),
                              PolicyRule("n_a", "n_self", 443, "tcp", "allow"),
                              PolicyRule("n_b", "n_self", 0, "", "allow"))),)
    result = await converge(fw, model(changed, [Peer("n_a", _key(1), "10.100.0.2")]), full=False)
    assert [str(c.correction()) for c in result.changes] == [
        "policy_added: policy ssh: chain input: policy ssh rule 1 (allow tcp/443 from n_a to n_self) missing"]
    input_rules = rules_of(ns, "input")
    assert [c.split(" ", 1)[1] for c in input_rules] == [
        "established", "policy ssh", "policy ssh", "policy ssh", "default-deny"]
    assert dports(ns, "input") == [22, 443]  # in policy order: the new rule went in between, the others stayed

    # The new rules' handles were not read back (echoing them costs a whole-table load): taking them away on the
    # event path reads the table first, and the same two lines come out.
    undone = await converge(fw, model(policies, [Peer("n_a", _key(1), "10.100.0.2")]), full=False)
    assert [c.correction_type for c in undone.changes] == ["policy_removed"]
    assert not undone.errors and dports(ns, "input") == [22] and dports(ns, "forward") == []


async def test_log_denied_adds_a_rate_limited_log_rule(netns):
    ns, pool = netns
    fw = domain_in(pool, log_denied=True)
    await converge(fw, model(SSH_ONLY), full=True)
    rules = [o["rule"] for o in ruleset(ns) if "rule" in o and o["rule"]["chain"] == "input"]
    log_rule = next(r for r in rules if r["comment"].endswith("log-denied"))
    kinds = [next(iter(e)) for e in log_rule["expr"]]
    assert kinds == ["match", "limit", "log"]
    assert rules[-1]["comment"].endswith("default-deny")


async def test_enforcement_off_removes_a_leftover_table(netns):
    ns, pool = netns
    await converge(domain_in(pool), model(SSH_ONLY), full=True)
    off = domain_in(pool, enabled=False)
    result = await converge(off, model(SSH_ONLY), full=True)
    assert [c.correction_type for c in result.changes] == ["firewall_table_removed"]
    assert not any("table" in o and o["table"]["name"] == "plexd" for o in ruleset(ns))
    assert off.enforcement == "disabled"


def listing(ns: str) -> list[dict]:
    """The table as nftables lists it, without handles (they differ between two builds of the same table)."""
    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if k != "handle"}
        return [strip(v) for v in o] if isinstance(o, list) else o
    return [strip(o) for o in json.loads(nft(ns, "-j", "list", "table", "inet", "plexd"))["nftables"]
            if "metainfo" not in o]


async def test_the_table_built_as_a_script_is_the_table_built_as_json(netns):
    """Every kind of rule plexd writes, built once as an nft script (how a missing table is created: half the
    time) and once as JSON commands: nftables lists the very same table."""
    ns, pool = netns
    rich = (Policy("mixed", (PolicyRule("n_a", "n_self", 22, "tcp", "allow"),
                             PolicyRule("n_six", "*", 53, "", "allow"),
                             PolicyRule("10.100.7.0/24", "n_self", 0, "icmp", "allow"),
                             PolicyRule("n_six", "n_self", 0, "icmp", "allow"),
                             PolicyRule("n_a", "10.100.9.9/32", 0, "udp", "deny"),
                             PolicyRule("*", "*", 8080, "tcp", "allow"),
                             PolicyRule("n_gone", "n_self", 0, "", "allow"))),
            Policy("web;db #1", (PolicyRule("*", "n_self", 443, "tcp", "allow"),)))
    peers = [Peer("n_a", _key(1), "10.100.0.2"), Peer("n_six", _key(2), "fd00::6")]
    fw = domain_in(pool, log_denied=True)
    desired = model(rich, peers).with_session(Session("ses_ssh", "ssh", SshTarget("deploy"), 4e9)).with_session(
        Session("ses_web", "tcp", TcpTarget("127.0.0.1", 8080), 4e9))  # rules matching the listeners' marks
    assert sum("socket" in r.expr_json for r in fw.want(desired).chains["input"].rules) == 4
    change = fwplan.diff(fw.want(desired), None)
    assert len(change) == 1 and change[0].script()  # renders: no fallback to JSON for any of these

    built = await converge(fw, desired, full=True)
    assert [c.correction_type for c in built.changes] == ["firewall_table_added"] and not built.errors
    as_script = listing(ns)
    nft(ns, "delete", "table", "inet", "plexd")
    await asyncio.get_running_loop().run_in_executor(pool, fw.nft.run, change[0].commands())
    assert listing(ns) == as_script
    assert (await converge(fw, desired, full=True)).changes == ()  # and the diff finds nothing to do


def test_a_string_the_script_cannot_hold_falls_back_to_json():
    from plexd.firewall.script import Unrenderable, table_script

    compiled = compile_policies(SSH_ONLY, "n_self", ("10.100.0.1",))
    rs = desired_ruleset(compiled, 'pl"x0', {"n_a": "10.100.0.2", "n_self": "10.100.0.1"}, False)
    with pytest.raises(Unrenderable, match="pl"):
        table_script(rs, rebuilt=False)


async def test_a_policy_planned_during_a_hold_is_applied_by_the_next_event_not_skipped(netns):
    # The hold plans P2 without applying it; the event path must compare with what the table holds (P1), not with
    # what was last planned, or P2's revoked port stays open until the next full reconcile.
    from plexd.converge.engine import Engine

    ns, pool = netns
    engine = Engine([domain_in(pool)])
    peer = Peer("n_a", _key(1), "10.100.0.2")
    p1 = (Policy("ssh", (PolicyRule("n_a", "n_self", 22, "tcp", "allow"),
                         PolicyRule("n_a", "n_self", 443, "tcp", "allow"))),)
    await engine.converge(model(p1, [peer]))
    assert dports(ns, "input") == [22, 443]
    p2 = model(SSH_ONLY, [peer])
    # while held (the gate's decision: plexd.converge.gate)
    assert (await engine.converge(p2, Mode.HELD)).mode is Mode.HELD and dports(ns, "input") == [22, 443]
    moved = p2.with_peer(Peer("n_a", _key(1), "10.100.0.2", "192.0.2.9:51820"))  # a peer event, same address
    result = await engine.apply_delta(moved, ["n_a"])
    assert not result.errors and dports(ns, "input") == [22]


async def test_a_rule_plexd_re_makes_is_learned_again_so_nothing_churns(netns):
    # A table altered before this process started is learned as it is (a limit: nothing tells which listing is
    # the true one). Once plexd re-makes that rule, the rule it wrote is what is learned: no delete-and-insert at
    # every converge after.
    ns, pool = netns
    desired = model(SSH_ONLY, [Peer("n_a", _key(1), "10.100.0.2")])
    await converge(domain_in(pool), desired, full=True)
    deny = next(o["rule"] for o in ruleset(ns) if "rule" in o and o["rule"]["chain"] == "input"
                and o["rule"].get("comment", "").endswith(" default-deny"))
    nft(ns, "replace", "rule", "inet", "plexd", "input", "handle", str(deny["handle"]), "counter", "accept",
        "comment", f'"{deny["comment"]}"')
    restarted = domain_in(pool)
    assert (await converge(restarted, desired, full=True)).changes == ()  # learned as found (the limit)
    altered = next(o["rule"] for o in ruleset(ns) if "rule" in o and o["rule"].get("comment") == deny["comment"])
    nft(ns, "delete", "rule", "inet", "plexd", "input", "handle", str(altered["handle"]))
    remade = await converge(restarted, desired, full=True)
    assert [c.correction_type for c in remade.changes] == ["firewall_rule_added"]
    for _ in range(3):
        assert (await converge(restarted, desired, full=True)).changes == ()


async def test_after_a_rebuild_the_event_path_never_deletes_by_a_handle_of_the_old_table(netns):
    # A rebuild numbers the rules afresh; believing the old handles, an event revoking 443 deleted port 80's rule.
    ns, pool = netns
    fw = domain_in(pool)
    peer = Peer("n_a", _key(1), "10.100.0.2")
    ports = lambda *p: (Policy("web", tuple(PolicyRule("n_a", "n_self", x, "tcp", "allow") for x in p)),)  # noqa: E731
    await converge(fw, model(ports(22, 443), [peer]), full=True)
    # Port 80's rule added in the middle later: the highest handle, where a rebuilt table numbers it in order
    # (and gives 443's old handle to 80).
    await converge(fw, model(ports(22, 80, 443), [peer]), full=True)
    assert dports(ns, "input") == [22, 80, 443]
    nft(ns, "add", "chain", "inet", "plexd", "intruder")
    nft(ns, "insert", "rule", "inet", "plexd", "input", "jump", "intruder")
    rebuilt = await converge(fw, model(ports(22, 80, 443), [peer]), full=True)
    assert [c.correction_type for c in rebuilt.changes] == ["firewall_table_rebuilt"]
    result = await converge(fw, model(ports(22, 80), [peer]), full=False)  # an event: 443 revoked
    assert not result.errors and dports(ns, "input") == [22, 80]


async def test_a_failed_correction_of_an_altered_rule_is_retried_not_forgotten(netns, monkeypatch):
    from plexd.machine.nft import FirewallError

    ns, pool = netns
    fw = domain_in(pool)
    desired = model(SSH_ONLY, [Peer("n_a", _key(1), "10.100.0.2")])
    await converge(fw, desired, full=True)
    assert (await converge(fw, desired, full=True)).changes == ()  # a reconcile read what plexd wrote
    deny = next(o["rule"] for o in ruleset(ns) if "rule" in o and o["rule"]["chain"] == "input"
                and o["rule"].get("comment", "").endswith(" default-deny"))
    nft(ns, "replace", "rule", "inet", "plexd", "input", "handle", str(deny["handle"]), "counter", "accept",
        "comment", f'"{deny["comment"]}"')
    write = fw._write

    async def fails_once(*args):
        monkeypatch.setattr(fw, "_write", write)
        raise FirewallError("a transient refusal")

    monkeypatch.setattr(fw, "_write", fails_once)
    failed = await converge(fw, desired, full=True)
    assert failed.errors and fw.enforcement == "degraded"
    assert fw.unenforced == ""  # the table is there, its default deny too: sessions stay open
    retried = await converge(fw, desired, full=True)
    assert sorted(c.correction_type for c in retried.changes) == ["firewall_rule_added", "firewall_rule_removed"]
    verdict = [k for o in ruleset(ns) if "rule" in o and o["rule"].get("comment") == deny["comment"]
               for e in o["rule"]["expr"] for k in e if k in ("accept", "drop", "reject")]
    assert verdict and "accept" not in verdict and fw.enforcement == "enforced"


async def test_a_table_flushed_during_a_hold_is_not_called_enforced_by_the_next_event(netns):
    from plexd.converge.engine import Engine

    ns, pool = netns
    fw = domain_in(pool)
    engine = Engine([fw])
    peer = Peer("n_a", _key(1), "10.100.0.2")
    desired = model(SSH_ONLY, [peer])
    await engine.converge(desired)
    nft(ns, "flush", "ruleset")
    await engine.converge(desired, Mode.HELD)  # while held (the gate's decision: plexd.converge.gate)
    assert fw.enforcement == "degraded"
    moved = desired.with_peer(Peer("n_a", _key(1), "10.100.0.2", "192.0.2.9:51820"))  # no set changes
    await engine.apply_delta(moved, ["n_a"])
    assert "plexd" in nft(ns, "list", "tables") and fw.enforcement == "enforced"
