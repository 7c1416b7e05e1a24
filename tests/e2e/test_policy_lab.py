"""Policy enforcement in a real mesh: three `plexd up` nodes, real nftables in each namespace, real listeners.

The devplane is told to send every node every other node (`ignore_visibility`), so that hiding a peer is the
node's own doing, not the control plane's. Flows are checked with real TCP connections and ping; the table with
`nft -j list`; drift with the reports the devplane received.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from lab_daemon import Daemon, connects, ping_count, publish_endpoints, start_mesh, wait_until, wg_peers

from plexd.devplane.demo import LISTENER as LISTEN


def nft_json(lab, node, *what: str) -> list[dict]:
    out = lab.exec(node, ["nft", "-j", "list", *what], check=False)
    return json.loads(out.stdout)["nftables"] if out.returncode == 0 else []


def plexd_rules(lab, node, chain: str) -> list[dict]:
    return [o["rule"] for o in nft_json(lab, node, "ruleset")
            if "rule" in o and o["rule"]["table"] == "plexd" and o["rule"]["chain"] == chain]


def foreign(lab, node) -> list[dict]:
    """Every table, chain and rule that is not plexd's, as nft prints them (handles and counters included)."""
    out = []
    for o in nft_json(lab, node, "ruleset"):
        kind, body = next(iter(o.items()))
        if kind != "metainfo" and (body["name"] if kind == "table" else body.get("table")) != "plexd":
            out.append(o)
    return out


def drift_lines(dp, node_id: str) -> list[str]:
    return [f"{c['type']}: {c['detail']}" for r in dp.admin.drift(node_id) for c in r["corrections"]]


