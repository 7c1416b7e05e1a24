"""The mesh end to end, as the issue asks it to be shown: real devplane on the lab bridge, real `plexd up` in
network namespaces with real wireguard-go, checked with the real `wg show` and `ping`.

1. Three nodes register and ping each other over the mesh; `wg show` in each lists exactly the two others, and
   `plexd peers --json` in each names them.
2. A fourth node joins and the others configure it within one (short) reconcile interval.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from lab_daemon import mesh_lab
from waiting import scaled

from plexd.devplane.lab import MeshLab

RECONCILE_S = 3


@pytest.fixture
def mesh():
    with mesh_lab(3, reconcile=f"{RECONCILE_S}s", heartbeat="2s") as both:
        yield both


def keys_of(mesh: MeshLab) -> dict[str, str]:
    """public key -> node name, as the devplane knows them."""
    assert mesh.admin is not None
    by_id = {d.node_id: d.node.name for d in mesh.daemons}
    return {n["public_key"]: by_id[n["id"]] for n in mesh.admin.nodes() if n["id"] in by_id}


def test_three_nodes_ping_each_other_and_list_exactly_the_others(mesh) -> None:
    lab, m = mesh
    for node in lab.nodes:
        m.start_node(node)
    m.wait(lambda: all(d.node_id for d in m.daemons), 30, "registration")
    m.wait(m.full_handshake_matrix, 30, "a handshake between every pair")

    names = keys_of(m)
    assert len(names) == 3
    for d in m.daemons:
        listed = {names[k] for k in m.wg_dump(d.node)}
        assert listed == {x.node.name for x in m.daemons} - {d.node.name}, d.node.name

    matrix = m.ping_matrix(count=3, wait=5)
    assert len(matrix) == 6 and all(matrix.values()), matrix

    # the operator's view: plexd peers --json inside node1 names both others with their mesh IPs
    d1 = m.daemons[0]
    res = m.run_plexd(d1, "peers", "--json")
    peers = json.loads(res.stdout)
    assert {p["id"] for p in peers} == {m.daemons[1].node_id, m.daemons[2].node_id}
    assert {p["mesh_ip"] for p in peers} == {m.daemons[1].mesh_ip, m.daemons[2].mesh_ip}
    assert all(p["latest_handshake_age_seconds"] is not None and p["rx_bytes"] > 0 for p in peers)
    table = m.run_plexd(d1, "peers").stdout
    assert table.splitlines()[0].split()[:3] == ["PEER", "MESH", "IP"] and m.daemons[1].node_id in table


def test_a_fourth_node_is_configured_everywhere_within_one_reconcile_interval(mesh) -> None:
    lab, m = mesh
    for node in lab.nodes:
        m.start_node(node)
    m.wait(lambda: all(d.node_id for d in m.daemons), 30, "registration")
    m.wait(m.full_handshake_matrix, 30, "the first three to handshake")

    fourth = m.start_node(lab.add_node())
    m.wait(lambda: fourth.node_id is not None, 30, "the fourth node to register")
    key = next(k for k, name in keys_of(m).items() if name == fourth.node.name)
    m.wait(lambda: all(key in m.wg_dump(d.node) for d in m.daemons[:3]), scaled(RECONCILE_S + 2),
           "the others to configure the fourth node")
    m.wait(m.full_handshake_matrix, 15, "a handshake between all four")
    assert all(m.ping_matrix(count=2, wait=5).values())
    # nothing but the lab's own processes ran: the namespace names are the lab's
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(f"px{lab.tag}")]
    assert sorted(names) == sorted([*(d.node.netns for d in m.daemons), lab.switch_netns])
