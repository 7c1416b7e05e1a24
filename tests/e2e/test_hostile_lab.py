"""A hostile or broken control plane against a running `plexd up` (real devplane, real wireguard-go, real
namespaces): every class of bad input is sent while the tunnel pings. After each, the daemon is still running,
still heartbeating, the tunnel still pings, and a valid event sent right after is applied. A restart afterwards
comes up cleanly, and no traceback is ever logged.

The devplane signs what it is told to (a control plane compromised with valid keys), or sends raw SSE blocks
(`raw_frame`) and a chosen GET /state body (`state_body` fault).
"""

from __future__ import annotations

import base64
import json

import pytest
from lab_daemon import (
    ping_count,
    pinging_pair,
    register_ghost,
    wait_until,
    wg_peers,
)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def sloppy(key: str) -> str:
    """The same 32 bytes in non-canonical base64 (the spare low bits of the last character set)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    return key[:42] + alphabet[alphabet.index(key[42]) | 1] + "="


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_every_class_of_hostile_input_while_the_tunnel_pings(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    # a restarts at the end: a SIGTERM must not deregister it (the default does, see the lifecycle issue)
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="3s", a_config="shutdown: {deregister: false}\n")
    a_id, b_id = a.node_id(), b.node_id()
    b_peer = {"id": b_id, "public_key": dp.admin.node(b_id)["public_key"], "mesh_ip": b.mesh_ip(),
              "endpoint": f"{b.node.address}:51820", "allowed_ips": [f"{b.mesh_ip()}/32"], "psk": ""}
    own_key = dp.admin.node(a_id)["public_key"]
    ghost_n = [0]

    def still_fine(what: str) -> None:
        """Alive, heartbeating, pinging, and the next valid event (a real new node) reaches the device."""
        assert a.proc.poll() is None, f"plexd died after {what}"
        beats = len(dp.admin.heartbeats(a_id))
        ghost_n[0] += 1
        _, key = register_ghost(dp, f"px-after-{ghost_n[0]}")
        wait_until(lambda: key in wg_peers(lab, a.node), 15, f"the valid event after {what}", daemons)
        wait_until(lambda: len(dp.admin.heartbeats(a_id)) > beats, 10, f"a heartbeat after {what}", daemons)
        assert ping_count(lab, a.node, b.mesh_ip(), 2, 0.2) >= 1, f"the tunnel after {what}"

    def publish(event_type: str, **kw) -> str:
        return dp.admin.publish_event(a_id, event_type, **kw)

    # 1. envelopes and payloads: nesting, size, invalid text, ids
    deep = publish("peer_added", payload_raw=nested(5000))
    wait_until(lambda: f"event {deep} rejected" in a.logged(), 10, "the deep event refused", daemons)
    assert "nested deeper than 64 levels" in a.logged()
    still_fine("a payload nested 5,000 levels deep")
    publish("peer_added", payload_raw=json.dumps({"id": "n_huge", "public_key": "A" * 700_000}))
    wait_until(lambda: "oversize" in a.logged(), 10, "the oversize event", daemons)
    still_fine("a 700 KB event")
    publish("peer_added", payload_raw='{"id": "n_\\ud800", "public_key": "' + own_key + '", "mesh_ip": "10.100.9.9"}')
    publish("peer_added", payload_raw='{"id": "n_nan", "public_key": 1e999, "mesh_ip": NaN}')
    still_fine("a lone surrogate and non-finite numbers")
    weird_ids = json.dumps({"event_type": "peer_added", "event_id": "\u00e9\u0007"}, ensure_ascii=False)
    publish("raw", raw_frame=f"id: evt_\x01\u00e9vil\ndata: {weird_ids}\n\n")
    publish("raw", raw_frame="retry: 99999999999999999999999999\nretry: \u0661\u0662\nid: " + "x" * 5000 + "\n: x\n\n")
    still_fine("control characters and non-ASCII in ids, absurd retry values")

    # 2. what a control plane may not ask, validly signed
    publish("peer_added", payload={"id": "n_default", "public_key": base64.b64encode(b"d" * 32).decode(),
                                   "mesh_ip": "10.100.200.1", "allowed_ips": ["10.100.200.1/32", "0.0.0.0/0"]})
    publish("peer_added", payload={"id": "n_halves", "public_key": base64.b64encode(b"h" * 32).decode(),
                                   "mesh_ip": "10.100.200.2",
                                   "allowed_ips": ["10.100.200.2/32", "0.0.0.0/1", "128.0.0.0/1"]})
    publish("peer_added", payload={"id": "n_cp", "public_key": base64.b64encode(b"c" * 32).decode(),
                                   "mesh_ip": "10.100.200.3",
                                   "allowed_ips": ["10.100.200.3/32", f"{lab.bridge_address}/32"]})
    publish("peer_added", payload={"id": "n_thief", "public_key": base64.b64encode(b"t" * 32).decode(),
                                   "mesh_ip": b.mesh_ip(), "allowed_ips": [f"{b.mesh_ip()}/32"]})
    publish("peer_added", payload={"id": "n_me", "public_key": own_key, "mesh_ip": "10.100.200.5"})
    publish("peer_added", payload={"id": "n_twin", "public_key": b_peer["public_key"], "mesh_ip": "10.100.200.6"})
    publish("peer_key_rotated", payload={**b_peer, "public_key": sloppy(b_peer["public_key"])})
    still_fine("routes and addresses a control plane may not ask for")
    log = a.logged()
    for reason in ("0.0.0.0/0 refused: a default route", "allowed IP 0.0.0.0/1 refused: ",
                   "allowed IP 128.0.0.0/1 refused: ",
                   f"would route {lab.bridge_address}", f"mesh IP {b.mesh_ip()} already belongs to peer {b_id}",
                   "public key is this node's own key", f"public key is already used by peer {b_id}"):
        assert reason in log, reason
    dev = wg_peers(lab, a.node)
    assert b_peer["public_key"] in dev and sloppy(b_peer["public_key"]) not in dev  # one key, canonical
    wait_until(lambda: any(c["type"] == "allowed_ip_rejected" for r in dp.admin.drift(a_id)
                           for c in r["corrections"]), 10, "the refusals in a drift report", daemons)
    reported = " | ".join(c["detail"] for r in dp.admin.drift(a_id) for c in r["corrections"])
    assert "n_default: 0.0.0.0/0" in reported and "n_thief" in reported
    # the non-canonical key is one key: no endless corrections of b over the next reconciles
    before = a.logged().count(f"corrected: peer {b_id}")
    cycles = a.status()["reconcile"]["cycles"]
    wait_until(lambda: a.status()["reconcile"]["cycles"] >= cycles + 2, 20, "two more reconciles", daemons)
    assert a.logged().count(f"corrected: peer {b_id}") == before

    # 3. broken state responses
    for body in ('{"peers": "nope"}', '{"peers":' + nested(5000) + "}", "not json", '{"peers": [{"id": 1e999}]}'):
        failures = a.logged().count("fetching the state failed")
        dp.admin.set_faults(state_body=body)
        dp.admin.request_heartbeat_flags(a_id, reconcile=True)
        wait_until(lambda f=failures: a.logged().count("fetching the state failed") > f, 15, "a refused state",
                   daemons)
        still_fine(f"a state body {body[:30]!r}")
        dp.admin.clear_faults()
    assert "state fetch failed (HTTP 200" in a.logged()

    assert "Traceback" not in a.logged()
    assert a.proc.poll() is None
    # a restart afterwards comes up cleanly
    a.restart()
    wait_until(lambda: "event stream connected" in a.logged(), 30, "the restart to connect", daemons)
    wait_until(lambda: ping_count(lab, a.node, b.mesh_ip(), 1, 0.2) == 1, 15, "a ping after the restart", daemons)
    assert "Traceback" not in a.logged()
    assert a.status()["event_stream"]["state"] == "connected"
