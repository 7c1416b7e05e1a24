"""Bridge mode in a real lab (issue 34): `plexd up --mode bridge` on the public side runs the relay as a domain of
its engine, fed by the devplane's `bridge` block; two plain wireguard-go ends (no plexd), each behind its own
random-port masquerading router, ping each other through it. The assignment is withdrawn and given back through
the devplane, the heartbeat reports it, and with the control plane gone the pair keeps pinging past the session's
TTL."""

from __future__ import annotations

import time

from lab_daemon import Daemon, lab_with_devplane, wait_until
from relay_lab import RELAY_PORT, nat_pair, ping, point_at, session_doc


def relay_status(bridge: Daemon) -> dict:
    return bridge.status().get("domains", {}).get("relay") or {}


def test_a_bridge_daemon_relays_a_pair_behind_random_port_nats_through_an_outage(tmp_path):
    with lab_with_devplane(tmp_path, 1) as (lab, dp, daemons, workdir):
        bridge = Daemon(lab, lab.nodes[0], dp, workdir, reconcile="10m", extra_config="mode: bridge\n")
        daemons.append(bridge)
        wait_until(lambda: relay_status(bridge).get("listening"), 30, "the bridge's relay to listen", daemons)
        bridge_id = bridge.node_id()
        a, b = nat_pair(lab, 1)
        relay_address = f"{lab.nodes[0].address}:{RELAY_PORT}"
        point_at(lab, a, b, relay_address)
        point_at(lab, b, a, relay_address)

        dp.admin.set_bridge(bridge_id, {"relay": {"sessions": [session_doc("rel_1", a, b, expires_in=20)]}})
        wait_until(lambda: ping(lab, a, b.mesh_ip, 1).returncode == 0, 20, "a ping through the bridge's relay",
                   daemons)
        assert [s["session_id"] for s in relay_status(bridge)["sessions"]] == ["rel_1"]
        wait_until(lambda: (dp.admin.node(bridge_id)["last_heartbeat"] or {}).get("bridge", {}).get(
            "active_relay_sessions") == 1, 10, "the heartbeat's bridge object", daemons)

        dp.admin.set_bridge(bridge_id, {"relay": None})  # null: no relay sessions wanted any more
        wait_until(lambda: relay_status(bridge)["sessions"] == [], 10, "the session to be withdrawn", daemons)
        assert ping(lab, a, b.mesh_ip, 2).returncode != 0
        dp.admin.set_bridge(bridge_id, {"relay": {"sessions": [session_doc("rel_1", a, b, expires_in=20)]}})
        wait_until(lambda: ping(lab, a, b.mesh_ip, 1).returncode == 0, 20, "the pair relayed again", daemons)

        # The control plane goes away: the bridge keeps the session past its 20 s, refreshed, not expired.
        dp.stop()
        gone_at = time.monotonic()
        wait_until(lambda: bridge.status()["heartbeat"].get("consecutive_failures", 0) > 0, 15,
                   "the bridge to notice the outage", daemons)
        while time.monotonic() - gone_at < 25:
            time.sleep(1)
        assert ping(lab, a, b.mesh_ip, 3).returncode == 0, "the relayed pair stopped at its TTL during the outage"
        assert relay_status(bridge)["expired"] == 0
