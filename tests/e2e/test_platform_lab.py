"""The platform contract end to end: three real `plexd up` nodes (api.dialect: auto) against the devplane serving
the platform's node API (`plexd-devplane serve --dialect platform`), in lab namespaces with real wireguard-go and
nftables.

What the platform contract changes is checked where it shows: the nodes register with the project and a nonce,
their heartbeats and capabilities are the platform's flat shapes, status blocks arrive as `status.*` state
reports, a policy is the platform's CIDR rules (enforced by nft), node state and secrets reach the node API
through a state pull that an event only asks for, and a restarted node speaks the contract it registered with.
"""

from __future__ import annotations

import base64
import json
import sys

import pytest
from lab_daemon import (
    assert_rotated,
    connects,
    own_key,
    ping_count,
    ping_during,
    pinging_pair,
    publish_endpoints,
    start_mesh,
    wait_until,
    wg_peers,
)

from plexd.devplane.demo import LISTENER as LISTEN

pytestmark = pytest.mark.root
SECRET = "platform-secret-only-in-memory-41d2"


def node_state(d, *args: str) -> object:
    return json.loads(d.cli("state", *args, "--json").stdout)


@pytest.mark.parametrize("lab_dp", [{"nodes": 3, "dialect": "platform"}], indirect=True)
def test_a_platform_mesh_registers_pings_enforces_policy_and_serves_node_state(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    start_mesh(lab, dp, daemons, tmp_path, reconcile="10m")
    a, b, c = daemons
    publish_endpoints(dp, daemons)
    for src, dst in ((a, b), (b, c), (c, a)):
        wait_until(lambda s=src, t=dst: ping_count(lab, s.node, t.mesh_ip(), 1, 0.2) == 1, 20,
                   f"a ping {src.node.name} -> {dst.node.name}", daemons)

    # The identity: the contract found, the platform's names for the signing key and the mesh's range.
    for d in daemons:
        identity = json.loads((d.dir / "data" / "identity.json").read_text())
        assert identity["dialect"] == "platform" and identity["signing_key_id"] and identity["domain_mesh_cidr"]
        assert (d.dir / "data" / "node_secret_key").stat().st_mode & 0o777 == 0o600
    assert "(platform contract)" in a.cli("status").stdout

    # Heartbeats and capabilities in the platform's flat shapes; the status blocks as state reports.
    a_id = a.node_id()
    wait_until(lambda: dp.admin.heartbeats(a_id), 10, "a heartbeat", daemons)
    beat = dp.admin.heartbeats(a_id)[-1]
    assert set(beat) == {"client_now", "binary_checksum", "binary_version", "nat_summary"}, beat
    assert len(base64.b64decode(beat["binary_checksum"])) == 32 and isinstance(beat["nat_summary"], dict)
    wait_until(lambda: dp.admin.capabilities(a_id), 10, "the capabilities", daemons)
    manifest = dp.admin.capabilities(a_id)[-1]
    assert set(manifest) <= {"binary_version", "binary_checksum", "ssh_host_key_fingerprint", "declared_hooks"}
    assert len(base64.b64decode(manifest["binary_checksum"])) == 32

    def status_mesh() -> dict | None:
        entry = next((e for e in dp.admin.report_entries(a_id) if e["key"] == "status.mesh"), None)
        return None if entry is None else json.loads(entry["value"])

    wait_until(lambda: (status_mesh() or {}).get("peer_count") == 2, 15, "status.mesh with two peers", daemons)
    assert status_mesh()["interface"] == "plexd0"

    # A policy: only tcp/22 from a to b. The devplane lists the peers a policy lets each node see; the node's
    # firewall drops the rest of what a sends to b.
    listener = lab.spawn(b.node.wrap([sys.executable, "-c", LISTEN]))
    try:
        wait_until(lambda: connects(lab, a.node, b.mesh_ip(), 80), 10, "the listener (no policy yet)", daemons)
        dp.admin.set_policies([{"id": "ssh", "rules": [
            {"src": a.node_id(), "dst": b.node_id(), "port": 22, "protocol": "tcp", "action": "allow"}]}])
        wait_until(lambda: not wg_peers(lab, c.node), 15, "c to drop every peer", daemons)
        wait_until(lambda: not connects(lab, a.node, b.mesh_ip(), 80), 15, "tcp/80 dropped by b's firewall",
                   daemons)
        assert connects(lab, a.node, b.mesh_ip(), 22)
        doc = json.loads(b.cli("policies", "--json").stdout)
        assert doc["enforcement"] == "enforced", doc
        assert any(r["rule"].startswith("allow tcp/22") for p in doc["policies"] for r in p["rules"]), doc
    finally:
        listener.kill()
        listener.wait(5)
    # Everything allowed again: every node sees every other.
    dp.admin.set_policies([{"id": "all", "rules": [{"src": "*", "dst": "*", "port": 0, "protocol": "",
                                                    "action": "allow"}]}])
    wait_until(lambda: ping_count(lab, c.node, a.mesh_ip(), 1, 0.2) == 1, 15, "c back on the mesh", daemons)

    # Node state and a secret: the admin's change is an event that asks for a pull; the node API serves the
    # pulled metadata and data, and a secret fetched by name, decrypted with the NSK.
    dp.admin.set_metadata(a_id, {"env": "prod"})
    dp.admin.set_data(a_id, "app/config", "application/json", {"log_level": "info"})
    wait_until(lambda: node_state(a, "get", "metadata") == {"env": "prod"}, 15, "metadata", daemons)
    wait_until(lambda: node_state(a, "get", "data") != [], 15, "data", daemons)
    assert json.loads(node_state(a, "get", "data", "app/config")["payload"]) == {"log_level": "info"}
    dp.admin.set_secret(a_id, "db-password", SECRET)
    assert node_state(a, "get", "secret", "db-password")["value"] == SECRET
    # A workload's report through the node API goes up as one state report per key.
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps({"status": "healthy"}))
    node_state(a, "report", "put", "app-health", "--file", str(payload))
    wait_until(lambda: any(e["key"] == "app-health" and json.loads(e["value"]) == {"status": "healthy"}
                           for e in dp.admin.report_entries(a_id)), 20, "the workload's report upstream", daemons)

    # A restart: the stored identity says platform, so no guessing again; the node is back on the mesh.
    assert "registering with the control plane" in a.logged()
    a.restart()
    wait_until(lambda: ping_count(lab, a.node, b.mesh_ip(), 1, 0.2) == 1, 30, "a ping a -> b after a restart",
               daemons)
    logged = a.logged()  # the restarted daemon's log
    assert "using the stored identity" in logged and "registering with the control plane" not in logged
    assert SECRET not in logged


