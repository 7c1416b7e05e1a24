"""Every node endpoint of §1.2 over real HTTP: happy path, stored results, auth and bad-input statuses."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json

import httpx
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from devplane_helpers import new_public_key, register

from plexd.devplane.harness import AdminError


@pytest.fixture(scope="module")
def pair(dp):
    return register(dp), register(dp)


# -- auth -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,suffix", [
    ("GET", "state"), ("POST", "heartbeat"), ("POST", "deregister"), ("PUT", "capabilities"), ("PUT", "endpoint"),
    ("POST", "drift"), ("GET", "secrets/k"), ("POST", "report"), ("POST", "executions/e1/ack"),
    ("POST", "executions/e1/result"), ("POST", "metrics"), ("POST", "logs"), ("POST", "audit"),
    ("POST", "tunnels/s1/ready"), ("POST", "tunnels/s1/closed"), ("POST", "integrity/violations"),
    ("GET", "events"),
])
def test_every_node_endpoint_needs_the_node_secret(dp, pair, method, suffix):
    a, b = pair
    url = a.path(suffix)
    for headers in ({}, {"Authorization": "Bearer wrong-secret"}, {"Authorization": f"Basic {a.secret}"}):
        resp = httpx.request(method, url, headers=headers, json={}, timeout=10)
        assert resp.status_code == 401, (headers, resp.text)
        assert "error" in resp.json()
    # b's secret on a's path: the node exists but the secret is not its own.
    resp = httpx.request(method, url, headers=b.headers, json={}, timeout=10)
    assert resp.status_code == 403
    # An unknown node id with a valid secret: 404.
    resp = httpx.request(method, f"{dp.url}/v1/nodes/n_doesnotexist/{suffix}", headers=a.headers, json={},
                         timeout=10)
    assert resp.status_code == 404 and "n_doesnotexist" in resp.json()["error"]


# -- heartbeat and liveness -------------------------------------------------------------------------------------

def test_heartbeat_records_and_returns_one_shot_flags(dp, pair):
    a, _ = pair
    body = {"node_id": a.id, "timestamp": "2025-01-15T10:30:00.5+01:00", "status": "healthy", "uptime": "1h2m",
            "binary_checksum": "ab" * 32, "mesh": {"interface": "plexd0", "peer_count": 1, "listen_port": 51820},
            "nat": {"public_endpoint": "203.0.113.10:51820", "type": "full_cone"}}
    resp = a.post("heartbeat", body)
    assert resp.status_code == 200 and resp.json() == {"reconcile": False, "rotate_keys": False}
    dp.admin.request_heartbeat_flags(a.id, reconcile=True)
    assert a.post("heartbeat", body).json() == {"reconcile": True, "rotate_keys": False}
    assert a.post("heartbeat", body).json() == {"reconcile": False, "rotate_keys": False}
    dp.admin.request_heartbeat_flags(a.id, rotate_keys=True)
    assert a.post("heartbeat", {}).json() == {"reconcile": False, "rotate_keys": True}
    # The Go agent's zero-valued body is fine too.
    zero = {"node_id": "", "timestamp": "0001-01-01T00:00:00Z", "status": "", "uptime": "", "binary_checksum": ""}
    assert a.post("heartbeat", zero).status_code == 200
    beats = dp.admin.heartbeats(a.id)
    assert body in beats and zero in beats
    node = dp.admin.node(a.id)
    assert node["status"] == "online" and node["nat_type"] == "full_cone" and node["last_seen"]


def test_heartbeat_wrong_types_name_the_field(pair):
    a, _ = pair
    resp = a.post("heartbeat", {"mesh": {"peer_count": "many"}})
    assert resp.status_code == 400 and resp.json()["error"].startswith("mesh.peer_count: must be an integer")
    resp = a.post("heartbeat", {"timestamp": "yesterday"})
    assert resp.status_code == 400 and "timestamp" in resp.json()["error"]
    resp = a.post("heartbeat", {"NAT": {"Type": 5}})  # keys match case-insensitively, like Go
    assert resp.status_code == 400 and "nat.type" in resp.json()["error"]


# -- state, secrets ---------------------------------------------------------------------------------------------

def test_state_has_the_wire_shape_and_admin_changes(dp):
    a, b = register(dp), register(dp)
    dp.admin.set_metadata(a.id, {"environment": "production"})
    entry = dp.admin.set_data(a.id, "database-config", "application/json", {"host": "db", "port": 5432})
    assert entry["version"] == 1
    assert dp.admin.set_data(a.id, "database-config", "application/json", {"host": "db2"})["version"] == 2
    assert dp.admin.set_secret(a.id, "tls-cert", "s3cr3t") == 1
    state = a.get("state").json()
    assert set(state) == {"peers", "policies", "signing_keys", "metadata", "data", "secret_refs", "sessions",
                          "bridge"}
    assert state["sessions"] == []  # no sessions: an empty block, which a node reads as "close every session"
    assert state["bridge"] is None  # not a bridge: nothing desired from it as one
    assert b.id in {p["id"] for p in state["peers"]}
    assert state["policies"] == [{"id": "pol_default", "rules": [
        {"src": "*", "dst": "*", "port": 0, "protocol": "", "action": "allow"}]}]
    assert state["signing_keys"]["current"] == a.response["signing_public_key"]
    assert state["metadata"] == {"environment": "production"}
    [data] = state["data"]
    assert data["key"] == "database-config" and data["payload"] == {"host": "db2"} and data["version"] == 2
    assert data["content_type"] == "application/json" and data["updated_at"].endswith("Z")
    assert state["secret_refs"] == [{"key": "tls-cert", "version": 1}]
    # A node without metadata omits it (omitempty), and still gets the always-present lists.
    b_state = b.get("state").json()
    assert "metadata" not in b_state and b_state["data"] == [] and b_state["secret_refs"] == []


def test_secret_is_aes_gcm_with_the_raw_node_secret(dp, pair):
    a, _ = pair
    version = dp.admin.set_secret(a.id, "db/password", "hunter2 ✓")
    resp = a.get("secrets/db%2Fpassword")
    assert resp.status_code == 200
    body = resp.json()
    assert body["key"] == "db/password" and body["version"] == version
    nonce = base64.b64decode(body["nonce"], validate=True)
    sealed = base64.b64decode(body["ciphertext"], validate=True)
    assert len(nonce) == 12
    assert AESGCM(a.secret.encode()).decrypt(nonce, sealed, None).decode() == "hunter2 ✓"
    assert a.get("secrets/nope").status_code == 404


# -- endpoint, capabilities, key rotation -----------------------------------------------------------------------

def test_endpoint_report_returns_visible_peer_endpoints(dp):
    a, b = register(dp), register(dp)
    assert a.put("endpoint", {"public_endpoint": "198.51.100.5:51820", "nat_type": "full_cone"}).status_code == 200
    resp = b.put("endpoint", {"public_endpoint": "203.0.113.10:51820", "nat_type": "none"})
    assert resp.status_code == 200
    assert {"peer_id": a.id, "endpoint": "198.51.100.5:51820"} in resp.json()["peer_endpoints"]
    assert all(set(pe) == {"peer_id", "endpoint"} for pe in resp.json()["peer_endpoints"])
    peer_a = next(p for p in b.get("state").json()["peers"] if p["id"] == a.id)
    assert peer_a["endpoint"] == "198.51.100.5:51820"
    assert dp.admin.node(a.id)["nat_type"] == "full_cone"
    assert dp.admin.endpoints(a.id)[-1] == {"public_endpoint": "198.51.100.5:51820", "nat_type": "full_cone"}
    assert a.put("endpoint", {"public_endpoint": "no-port"}).status_code == 400
    assert a.put("endpoint", {"public_endpoint": 5}).status_code == 400


def test_capabilities_are_stored(dp, pair):
    a, _ = pair
    caps = {"binary": {"version": "0.1.0", "checksum": "ab" * 32},
            "builtin_actions": [{"name": "gather_info", "description": "d", "parameters": None}],
            "hooks": [{"name": "backup", "description": "", "source": "local", "checksum": "cd" * 32,
                       "parameters": [{"name": "target", "type": "string", "required": True, "description": ""}],
                       "timeout": "30s", "sandbox": "none"}]}
    assert a.put("capabilities", caps).status_code == 200
    assert dp.admin.node(a.id)["capabilities"] == caps
    bad = a.put("capabilities", {"hooks": [{"parameters": [{"required": "yes"}]}]})
    assert bad.status_code == 400 and "hooks[0].parameters[0].required" in bad.json()["error"]


def test_key_rotation_updates_the_peer_key(dp):
    a, b = register(dp), register(dp)
    new_key = new_public_key()
    resp = httpx.post(f"{dp.url}/v1/keys/rotate", headers=a.headers,
                      json={"node_id": a.id, "new_public_key": new_key}, timeout=10)
    assert resp.status_code == 200
    assert b.id in {p["id"] for p in resp.json()["updated_peers"]}
    assert next(p for p in b.get("state").json()["peers"] if p["id"] == a.id)["public_key"] == new_key
    bad = httpx.post(f"{dp.url}/v1/keys/rotate", headers=a.headers, json={"new_public_key": "short"}, timeout=10)
    assert bad.status_code == 400
    # Bearer auth here too: no or a wrong secret is 401, another node's id is 403; nothing changes.
    for headers in ({}, {"Authorization": "Bearer wrong-secret"}):
        resp = httpx.post(f"{dp.url}/v1/keys/rotate", headers=headers,
                          json={"node_id": a.id, "new_public_key": new_public_key()}, timeout=10)
        assert resp.status_code == 401 and "error" in resp.json()
    resp = httpx.post(f"{dp.url}/v1/keys/rotate", headers=b.headers,
                      json={"node_id": a.id, "new_public_key": new_public_key()}, timeout=10)
    assert resp.status_code == 403 and "error" in resp.json()
    assert dp.admin.node(a.id)["public_key"] == new_key


# -- reports and telemetry --------------------------------------------------------------------------------------

def test_drift_report_ack_result_and_telemetry_are_stored(dp, pair):
    a, _ = pair
    drift = {"timestamp": "2025-01-15T10:31:00.123456789+01:00",
             "corrections": [{"type": "peer_added", "detail": "peer n_x"}]}
    assert a.post("drift", drift).status_code == 200
    assert dp.admin.drift(a.id)[-1] == drift
    report = {"entries": [{"key": "app-health", "content_type": "application/json", "payload": {"ok": True},
                           "version": 12, "updated_at": "2025-01-15T10:30:00.123456789+01:00"}], "deleted": None}
    assert a.post("report", report).status_code == 200
    assert dp.admin.reports(a.id)[-1] == report
    # entries Go reads case-insensitively are taken; what is no entry is a 400 naming it (a 500, retried for ever)
    assert a.post("report", {"entries": [{"Key": "k2", "content_type": "text/plain", "payload": 1}]}).status_code == 200
    for bad in ({"entries": [None]}, {"entries": [{"content_type": "t"}]}, {"deleted": [5]}):
        refused = a.post("report", bad)
        assert refused.status_code == 400 and ("entries[0]" in refused.text or "deleted" in refused.text), bad

    eid = dp.admin.request_action(a.id, "backup", {"target": "/srv"}, timeout="30s", checksum="ab" * 32)
    ack = {"execution_id": eid, "status": "accepted", "reason": ""}
    result = {"execution_id": eid, "status": "success", "exit_code": 0, "stdout": "ok\n", "stderr": "",
              "duration": "1.2ms", "finished_at": "2025-01-15T10:30:02.1234Z",
              "triggered_by": {"type": "control_plane", "session_id": "", "user_id": "", "email": ""}}
    assert a.post(f"executions/{eid}/ack", ack).status_code == 200
    assert a.post(f"executions/{eid}/result", result).status_code == 200
    [execution] = [e for e in dp.admin.executions(a.id) if e["execution_id"] == eid]
    assert execution["action"] == "backup" and execution["ack"] == ack and execution["result"] == result
    # A local action the control plane never requested is still recorded.
    assert a.post("executions/exec_local/result", dict(result, execution_id="exec_local")).status_code == 200
    assert any(e["execution_id"] == "exec_local" for e in dp.admin.executions(a.id))
    mismatch = a.post(f"executions/{eid}/ack", dict(ack, execution_id="other"))
    assert mismatch.status_code == 400

    metrics = [{"timestamp": "2025-01-15T10:30:00Z", "group": "system", "data": {"cpu_usage_percent": 1.5}},
               {"timestamp": "2025-01-15T10:30:00Z", "group": "tunnel", "peer_id": "n_p", "data": {}}]
    logs = [{"timestamp": "2025-01-15T10:30:00Z", "source": "journald", "unit": "sshd", "message": "<hi> & bye",
             "severity": "info", "hostname": "h"}]
    audit = [{"timestamp": "2025-01-15T10:30:00Z", "source": "auditd", "event_type": "SYSCALL",
              "subject": {"uid": 0, "gid": 0, "pid": 1}, "object": "\"/etc/shadow\"", "action": "open",
              "result": "failure", "hostname": "h", "raw": "..."}]
    for suffix, batch in (("metrics", metrics), ("logs", logs), ("audit", audit)):
        assert a.post(suffix, batch).status_code == 200
        assert a.post(suffix, batch).status_code == 200
    assert dp.admin.metrics(a.id)[-2:] == metrics
    assert dp.admin.logs(a.id)[-1] == logs[0]
    assert dp.admin.audit(a.id)[-1] == audit[0]
    assert a.post("metrics", {"not": "an array"}).status_code == 400

    violation = {"type": "hook", "path": "/etc/plexd/hooks/x", "expected_checksum": "aa", "actual_checksum": "bb",
                 "detail": "hook checksum mismatch", "timestamp": "2025-01-15T10:30:00Z"}
    assert a.post("integrity/violations", violation).status_code == 200
    assert dp.admin.integrity(a.id)[-1] == violation
    ready = {"listen_addr": "10.100.1.5:41234", "timestamp": "2025-01-15T10:30:00Z"}
    assert a.post("tunnels/sess_1/ready", ready).status_code == 200
    assert a.post("tunnels/sess_1/closed", {"reason": "revoked", "duration": "5m3.2s",
                                           "timestamp": "2025-01-15T10:35:00Z"}).status_code == 200
    assert dp.admin.tunnels(a.id)[-1] == {"session_id": "sess_1", **ready}


# -- transport --------------------------------------------------------------------------------------------------

def test_gzip_request_bodies_are_accepted(dp, pair):
    a, _ = pair
    logs = [{"timestamp": "2025-01-15T10:30:00Z", "source": "journald", "unit": "u", "message": "x" * 100,
             "severity": "info", "hostname": "h"}] * 40  # > 1 KiB, as the Go agent would gzip it
    body = gzip.compress(json.dumps(logs).encode())
    headers = dict(a.headers, **{"Content-Encoding": "gzip", "Content-Type": "application/json"})
    resp = httpx.post(a.path("logs"), content=body, headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    assert dp.admin.logs(a.id)[-40:] == logs
    # Registration too.
    token = dp.admin.create_token()
    reg = gzip.compress(json.dumps({"token": token, "public_key": new_public_key(), "hostname": "gz"}).encode())
    resp = httpx.post(f"{dp.url}/v1/register", content=reg, headers={"Content-Encoding": "gzip"}, timeout=10)
    assert resp.status_code == 201
    # Not gzip at all, but labelled so: 400.
    bad = httpx.post(a.path("logs"), content=b"[]", headers=headers, timeout=10)
    assert bad.status_code == 400 and "gzip" in bad.json()["error"]


def test_oversize_bodies_are_413(pair):
    a, _ = pair
    big = json.dumps([{"message": "x" * 1000}] * 1100).encode()  # ~1.1 MB
    resp = httpx.post(a.path("logs"), content=big, headers=a.headers, timeout=10)
    assert resp.status_code == 413 and "limit" in resp.json()["error"]
    # A gzip bomb: small on the wire, huge inflated.
    bomb = gzip.compress(b"[" + b" " * (4 << 20) + b"]")
    resp = httpx.post(a.path("logs"), content=bomb, headers=dict(a.headers, **{"Content-Encoding": "gzip"}),
                      timeout=10)
    assert resp.status_code == 413
    # Chunked upload without Content-Length is limited too.
    resp = httpx.post(a.path("logs"), content=iter([big[:600_000], big[600_000:]]), headers=a.headers, timeout=10)
    assert resp.status_code == 413


def test_malformed_json_and_unknown_routes_get_json_errors(dp, pair):
    a, _ = pair
    resp = httpx.post(a.path("drift"), content=b'{"timestamp": ', headers=a.headers, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"].startswith("malformed JSON")
    resp = httpx.post(a.path("drift"), content=b"\xff\xfe", headers=a.headers, timeout=10)
    assert resp.status_code == 400
    resp = httpx.post(a.path("drift"), content=b"", headers=a.headers, timeout=10)
    assert resp.status_code == 400 and "empty" in resp.json()["error"]
    resp = httpx.post(a.path("report"), content=b'{"entries": [{"payload": NaN}]}', headers=a.headers, timeout=10)
    assert resp.status_code == 400 and "NaN" in resp.json()["error"]
    resp = httpx.post(a.path("report"), content=b"[" * 100_000 + b"]" * 100_000, headers=a.headers, timeout=10)
    assert resp.status_code == 400 and "deeply" in resp.json()["error"]
    resp = a.post("drift", {"corrections": "none"})
    assert resp.status_code == 400 and "corrections" in resp.json()["error"]
    resp = httpx.get(f"{dp.url}/v1/nowhere", timeout=10)
    assert resp.status_code == 404 and "error" in resp.json()
    resp = httpx.delete(a.path("state"), headers=a.headers, timeout=10)
    assert resp.status_code == 405 and "error" in resp.json()
    # The server survived all of it.
    assert a.get("state").status_code == 200


def test_ping_and_artifacts(dp, pair, tmp_path):
    a, _ = pair
    assert httpx.get(f"{dp.url}/v1/ping", timeout=10).json() == {}
    artifact_dir = dp.db_path.with_name(dp.db_path.name + ".artifacts") / "1.2.3" / "linux"
    artifact_dir.mkdir(parents=True)
    (artifact_dir / "amd64").write_bytes(b"\x7fELF binary bytes")
    resp = httpx.get(f"{dp.url}/v1/artifacts/plexd/1.2.3/linux/amd64", headers=a.headers, timeout=10)
    assert resp.status_code == 200 and resp.content == b"\x7fELF binary bytes"
    assert httpx.get(f"{dp.url}/v1/artifacts/plexd/9.9.9/linux/amd64", headers=a.headers,
                     timeout=10).status_code == 404
    assert httpx.get(f"{dp.url}/v1/artifacts/plexd/1.2.3/linux/amd64", timeout=10).status_code == 401
    assert httpx.get(f"{dp.url}/v1/artifacts/plexd/..%2F..%2Fetc/linux/passwd", headers=a.headers,
                     timeout=10).status_code in (400, 404)


def test_admin_stores_artifacts_and_starts_upgrades_with_their_checksum(dp, pair):
    a, _ = pair
    stored = dp.admin.put_artifact("2.0.0", b"release bytes", arch="arm64")
    assert stored == {"path": "2.0.0/linux/arm64", "size": 13, "sha256": hashlib.sha256(b"release bytes").hexdigest()}
    resp = httpx.get(f"{dp.url}/v1/artifacts/plexd/2.0.0/linux/arm64", headers=a.headers, timeout=10)
    assert resp.content == b"release bytes"
    with pytest.raises(AdminError) as bad:
        dp.admin.put_artifact("..", b"x")
    assert bad.value.status in (400, 404)

    started = dp.admin.start_upgrade(a.id, "2.0.0")
    assert started["checksum"] == stored["sha256"]
    [request] = [e for e in dp.admin.executions(a.id) if e["execution_id"] == started["execution_id"]]
    assert request["action"] == "service.upgrade"
    assert request["parameters"] == {"version": "2.0.0", "checksum": stored["sha256"]}
    assert dp.admin.start_upgrade(a.id, "2.0.0", checksum="f" * 64)["checksum"] == "f" * 64  # sent as given
    with pytest.raises(AdminError, match=r"no single artifact for plexd 9\.9\.9"):
        dp.admin.start_upgrade(a.id, "9.9.9")


def test_deregister_removes_the_node(dp):
    a, b = register(dp), register(dp)
    resp = httpx.post(a.path("deregister"), headers=a.headers, timeout=10)  # no body, like the Go agent
    assert resp.status_code == 200
    assert a.id not in {n["id"] for n in dp.admin.nodes()}
    assert dp.admin.node(a.id)["status"] == "deregistered"
    assert a.id in {n["id"] for n in dp.admin.nodes(include_removed=True)}
    assert a.id not in {p["id"] for p in b.get("state").json()["peers"]}
    assert a.get("state").status_code == 401


def rejoin(a) -> httpx.Response:
    """Re-registration with the node secret: empty token, the same public key."""
    return httpx.post(f"{a.url}/v1/register", headers=a.headers, timeout=10,
                      json={"token": "", "public_key": a.public_key, "hostname": a.hostname})


def test_a_deregistered_node_rejoins_with_its_secret_as_the_same_node_until_purged_or_forgotten(dp):
    a, b, c = register(dp), register(dp), register(dp)
    assert a.post("deregister").status_code == 200
    assert register(dp).mesh_ip != a.mesh_ip  # its mesh IP stays reserved while it may come back
    back = rejoin(a)
    assert back.status_code == 201, back.text
    assert (back.json()["node_id"], back.json()["mesh_ip"]) == (a.id, a.mesh_ip)
    assert dp.admin.node(a.id)["status"] == "online"
    assert a.id in {p["id"] for p in b.get("state").json()["peers"]} and a.get("state").status_code == 200

    # a purge revokes the secret and frees the IP
    assert httpx.post(a.path("deregister") + "?purge=true", headers=a.headers, timeout=10).status_code == 200
    assert dp.admin.node(a.id)["status"] == "removed" and rejoin(a).status_code == 401
    # an admin's forget revokes a deregistered node's secret too
    assert b.post("deregister").status_code == 200
    dp.admin.forget_node(b.id)
    assert dp.admin.node(b.id)["status"] == "removed" and rejoin(b).status_code == 401
    # the devplane remembers across a restart which nodes may come back
    assert c.post("deregister").status_code == 200
    dp.restart()
    assert rejoin(c).status_code == 201 and dp.admin.node(c.id)["status"] == "online"


def test_admin_api_needs_the_admin_token(dp):
    resp = httpx.get(f"{dp.url}/admin/v1/nodes", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert resp.status_code == 401 and "admin" in resp.json()["error"]
    with pytest.raises(AdminError) as err:
        dp.admin.set_policies([{"id": "p", "rules": [{"src": "*", "dst": "*", "protocol": "gre"}]}])
    assert err.value.status == 400 and "policies[0].rules[0].protocol" in err.value.message
    with pytest.raises(AdminError) as err:
        dp.admin.node("n_missing")
    assert err.value.status == 404


def test_a_bridge_block_is_served_to_its_node_and_a_bad_one_refused(dp, readers):
    node = register(dp)
    stream = readers(node)
    block = {"relay": {"sessions": []}, "user_access": None}
    dp.admin.set_bridge(node.id, block)
    assert node.get("state").json()["bridge"] == block
    assert stream.events.get(timeout=10).event == "bridge_config_updated"
    with pytest.raises(AdminError, match="unknown member"):
        dp.admin.set_bridge(node.id, {"wormhole": {}})
    dp.admin.set_bridge(node.id, None)
    assert node.get("state").json()["bridge"] is None
