"""The node's lifecycle in the lab, with real `plexd up`, wireguard-go, nftables and the devplane: a SIGTERM leaves
the mesh and tears everything down, the next start rejoins as the same node without a token; `plexd deregister
--purge` through the running daemon; a restart that keeps the tunnels loses at most one packet of a continuous
ping; an offline start brings the interface, peers and rules back from data_dir; `--force` with the control
plane down."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from lab_daemon import (
    assert_nothing_left,
    device_index,
    exited,
    has_interface,
    has_table,
    ping_count,
    pinging_pair,
    wait_until,
    wg_peers,
    wireguard_go_pids,
)

pytestmark = pytest.mark.root


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_sigterm_leaves_the_mesh_the_next_start_rejoins_and_deregister_purge_ends_it(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h")
    node_id, mesh_ip = a.node_id(), a.mesh_ip()
    a_key = dp.admin.node(node_id)["public_key"]

    a.stop()  # SIGTERM, the default shutdown.deregister: true
    assert a.proc.returncode == 0, a.logged()[-2000:]
    assert dp.admin.node(node_id)["status"] == "deregistered"
    wait_until(lambda: a_key not in wg_peers(lab, b.node), 15, "b to drop a's peer", daemons)
    assert_nothing_left(lab, a.node)
    assert (a.dir / "data" / "deregistered").exists() and not (a.dir / "token").exists()

    a._start()  # no token: it rejoins with its node secret
    wait_until(lambda: dp.admin.node(node_id)["status"] == "online", 20, "a to rejoin", daemons)
    assert (a.node_id(), a.mesh_ip()) == (node_id, mesh_ip) and len(dp.admin.nodes()) == 2
    wait_until(lambda: a_key in wg_peers(lab, b.node), 15, "b to list a again", daemons)
    wait_until(lambda: ping_count(lab, a.node, b.mesh_ip(), 1, 0.2) == 1, 20, "a ping after the rejoin", daemons)
    assert "rejoined the mesh as the same node" in a.logged()
    assert not (a.dir / "data" / "deregistered").exists()

    # plexd deregister --purge with the daemon running: the daemon runs its stop sequence and answers when done.
    res = a.cli("deregister", "--purge", "--json")
    doc = json.loads(res.stdout)
    assert doc["by_daemon"] and doc["deregistered"] and doc["torn_down"], doc
    assert any(line.startswith(f"removed {a.dir / 'data'}") for line in doc["purge"]["done"]), doc
    assert exited(a) == 0
    assert_nothing_left(lab, a.node)
    assert not (a.dir / "data").exists() and dp.admin.node(node_id)["status"] == "removed"
    wait_until(lambda: a_key not in wg_peers(lab, b.node), 15, "b to drop a's peer for good", daemons)


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_a_restart_that_keeps_the_tunnels_loses_at_most_one_packet(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h", a_config="shutdown: {deregister: false}\n")
    wg_pid, index = wireguard_go_pids(lab, a.node), device_index(lab, a.node)
    assert wg_pid and index is not None
    ping = lab.spawn(a.node.wrap(["ping", "-c", "60", "-i", "0.1", "-W", "1", b.mesh_ip()]),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.5)
        a.restart()
        wait_until(lambda: '"msg": "ready"' in a.logged() and "event stream connected" in a.logged(), 20, "the restart",
                   daemons)
        out, _ = ping.communicate(timeout=30)
    finally:
        if ping.poll() is None:
            ping.kill()
            ping.wait()
    sent, received = map(int, re.search(r"(\d+) packets transmitted, (\d+) received", out).groups())
    print(f"restart under ping: {sent - received} of {sent} lost")
    assert sent == 60 and sent - received <= 1, out
    # the same process carried the tunnel through the restart
    assert wireguard_go_pids(lab, a.node) == wg_pid and device_index(lab, a.node) == index
    assert "adopted" in a.logged() or "already up" in a.logged()
    assert dp.admin.node(a.node_id())["status"] == "online"


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_offline_start_comes_back_from_data_dir_and_force_leaves_with_the_control_plane_down(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="2s")
    wait_until(lambda: has_table(lab, a.node), 10, "the firewall table", daemons)
    dp.stop()

    a.stop()  # the deregistration cannot reach the devplane: logged, and the teardown goes on
    assert a.proc.returncode == 0
    assert "could not deregister" in a.logged()
    assert_nothing_left(lab, a.node)

    a._start()  # the devplane is still down
    wait_until(lambda: has_interface(lab, a.node) and has_table(lab, a.node) and len(wg_peers(lab, a.node)) == 1,
               20, "the interface, peers and rules from data_dir", daemons)
    wait_until(lambda: ping_count(lab, a.node, b.mesh_ip(), 1, 0.2) == 1, 20, "a ping while offline", daemons)
    status = a.status()
    # offline, not polling: polling starts after sse.polling_after (5 min) and would need a reachable control
    # plane to pull from (the polling fallback has its own lab: test_polling_lab.py)
    assert status["event_stream"]["state"] == "offline"
    assert "connection:     offline since " in a.cli("status").stdout

    dp.start()
    wait_until(lambda: a.status()["event_stream"]["state"] == "connected", 40, "a to reconnect", daemons)
    cycles = a.status()["reconcile"]["cycles"]
    wait_until(lambda: a.status()["reconcile"]["cycles"] > cycles and a.status()["reconcile"]["last"]["ok"], 20,
               "a reconcile after the return", daemons)

    dp.stop()
    refused = a.cli("deregister", "--purge", check=False)
    assert refused.returncode == 1 and "Nothing was changed" in refused.stderr, refused.stderr
    assert a.proc.poll() is None and has_interface(lab, a.node) and (a.dir / "data").exists()

    forced = a.cli("deregister", "--purge", "--force")
    assert "was NOT deregistered" in forced.stdout and "--force" in forced.stdout
    assert exited(a) == 0
    assert_nothing_left(lab, a.node)
    assert not (a.dir / "data").exists()