@pytest.mark.parametrize("lab_dp", [{"nodes": 2, "dialect": "platform"}], indirect=True)
def test_a_platform_key_rotation_keeps_the_pair_pinging_and_deregister_is_local(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h")
    old = dp.admin.node(a.node_id())["public_key"]
    assert own_key(lab, a) == old

    # The platform asks (a rotate_keys event, and the heartbeat's flag until it is done); the answer is a receipt,
    # and b learns the new key from its next state pull, which the platform's event asks for.
    _, missing, sent = ping_during(lab, a.node, b.mesh_ip(), 40,
                                   lambda: dp.admin.request_key_rotation(a.node_id()) or wait_until(
                                       lambda: dp.admin.node(a.node_id())["public_key"] != old, 15,
                                       "the rotation", daemons))
    print(f"platform rotation under ping: {missing} of {sent} lost")
    assert sent == 40 and missing <= 2
    new = assert_rotated(lab, dp, a, b, old, daemons)
    assert ping_count(lab, a.node, b.mesh_ip(), 3, 0.2) == 3
    text = a.logged()
    assert "rotated the WireGuard key" in text and old not in text and new not in text

    # The platform has no deregistration call: plexd deregister leaves the mesh locally and says so.
    out = a.cli("deregister", check=False)
    assert out.returncode == 0, out.stderr
    assert "locally" in (out.stdout + out.stderr + a.logged()), out
    assert dp.admin.node(a.node_id())["public_key"] == new  # the platform still knows it
