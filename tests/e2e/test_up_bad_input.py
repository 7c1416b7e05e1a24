"""`plexd up` keeps running through the issue's bad input (real devplane, real wireguard-go, namespaces).

Four daemons, three of them with a broken machine, plus a control-plane-only node whose endpoint is garbage:
node1's listen port is taken (UAPI errno), node3 has no userspace WireGuard binary, node4's interface name is
taken by a bridge. Each says so in one clear log line naming the setting or peer, every daemon keeps running,
the invalid peer is skipped (and named) and every valid peer is configured; `plexd peers --json` shows them.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import httpx
import pytest
from lab_daemon import mesh_lab
from nacl.public import PrivateKey
from waiting import scaled

from plexd.devplane.lab import MeshLab

HOLD_PORT = ("import socket, sys\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.bind(('0.0.0.0', 51820))\n"
             "print('bound', flush=True)\nsys.stdin.read()\n")
NO_WG = "/nonexistent/px-no-wireguard-go"


@pytest.fixture
def mesh():
    with mesh_lab(4, reconcile="2s", heartbeat="2s") as both:
        yield both


def register_ghost(m: MeshLab) -> str:
    """A node only the control plane knows, with an endpoint no WireGuard can use."""
    token = m.admin.create_token()
    pub = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
    r = httpx.post(f"{m.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                   json={"token": token, "public_key": pub, "hostname": "ghost"}, timeout=10)
    r.raise_for_status()
    node_id = r.json()["node_id"]
    m.admin.set_node_endpoint(node_id, "not an endpoint")
    return node_id


def test_bad_input_is_logged_and_every_daemon_keeps_running(mesh) -> None:
    lab, m = mesh
    n1, n2, n3, n4 = lab.nodes
    holder = lab.spawn(["ip", "netns", "exec", n1.netns, sys.executable, "-c", HOLD_PORT],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "bound"
    lab.exec(n4, ["ip", "link", "add", "plexd0", "type", "bridge"])
    ghost = register_ghost(m)
    d1, d2 = m.start_node(n1), m.start_node(n2)
    d3 = m.start_node(n3, mesh_extra=f", userspace_implementation: {NO_WG}")
    d4 = m.start_node(n4)
    daemons = (d1, d2, d3, d4)
    m.wait(lambda: all(d.node_id for d in daemons), 30, "registration")
    keys = {n["id"]: n["public_key"] for n in m.admin.nodes()}
    valid = {d.node_id for d in daemons}
    refused = "WireGuard refused listen_port=51820 on plexd0: errno="
    lines = [(d1, refused), (d3, f"'{NO_WG}' was not found or is not executable"),
             (d4, "interface plexd0 already exists and is a bridge link, not WireGuard")]

    def settled() -> bool:
        for d in (d1, d2):  # every valid peer configured, the ghost left out
            if set(m.wg_dump(d.node)) != {keys[v] for v in valid - {d.node_id}}:
                return False
        return all(text in d.log_tail(200_000) for d, text in lines) and all(
            f"peer {ghost} skipped: endpoint 'not an endpoint'" in d.log_tail(200_000) for d in (d1, d2))

    m.wait(settled, 30, "the valid peers configured and each problem logged")  # raises if a daemon exited
    m.wait(lambda: d1.log_tail(200_000).count(refused) >= 2, 10, "a later converge to try the port again")
    assert all(d.proc.poll() is None for d in daemons)
    assert keys[ghost] not in m.wg_dump(n2)

    # the operator's view of the live node: every field the issue lists
    def peers_json() -> dict[str, dict]:
        res = m.run_plexd(d2, "peers", "--json")
        return {p["id"]: p for p in json.loads(res.stdout)}

    # ids come from the daemon's desired-state mirror, written within a second of a change
    m.wait(lambda: set(peers_json()) == valid - {d2.node_id}, scaled(15), "plexd peers to name every peer")
    peers = peers_json()
    p1 = peers[d1.node_id]
    assert p1["mesh_ip"] == d1.mesh_ip and p1["allowed_ips"] == [f"{d1.mesh_ip}/32"]
    assert p1["endpoint"] == f"{n1.address}:51820" and p1["public_key"] == keys[d1.node_id]
    assert {"latest_handshake", "latest_handshake_age_seconds", "rx_bytes", "tx_bytes"} <= set(p1)
    assert isinstance(p1["rx_bytes"], int) and isinstance(p1["tx_bytes"], int)


def test_interface_name_too_long_stops_plexd_up_in_one_line(tmp_path) -> None:
    """A config error, unlike the machine's state: `plexd up` refuses to start, naming the key, no traceback."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"api: {{url: http://127.0.0.1:9, allow_insecure: true}}\ndata_dir: {tmp_path / 'data'}\n"
                   f"node_api: {{socket_path: {tmp_path / 'api.sock'}}}\n"
                   "mesh: {interface: a-very-long-interface-name}\n")
    plexd = os.path.join(os.path.dirname(sys.executable), "plexd")
    res = subprocess.run([plexd, "up"], env={"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(cfg)},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "mesh.interface" in res.stderr and "not a valid interface name (1-15 characters" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
