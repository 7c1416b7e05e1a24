"""NAT traversal end to end (issue 13), in the coturn lab of docs/test-environment.md §4: real coturn on two addresses,
real nft masquerade routers in their own namespaces, real `plexd up` behind them, checked with `wg show`, `ping` and
what the devplane received.

1. Two nodes, each behind its own router: each discovers its router's address (not its private one), reports it,
   gets the other's from the devplane, and the two handshake through both NATs and ping.
   Then one router is renumbered (its mappings go, as with a new ISP lease): the change is found within one
   refresh, reported, pushed to the other node, and the tunnel comes back. Then that router switches to
   `masquerade fully-random`, and the node classifies its NAT as symmetric.
2. The STUN servers are unreachable when the node starts: it joins with its local endpoint, says so once, keeps
   retrying, and reports the mapping once coturn is up.
"""

from __future__ import annotations

import json
import time

import pytest
from lab_daemon import mesh_lab

from plexd.devplane.lab import Lab, MeshLab

pytestmark = pytest.mark.root

REFRESH_S = 10  # the smallest nat_traversal.refresh_interval plexd accepts
NAT = f", refresh_interval: {REFRESH_S}s, stun_timeout: 2s"


@pytest.fixture
def lab_mesh():
    with mesh_lab(0, reconcile="60s", heartbeat="2s") as both:
        yield both


def reported(m: MeshLab, node_id: str) -> tuple[str, str]:
    node = m.admin.node(node_id)
    return node["endpoint"], node["nat_type"]


def status(m: MeshLab, d) -> dict:
    return json.loads(m.run_plexd(d, "status", "--json").stdout)


def peer_view(m: MeshLab, d, key: str) -> dict:
    return m.wg_dump(d.node).get(key, {})


def pings(lab: Lab, d, ip: str, count: int = 2) -> bool:
    return lab.exec(d.node, ["ping", "-c", str(count), "-W", "2", "-q", ip], check=False).returncode == 0


def test_two_nodes_behind_two_nats_find_each_other_and_follow_a_mapping_change(lab_mesh) -> None:
    lab, m = lab_mesh
    stun = lab.start_stun()
    r1, r2 = lab.add_router(), lab.add_router()
    n1, n2 = lab.add_node(behind=r1), lab.add_node(behind=r2)
    d1 = m.start_node(n1, stun=[f"{stun[0]}:3478", stun[1]], nat_extra=NAT)
    d2 = m.start_node(n2, stun=[f"{stun[0]}:3478", stun[1]], nat_extra=NAT)
    m.wait(lambda: d1.node_id and d2.node_id, 30, "registration")

    # Each node reports its router's public address, with the port its router preserved, as full cone.
    m.wait(lambda: reported(m, d1.node_id) == (f"{r1.public}:51820", "full_cone")
           and reported(m, d2.node_id) == (f"{r2.public}:51820", "full_cone"), 30, "both endpoint reports")
    key1, key2 = m.admin.node(d1.node_id)["public_key"], m.admin.node(d2.node_id)["public_key"]
    # ... the devplane hands each to the other, and they handshake through both NATs
    m.wait(lambda: peer_view(m, d1, key2).get("endpoint") == f"{r2.public}:51820"
           and peer_view(m, d2, key1).get("endpoint") == f"{r1.public}:51820", 30, "endpoints exchanged")
    m.wait(lambda: peer_view(m, d1, key2).get("latest_handshake", 0) > 0, 30, "a handshake through both NATs")
    assert pings(lab, d1, d2.mesh_ip) and pings(lab, d2, d1.mesh_ip)
    st = status(m, d1)["nat"]
    assert (st["public_endpoint"], st["nat_type"], st["local_endpoint"]) == (
        f"{r1.public}:51820", "full_cone", f"{n1.address}:51820")
    assert st["last_success_at"] and not st["last_error"]
    text = m.run_plexd(d1, "status").stdout
    assert f"nat:            public endpoint {r1.public}:51820 (full_cone), discovered " in text, text
    assert f"s ago via {stun[0]}:3478" in text, text
    # the heartbeats after the endpoint report was answered carry what the control plane was told
    m.wait(lambda: m.admin.heartbeats(d1.node_id)[-1].get("nat") == {"public_endpoint": f"{r1.public}:51820",
                                                                     "type": "full_cone"}, 10, "a heartbeat's nat")

    # Router 1 gets a new public address: its mappings are gone and the tunnel breaks until node1 finds out.
    changed_at = time.monotonic()
    new_public = lab.renumber_router(r1, 150)
    m.wait(lambda: reported(m, d1.node_id)[0] == f"{new_public}:51820", REFRESH_S + 8, "the new mapping reported")
    detected = time.monotonic() - changed_at
    m.wait(lambda: peer_view(m, d2, key1).get("endpoint") == f"{new_public}:51820", 10, "node2 told")
    m.wait(lambda: pings(lab, d2, d1.mesh_ip, 1), 30, "the tunnel back through the new mapping")
    print(f"mapping change detected and reported in {detected:.1f}s; tunnel back "
          f"{time.monotonic() - changed_at:.1f}s after the change")
    assert detected <= REFRESH_S + 8

    # A port-randomising router: every destination gets its own mapping, which node1 classifies as symmetric.
    lab.set_router_nat(r1, "masquerade fully-random")
    lab.renumber_router(r1, 151)  # a new address also drops the mappings masquerade made before
    m.wait(lambda: reported(m, d1.node_id)[1] == "symmetric", REFRESH_S + 8, "the symmetric NAT classified")
    assert status(m, d1)["nat"]["nat_type"] == "symmetric"
    for d in (d1, d2):
        assert d.proc.poll() is None, d.log_tail()


def test_unreachable_stun_at_start_joins_with_the_local_endpoint_and_reports_the_mapping_later(lab_mesh) -> None:
    lab, m = lab_mesh
    router = lab.add_router()
    behind, public = lab.add_node(behind=router), lab.add_node()
    net = lab.subnet.rsplit(".", 1)[0]
    servers = [f"{net}.2", f"{net}.3:3478"]  # the addresses start_stun() will bring up, silent for now
    d1 = m.start_node(behind, stun=servers, nat_extra=NAT)
    d2 = m.start_node(public)  # on the bridge; the lab reports its endpoint
    m.wait(lambda: d1.node_id and d2.node_id, 30, "registration")

    # It joined: the local endpoint reported (type unknown), and a tunnel to the public node (it initiates).
    m.wait(lambda: reported(m, d1.node_id) == (f"{behind.address}:51820", "unknown"), 30, "the local endpoint")
    key2 = m.admin.node(d2.node_id)["public_key"]
    m.wait(lambda: peer_view(m, d1, key2).get("latest_handshake", 0) > 0, 30, "a handshake without STUN")
    m.wait(lambda: status(m, d1)["nat"]["consecutive_failures"] >= 2, 40, "two failed attempts")
    st = status(m, d1)["nat"]
    assert st["public_endpoint"] == "" and "no answer within 2s" in st["last_error"], st

    lab.start_stun()
    m.wait(lambda: reported(m, d1.node_id) == (f"{router.public}:51820", "full_cone"), REFRESH_S + 15,
           "the mapping reported once coturn answers")
    log = d1.log_tail(200_000)
    assert log.count("NAT discovery failed") == 1, log[-3000:]  # once per failure streak, however many retries
    assert f"STUN server {servers[0]}:3478: no answer within" in log  # logged with the server
    assert "NAT discovery works again" in log
    assert d1.proc.poll() is None
