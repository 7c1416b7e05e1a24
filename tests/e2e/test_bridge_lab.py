"""Bridge mode in a real lab (issue 34): `plexd up --mode bridge` on the public side runs the relay as a domain of
its engine, fed by the devplane's `bridge` block.

- Two plain wireguard-go ends (no plexd), each behind its own random-port masquerading router, ping each other
  through it; the assignment is withdrawn and given back through the devplane, the heartbeat reports it, and with
  the control plane gone the pair keeps pinging past the session's TTL.
- Two `plexd up` nodes behind random-port NATs, whose direct path can never work, move to the bridge's relay by
  themselves (their peers' `fallback_endpoint`) and reach each other; `plexd peers` and `plexd status` say so.
  When their routers start keeping ports, both take the direct path back at the next probe window and the relay
  carries nothing more."""

from __future__ import annotations

import json
import time

from lab_daemon import Daemon, lab_with_devplane, wait_until
from relay_lab import RANDOM_NAT, RELAY_PORT, flush_conntrack, nat_pair, ping, point_at, session_doc


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


def test_nodes_behind_random_port_nats_move_to_the_bridges_relay_by_themselves(tmp_path):
    with lab_with_devplane(tmp_path, 1) as (lab, dp, daemons, workdir):
        bridge = Daemon(lab, lab.nodes[0], dp, workdir, reconcile="10m", extra_config="mode: bridge\n")
        daemons.append(bridge)
        routers = [lab.add_router(RANDOM_NAT) for _ in range(2)]
        probe = {"PLEXD_MESH_PATH_PROBE_INTERVAL": "40s"}  # a relayed peer tries direct every 40 s, not 60
        a, b = (Daemon(lab, lab.add_node(behind=r), dp, workdir, reconcile="10m", env=probe) for r in routers)
        daemons += [a, b]
        wait_until(lambda: all(d.node_id() for d in daemons) and relay_status(bridge).get("listening"), 30,
                   "the nodes to register and the bridge's relay to listen", daemons)
        # Their direct endpoints as a control plane would know them: the routers' public addresses, which a
        # port-randomising NAT never keeps, so the direct path shows no handshake.
        for d, router in zip((a, b), routers, strict=True):
            dp.admin.set_node_endpoint(d.node_id(), f"{router.public}:51820")
        relay = f"{lab.nodes[0].address}:{RELAY_PORT}"
        dp.admin.set_bridge(bridge.node_id(), {"relay": {"endpoint": relay, "sessions": [{
            "session_id": "rel_ab", "peer_a_id": a.node_id(), "peer_a_endpoint": f"{routers[0].public}:51820",
            "peer_b_id": b.node_id(), "peer_b_endpoint": f"{routers[1].public}:51820",
            "expires_at": "2999-01-01T00:00:00Z"}]}})
        took = wait_until(lambda: ping(lab, a, b.mesh_ip(), 1).returncode == 0, 45,
                          "a to reach b through the bridge's relay", daemons)
        print(f"a reached b through the relay {took:.1f} s after the relay was assigned")
        peers = {p["id"]: p for p in json.loads(a.cli("peers", "--json").stdout)}
        assert (peers[b.node_id()]["path"], peers[b.node_id()]["endpoint"]) == ("relay", relay), peers
        assert peers[bridge.node_id()]["path"] is None  # the bridge itself is reached directly, no fallback
        path = a.status()["paths"][b.node_id()]
        assert path["path"] == "relay" and path["switches"] >= 1, path
        [session] = relay_status(bridge)["sessions"]
        assert session["packets_a_to_b"] > 0 and session["packets_b_to_a"] > 0, session
        wait_until(lambda: ((dp.admin.node(a.node_id())["last_heartbeat"] or {}).get("paths") or {}).get(
            "relayed") == 1, 10, "a's heartbeat to say one peer is relayed", daemons)
        beat = dp.admin.node(a.node_id())["last_heartbeat"]["paths"]["peers"][b.node_id()]
        assert beat["path"] == "relay" and beat["switches"] >= 1, beat

        # The routers start keeping ports (a simpler NAT): at the next probe window both sides try the direct
        # path at once, it works, they keep it, and the relay carries nothing more.
        for router in routers:
            lab.set_router_nat(router, "masquerade")
            flush_conntrack(router)
        took = wait_until(lambda: {a.status()["paths"][b.node_id()]["path"], b.status()["paths"][a.node_id()]["path"]}
                          == {"direct"}, 150, "both nodes to take the direct path back", daemons)
        print(f"both back on the direct path {took:.1f} s after the NATs changed")
        before = relay_status(bridge)["sessions"][0]
        assert ping(lab, a, b.mesh_ip(), 5).returncode == 0
        after = relay_status(bridge)["sessions"][0]
        assert after["packets_a_to_b"] + after["packets_b_to_a"] == before["packets_a_to_b"] + before["packets_b_to_a"]
        peers = {p["id"]: p for p in json.loads(a.cli("peers", "--json").stdout)}
        assert peers[b.node_id()]["path"] == "direct" and a.status()["paths"][b.node_id()]["switches"] >= 2
