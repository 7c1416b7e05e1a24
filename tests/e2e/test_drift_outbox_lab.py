"""A drift report outlives an outage and a restart: the control plane is down, drift is made by hand and repaired,
the daemon is restarted, the control plane comes back, and the report arrives exactly once (the Go agent keeps
unsent reports in memory only; ours are in data_dir/uplink.db until taken)."""

from __future__ import annotations

import sqlite3

import pytest
from lab_daemon import Daemon, register_ghost, wait_until, wg_peers, wireguard_go_pids

pytestmark = pytest.mark.timeout(150)


def queued(d: Daemon) -> int:
    """Drift reports waiting in the uplink outbox (its other lanes, telemetry's, come and go meanwhile)."""
    path = d.dir / "data" / "uplink.db"
    if not path.exists():
        return 0
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return db.execute("SELECT count(*) FROM outbox WHERE lane = 'drift'").fetchone()[0]


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_a_drift_report_made_while_the_control_plane_was_down_arrives_once_after_a_restart(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, reconcile="2s", extra_config="shutdown: {deregister: false}\n")
    daemons.append(d)
    ghost, ghost_key = register_ghost(dp, "ghost")
    wait_until(lambda: d.node_id() is not None and ghost_key in wg_peers(lab, d.node), 30, "the ghost on the device",
               [d])
    node_id = d.node_id()
    assert dp.admin.drift(node_id) == []

    dp.stop()
    lab.exec(d.node, ["wg", "set", "plexd0", "peer", ghost_key, "remove"])
    wait_until(lambda: ghost_key in wg_peers(lab, d.node) and queued(d) == 1, 30,
               "the peer put back from the stored state and the report queued on disk", [d])

    tunnel = wireguard_go_pids(lab, d.node)
    d.restart(main_only=True)  # the report is only on disk now; the tunnels stay up (deregister: false)
    wait_until(lambda: '"msg": "ready"' in d.logged(), 30, "the restarted daemon", [d])
    assert queued(d) == 1

    dp.start()
    wait_until(lambda: queued(d) == 0 and dp.admin.drift(node_id), 60, "the report delivered", [d])
    reports = dp.admin.drift(node_id)
    # the wireguard-go the first daemon started outlived it and serves on (its output is a file, not a pipe to
    # the daemon that is gone: the next line it wrote would have killed it with SIGPIPE)
    assert wireguard_go_pids(lab, d.node) == tunnel and "is gone" not in d.logged()
    assert [c["detail"] for r in reports for c in r["corrections"]] == [
        f"peer {ghost['node_id']}: missing from the device"]
    # once: later cycles (every 2 s) neither resend it nor report the start-up as drift
    res = d.cli("reconcile", "--once")
    assert len(dp.admin.drift(node_id)) == 1, (res.stdout, dp.admin.drift(node_id), d.logged()[-6000:])