@pytest.mark.parametrize("lab_dp", [3], indirect=True)
def test_a_policy_filters_flows_hides_peers_and_survives_flushes(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    start_mesh(lab, dp, daemons, tmp_path, reconcile="10m")
    a, b, c = daemons
    publish_endpoints(dp, daemons)
    wait_until(lambda: ping_count(lab, a.node, b.mesh_ip(), 1, 0.2) == 1, 20, "a first ping a -> b", daemons)
    keys = {d.node_id(): dp.admin.node(d.node_id())["public_key"] for d in daemons}
    listener = lab.spawn(b.node.wrap([sys.executable, "-c", LISTEN]))
    try:
        wait_until(lambda: connects(lab, a.node, b.mesh_ip(), 80), 10, "the listener (allow-all policy)", daemons)

        # Only tcp/22 from a to b. The devplane sends every peer anyway: hiding is the nodes' job.
        dp.admin.set_faults(ignore_visibility=True)
        dp.admin.set_policies([{"id": "ssh", "rules": [
            {"src": a.node_id(), "dst": b.node_id(), "port": 22, "protocol": "tcp", "action": "allow"}]}])
        wait_until(lambda: set(wg_peers(lab, c.node)) == set(), 15, "c to drop every peer", daemons)
        wait_until(lambda: set(wg_peers(lab, b.node)) == {keys[a.node_id()]}, 15, "b to keep only a", daemons)
        wait_until(lambda: set(wg_peers(lab, a.node)) == {keys[b.node_id()]}, 15, "a to keep only b", daemons)
        wait_until(lambda: len(plexd_rules(lab, b.node, "input")) == 3, 10, "b's input chain", daemons)
        assert connects(lab, a.node, b.mesh_ip(), 22)
        dropped_before = plexd_rules(lab, b.node, "input")[-1]["expr"][1]["counter"]["packets"]
        assert not connects(lab, a.node, b.mesh_ip(), 80)  # to b's own mesh address: the input chain drops it
        assert ping_count(lab, a.node, b.mesh_ip(), 2, 0.2) == 0
        dropped_after = plexd_rules(lab, b.node, "input")[-1]["expr"][1]["counter"]["packets"]
        assert dropped_after > dropped_before

        # plexd policies shows the rule with its counter, and who is visible.
        doc = json.loads(b.cli("policies", "--json").stdout)
        assert doc["enforcement"] == "enforced" and doc["visible_peers"] == [a.node_id()]
        assert doc["hidden_peers"] == [c.node_id()]
        [rule] = doc["policies"][0]["rules"]
        assert rule["rule"] == f"allow tcp/22 from {a.node_id()} to {b.node_id()}"
        assert rule["chains"]["input"]["packets"] >= 1
        assert "policy:         enforced" in b.cli("status").stdout

        # A policy change takes effect through policy_updated, long before the 10 min reconcile.
        started = time.monotonic()
        dp.admin.set_policies([{"id": "ssh", "rules": [
            {"src": a.node_id(), "dst": b.node_id(), "port": 22, "protocol": "tcp", "action": "allow"},
            {"src": a.node_id(), "dst": b.node_id(), "port": 80, "protocol": "tcp", "action": "allow"}]}])
        wait_until(lambda: connects(lab, a.node, b.mesh_ip(), 80), 15, "tcp/80 allowed by policy_updated", daemons)
        assert time.monotonic() - started < 15

        # Drift: each kind of damage restored by the next converge and named in a drift report.
        b_id = b.node_id()

        def repaired(damage: list[str], line: str) -> None:
            seen = sum(line in x for x in drift_lines(dp, b_id))
            lab.exec(b.node, damage)
            b.cli("reconcile", "--once")
            wait_until(lambda: sum(line in x for x in drift_lines(dp, b_id)) > seen, 10, f"a drift report: {line}",
                       daemons)
            assert connects(lab, a.node, b.mesh_ip(), 22) and not connects(lab, c.node, b.mesh_ip(), 22)
            assert len(plexd_rules(lab, b.node, "input")) == 4

        repaired(["nft", "flush", "ruleset"], "firewall_table_added: firewall: table inet plexd missing")
        docker_like = ("table ip nat {\n chain POSTROUTING {\n  type nat hook postrouting priority srcnat;\n"
                       "  oifname \"eth0\" masquerade\n }\n}\n"
                       "table inet filter {\n chain input {\n  type filter hook input priority 0; policy accept;\n"
                       "  tcp dport 8080 counter accept\n }\n}\n")
        subprocess.run(b.node.wrap(["nft", "-f", "-"]), input=docker_like, text=True, check=True)
        foreign_before = foreign(lab, b.node)
        assert len(foreign_before) >= 4
        repaired(["nft", "delete", "table", "inet", "plexd"], "firewall_table_added")
        handle = str(plexd_rules(lab, b.node, "input")[1]["handle"])
        repaired(["nft", "delete", "rule", "inet", "plexd", "input", "handle", handle], "policy_added: policy ssh")
        sets = [o["set"] for o in nft_json(lab, b.node, "table", "inet", "plexd") if "set" in o]
        a_set = next(s for s in sets if s.get("elem") == [a.mesh_ip()])
        repaired(["nft", "delete", "element", "inet", "plexd", a_set["name"], "{ " + a.mesh_ip() + " }"],
                 f"firewall_set_element_added: firewall: set {a_set['name']}")
        assert foreign(lab, b.node) == foreign_before  # docker's nat and the foreign filter table untouched
    finally:
        listener.kill()
        listener.wait(5)
        dp.admin.clear_faults()


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_bad_rules_are_skipped_by_name_and_the_rest_applies(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    start_mesh(lab, dp, daemons, tmp_path, reconcile="10m", count=2)
    a, b = daemons
    dp.admin.set_policies([{"id": "mixed", "rules": [
        {"src": a.node_id(), "dst": b.node_id(), "protocol": "sctp", "action": "allow"},
        {"src": a.node_id(), "dst": b.node_id(), "port": 99999, "protocol": "tcp", "action": "allow"},
        {"src": "192.168.1.0/24", "dst": "*", "action": "allow"},
        {"src": a.node_id(), "dst": b.node_id(), "port": "22", "action": "allow"},
        {"src": "*", "dst": "*", "protocol": "icmp", "action": "allow"}]}, "garbage"], unchecked=True)
    wait_until(lambda: len(json.loads(b.cli("policies", "--json").stdout)["skipped"]) == 5, 15,
               "the bad rules to be skipped", daemons)
    doc = json.loads(b.cli("policies", "--json").stdout)
    assert doc["skipped"][0] == "policy mixed rule 0: unknown protocol 'sctp' (tcp, udp, icmp or \"\" for any)"
    assert doc["skipped"][2] == "policy mixed rule 2: src 192.168.1.0/24 is outside the mesh range 10.100.0.0/16"
    assert doc["policies"] == [{"id": "mixed", "rules": [
        {"index": 4, "rule": "allow icmp from * to *", "chains": doc["policies"][0]["rules"][0]["chains"]}]}]
    publish_endpoints(dp, daemons)
    wait_until(lambda: ping_count(lab, a.node, b.mesh_ip(), 1, 0.2) == 1, 15, "icmp allowed by the good rule", daemons)
    logged = b.logged()
    assert "policy rule skipped: policy mixed rule 1: port 99999 is out of range" in logged
    assert "Traceback" not in logged and b.proc.poll() is None
    # Reported to the control plane with the next cycle's drift report: it is the control plane's to fix.
    b.cli("reconcile", "--once")
    wait_until(lambda: any(x.startswith("policy_rule_rejected: policy mixed rule 3: ")
                           for x in drift_lines(dp, b.node_id())), 10, "the refused rules reported", daemons)


def test_daemon_shutdown_with_deregistration_removes_the_table(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, reconcile="10m")
    daemons.append(d)
    wait_until(lambda: any("table" in o and o["table"]["name"] == "plexd" for o in nft_json(lab, d.node, "tables")),
               20, "the table", daemons)
    d.stop()
    assert not any("table" in o and o["table"]["name"] == "plexd" for o in nft_json(lab, d.node, "tables"))
