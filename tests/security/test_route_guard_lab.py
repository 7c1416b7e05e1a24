"""A compromised control plane asks a running `plexd up` to route what would hijack the node's traffic
(real devplane, real wireguard-go, real namespaces, routes read back with `ip`): the DNS resolver, a default
gateway, the cloud metadata service, the node's LAN, the control plane, a default route in halves and in
sixteen /4s. Each prefix is refused by name in the log and reported as a rejected change in the next drift
report, the rest of the peer applies, nothing refused reaches any routing table, and the daemon keeps running.

Mesh routes live in a table of their own: a peer's route for a prefix the main table already routes goes into
the mesh table and leaves the main-table route as it was, and a route put into the main table by hand via the
mesh interface is moved (reported as `route_moved`).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import shutil
from pathlib import Path

from lab_daemon import Daemon, wait_until

from plexd.machine.links import DEFAULT_RULE_PRIORITY, DEFAULT_TABLE

RESOLVER = "198.18.0.53"  # a benchmark-range address: in no LAN of the lab, so only the resolver guard names it
ROUTED_ELSEWHERE = "198.18.50.0/24"  # the main table routes it via the gateway; a peer may still claim it
SECOND_GATEWAY = "198.18.9.1"  # a second, on-link default gateway outside the LAN (the first is the devplane's)


def routes(lab, node) -> list[dict]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "table", "all"]).stdout
    return json.loads(out)


def key(seed: bytes) -> str:
    return base64.b64encode(seed * 32).decode()


def test_routes_that_would_hijack_the_node_are_refused_and_reported(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    node = lab.nodes[0]
    netns_etc = Path("/etc/netns") / node.netns  # `ip netns exec` mounts it over /etc: the node's own resolver
    netns_etc.mkdir(parents=True)
    try:
        (netns_etc / "resolv.conf").write_text(f"nameserver {RESOLVER}\n")
        lab.exec(node, ["ip", "route", "add", ROUTED_ELSEWHERE, "via", lab.bridge_address])
        lab.exec(node, ["ip", "route", "add", "default", "via", SECOND_GATEWAY, "dev", "eth0", "onlink",
                        "metric", "500"])
        a = Daemon(lab, node, dp, tmp_path, reconcile="2s")
        daemons.append(a)
        wait_until(lambda: a.mesh_ip(), 30, "registration", daemons)
        node_id = a.node_id()
        lan = ipaddress.ip_network(f"{node.address}/24", strict=False)
        lan_part = str(list(lan.subnets(new_prefix=26))[2])  # holds neither the node, the gateway nor the devplane
        asks = {
            "n_resolver": ["198.18.0.0/24"],
            "n_metadata": ["169.254.169.254/32"],
            "n_gateway": ["198.18.9.0/24"],
            "n_lan": [lan_part],
            "n_cp": [f"{lab.bridge_address}/32"],
            "n_halves": ["0.0.0.0/1", "128.0.0.0/1"],
            "n_quarters": [f"{16 * i}.0.0.0/4" for i in range(16)],
            "n_fine": [ROUTED_ELSEWHERE],
        }
        # the state a compromised control plane serves (its GET /state body; events would say the same)
        peers = [{"id": pid, "public_key": key(bytes([65 + i])), "mesh_ip": f"10.100.201.{i + 1}", "endpoint": "",
                  "allowed_ips": [f"10.100.201.{i + 1}/32", *prefixes], "psk": ""}
                 for i, (pid, prefixes) in enumerate(asks.items())]
        dp.admin.set_faults(state_body=json.dumps({"peers": peers, "policies": dp.admin.policies()}))
        # a state changed without an event: a connected node pulls it when asked (or within reconcile.pull_interval)
        dp.admin.request_heartbeat_flags(node_id, reconcile=True)
        refused = {(pid, p) for pid, ps in asks.items() if pid != "n_fine" for p in ps}

        def reported() -> dict[tuple[str, str], str]:
            found = {}
            for report in dp.admin.drift(node_id):
                for c in report["corrections"]:
                    if c["type"] == "allowed_ip_rejected":
                        pid, _, rest = c["detail"].removeprefix("peer ").partition(": ")
                        prefix, _, why = rest.partition(" ")
                        found[(pid, prefix)] = why
            return found

        wait_until(lambda: refused <= set(reported()), 30, "every refusal in a drift report", daemons,
                   evidence=lambda: f"reported: {sorted(reported())}")
        why = reported()
        assert f"the DNS resolver {RESOLVER}" in why[("n_resolver", "198.18.0.0/24")]
        assert "cloud metadata service 169.254.169.254" in why[("n_metadata", "169.254.169.254/32")]
        assert f"the default gateway {SECOND_GATEWAY}" in why[("n_gateway", "198.18.9.0/24")]
        assert f"this node's LAN {lan}" in why[("n_lan", lan_part)]
        assert "the control plane" in why[("n_cp", f"{lab.bridge_address}/32")]
        assert all(w for (pid, _), w in why.items() if pid in ("n_halves", "n_quarters"))
        assert ("n_fine", ROUTED_ELSEWHERE) not in why
        log = a.logged()
        assert "allowed IP 169.254.169.254/32 refused: overlaps the cloud metadata service" in log

        # the rest of each peer applies: every mesh address is routed, in the mesh table
        def mesh_table() -> set[str]:
            return {str(ipaddress.ip_network(r["dst"])) for r in routes(lab, node)
                    if r.get("table") == str(DEFAULT_TABLE) and r.get("dev") == "plexd0"}

        wanted = {f"10.100.201.{i + 1}/32" for i in range(len(asks))}
        wait_until(lambda: ROUTED_ELSEWHERE in mesh_table() and all(
            any(ipaddress.ip_network(w).subnet_of(ipaddress.ip_network(r)) for r in mesh_table()) for w in wanted),
            20, "the accepted routes in the mesh table", daemons, evidence=lambda: f"mesh table: {mesh_table()}")
        everything = routes(lab, node)
        via_mesh = [ipaddress.ip_network(r["dst"]) for r in everything
                    if r.get("dev") == "plexd0" and r.get("type", "unicast") == "unicast"]
        for _, prefix in refused:  # neither the prefix nor anything covering it is routed into the tunnel
            net = ipaddress.ip_network(prefix)
            assert not any(n.version == net.version and net.subnet_of(n) for n in via_mesh), \
                f"{prefix} reached a routing table: {via_mesh}"
        # the main table's own route for the prefix a peer also claimed is untouched (no `route replace` there)
        main = [r for r in everything if r["dst"] == ROUTED_ELSEWHERE and "table" not in r]
        assert main and main[0].get("gateway") == lab.bridge_address, everything
        rules = lab.exec(node, ["ip", "rule", "show"]).stdout
        assert f"{DEFAULT_RULE_PRIORITY}:\tfrom all lookup {DEFAULT_TABLE}" in rules, rules

        # a route via the mesh interface put into the main table by hand is moved to the mesh table
        lab.exec(node, ["ip", "route", "add", "10.100.201.99/32", "dev", "plexd0"])

        def moved() -> bool:
            return any(c["type"] == "route_moved" and "10.100.201.99/32" in c["detail"]
                       for r in dp.admin.drift(node_id) for c in r["corrections"])

        wait_until(moved, 20, "the main-table route reported as moved", daemons)
        main_via_mesh = [r for r in routes(lab, node)
                         if "table" not in r and r.get("dev") == "plexd0" and r.get("protocol") != "kernel"]
        assert main_via_mesh == [], main_via_mesh
        assert a.proc.poll() is None and "Traceback" not in a.logged()
    finally:
        shutil.rmtree(netns_etc, ignore_errors=True)
