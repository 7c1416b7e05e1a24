"""A node on kernel WireGuard beside one on wireguard-go, through its whole life: the kernel tier's lab (a VM booting
Debian's stock kernel, scripts/kernel-vm.sh). The steps of the wireguard-go labs of the lifecycle and the key
rotation (test_lifecycle_lab.py, test_key_rotation_lab.py), in one lab: on the emulated CPU each lab costs minutes.

1. the two ping each other, both ways (a mixed pair: the kernel's WireGuard and wireguard-go);
2. a restart under a continuous ping adopts the live kernel device: the same interface, at most one packet lost;
3. `plexd rotate-keys` under ping: at most one packet lost, both devices on the new key, the old one nowhere;
4. `plexd deregister` through the daemon removes the kernel device and the table; the next start rejoins;
5. with the daemon killed, `plexd deregister --purge` alone removes them again, and data_dir with them.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from lab_daemon import (
    assert_nothing_left,
    assert_rotated,
    device_index,
    exited,
    ping_count,
    ping_during,
    pinging_pair,
    wait_until,
    wg_peers,
    wireguard_go_pids,
)

pytestmark = pytest.mark.kernel


def kind(lab, node) -> str:
    """The kind of the node's plexd0, as `ip -d link` names it ("wireguard" for the kernel's, "tun" for
    wireguard-go's; "" while there is none)."""
    shown = lab.exec(node, ["ip", "-d", "-j", "link", "show", "plexd0"], check=False)
    if shown.returncode != 0:
        return ""
    return json.loads(shown.stdout)[0].get("linkinfo", {}).get("info_kind", "tun")


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_a_kernel_node_restarts_rotates_leaves_and_rejoins_beside_a_wireguard_go_one(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h", a_config="shutdown: {deregister: false}\n",
                        backends=("kernel", "userspace"))
    assert (kind(lab, a.node), kind(lab, b.node)) == ("wireguard", "tun")
    assert wireguard_go_pids(lab, a.node) == [] and len(wireguard_go_pids(lab, b.node)) == 1
    assert ping_count(lab, b.node, a.mesh_ip(), 2, 0.2) == 2  # and back

    # 2. restart under ping: the kernel device is adopted, not recreated
    index = device_index(lab, a.node)

    def restart() -> None:
        a.restart()
        wait_until(lambda: '"msg": "ready"' in a.logged() and "event stream connected" in a.logged(), 30,
                   "the restart", daemons)

    _, lost, sent = ping_during(lab, a.node, b.mesh_ip(), 80, restart)
    print(f"restart under ping: {lost} of {sent} lost")
    assert sent == 80 and lost <= 1
    assert device_index(lab, a.node) == index and ("adopted" in a.logged() or "already up" in a.logged())

    # 3. a key rotation under ping
    old = dp.admin.node(a.node_id())["public_key"]
    doc, lost, sent = ping_during(lab, a.node, b.mesh_ip(), 40,
                                  lambda: json.loads(a.cli("rotate-keys", "--json").stdout))
    print(f"rotation under ping: {lost} of {sent} lost")
    assert sent == 40 and lost <= 1 and doc["previous_public_key"] == old
    assert doc["public_key"] == assert_rotated(lab, dp, a, b, old, daemons)
    key = doc["public_key"]

    # 4. leaving through the daemon removes the kernel device and the table; the next start rejoins
    node_id, mesh_ip = a.node_id(), a.mesh_ip()
    left = json.loads(a.cli("deregister", "--json").stdout)
    assert left["by_daemon"] and left["deregistered"] and left["torn_down"], left
    assert exited(a) == 0
    assert_nothing_left(lab, a.node)
    wait_until(lambda: key not in wg_peers(lab, b.node), 15, "b to drop a's peer", daemons)
    a._start()
    wait_until(lambda: dp.admin.node(node_id)["status"] == "online" and kind(lab, a.node) == "wireguard", 30,
               "a to rejoin on kernel WireGuard", daemons)
    assert (a.node_id(), a.mesh_ip()) == (node_id, mesh_ip)
    wait_until(lambda: ping_count(lab, a.node, b.mesh_ip(), 1, 0.2) == 1, 30, "a ping after the rejoin", daemons)

    # 5. for good, with no daemon running (killed): the command takes the kernel device down itself
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(30)
    assert kind(lab, a.node) == "wireguard"  # left behind
    purged = json.loads(a.cli("deregister", "--purge", "--json").stdout)
    assert not purged["by_daemon"] and purged["deregistered"] and purged["torn_down"], purged
    assert_nothing_left(lab, a.node)
    assert not (a.dir / "data").exists() and dp.admin.node(node_id)["status"] == "removed"
