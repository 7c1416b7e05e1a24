"""What a node tells the platform-dialect devplane (capabilities, integrity violations, state reports, endpoint,
session activity, telemetry) and what it asks (secrets, a key rotation): shapes, refusals, what is kept."""

from __future__ import annotations

import base64
import gzip
import json
from datetime import timedelta

import httpx
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from platform_helpers import assert_problem, digest, new_key, register

from plexd.base import gojson


@pytest.fixture(scope="module")
def node(platform_dp):
    return register(platform_dp)


# -- capabilities --------------------------------------------------------------------------------------------------

def test_capabilities_are_kept(platform_dp, node):
    manifest = {"binary_version": "1.2.3", "binary_checksum": digest(),
                "ssh_host_key_fingerprint": "SHA256:6QGz1Q4iE2zG5p2N3oRZb8ZsT4nKqJgY3oZmP8eFvWk",
                "declared_hooks": [{"name": "post-install", "checksum": digest()}]}
    resp = node.put("capabilities", manifest)
    assert resp.status_code == 200
    assert resp.json()["fields_changed"] == sorted(manifest) and resp.json()["host_key_changed"] is True
    assert platform_dp.admin.capabilities(node.id)[-1] == manifest
    assert platform_dp.admin.node(node.id)["capabilities"] == manifest
    again = node.put("capabilities", manifest).json()
    assert again["fields_changed"] == [] and again["host_key_changed"] is False  # an idempotent PUT: no diff
    changed = node.put("capabilities", {"binary_version": "1", "binary_checksum": manifest["binary_checksum"]})
    assert changed.status_code == 200
    assert changed.json()["fields_changed"] == ["binary_version", "declared_hooks", "ssh_host_key_fingerprint"]
    assert changed.json()["host_key_changed"] is True  # out of the set state counts too


@pytest.mark.parametrize("change,code", [
    ({"builtin_actions": []}, "malformed_capabilities_request"),
    ({"binary": {"version": "1"}}, "malformed_capabilities_request"),
    ({"declared_hooks": "x"}, "malformed_capabilities_request"),
    ({"binary_version": " "}, "binary_version_empty"),
    ({"binary_checksum": "ab" * 32}, "binary_checksum_invalid"),
    ({"ssh_host_key_fingerprint": "MD5:aa"}, "ssh_host_key_fingerprint_invalid"),
    ({"declared_hooks": [{"name": "", "checksum": "x"}]}, "declared_hook_invalid"),
    ({"declared_hooks": [{"name": "a", "checksum": "x"}]}, "declared_hook_invalid"),
    ({"declared_hooks": [{"name": "a", "checksum": "c" * 43 + "=", "extra": 1}]}, "malformed_capabilities_request"),
    ({"declared_hooks": [{"name": "a", "checksum": "c" * 43 + "="}] * 2}, "declared_hook_duplicate"),
    ({"declared_hooks": [{"name": f"h{i}", "checksum": "c" * 43 + "="} for i in range(129)]},
     "declared_hooks_too_many"),
])
def test_capability_refusals(node, change, code):
    body = {"binary_version": "1", "binary_checksum": digest(), **change}
    assert_problem(node.put("capabilities", body), 400, code)


def test_a_capability_body_over_32_kib_is_413(node):
    resp = httpx.put(node.path("capabilities"), content=b" " * (33 * 1024), headers=node.headers, timeout=10)
    assert_problem(resp, 413, "capabilities_body_too_large")


# -- integrity violations ----------------------------------------------------------------------------------------

def violation(**fields):
    return {"kind": "binary_checksum", "detected_by": "startup_scan", "artifact_id": "/usr/local/bin/plexd",
            "observed_checksum": digest(), **fields}


def test_integrity_violations_are_counted_and_kept(platform_dp, node):
    body = {"violations": [violation(expected_checksum=digest()),
                           {"kind": "ssh_host_key", "detected_by": "inotify", "artifact_id": "ssh_host_ed25519_key.pub",
                            "observed_fingerprint": "SHA256:6QGz", "expected_fingerprint": "SHA256:7QGz"}]}
    resp = node.post("integrity-violations", body)
    assert resp.status_code == 200
    doc = resp.json()
    assert set(doc) == {"accepted_at", "violation_count"} and doc["violation_count"] == 2
    assert platform_dp.admin.integrity(node.id)[-1] == body


@pytest.mark.parametrize("violations,code", [
    ([], "integrity_violations_empty"),
    ([violation()] * 129, "integrity_violations_too_many"),
    ([violation(kind="rootkit")], "integrity_violation_kind_invalid"),
    ([violation(detected_by="cron")], "integrity_violation_detected_by_invalid"),
    ([violation(artifact_id="")], "integrity_violation_artifact_id_empty"),
    ([violation(observed_checksum="ab" * 32)], "integrity_violation_checksum_invalid"),
    ([violation(observed_fingerprint="SHA256:x")], "integrity_violation_kind_mismatch"),
    ([{"kind": "ssh_host_key", "detected_by": "inotify", "artifact_id": "k", "observed_fingerprint": "nope"}],
     "integrity_violation_host_key_fingerprint_invalid"),
    ([{"kind": "ssh_host_key", "detected_by": "inotify", "artifact_id": "k", "observed_checksum": digest()}],
     "integrity_violation_kind_mismatch"),
    ([violation(detail="free text")], "malformed_integrity_violations_request"),
])
def test_integrity_refusals(node, violations, code):
    assert_problem(node.post("integrity-violations", {"violations": violations}), 400, code)


def test_integrity_body_shape_and_size(node):
    assert_problem(node.post("integrity-violations", {"violation": []}), 400, "malformed_integrity_violations_request")
    resp = httpx.post(node.path("integrity-violations"), content=b" " * (33 * 1024), headers=node.headers,
                      timeout=10)
    assert_problem(resp, 413, "integrity_violations_body_too_large")


# -- state reports -------------------------------------------------------------------------------------------------

def test_reports_are_put_and_deleted_per_key(platform_dp, node):
    resp = node.put("state/reports/status.mesh", {"value": '{"interface":"plexd0"}'})
    assert resp.status_code == 200
    doc = resp.json()
    assert set(doc) == {"accepted_at", "key"} and doc["key"] == "status.mesh"
    assert {"key": "status.mesh", "value": '{"interface":"plexd0"}'} in node.state()["reports"]["reports"]
    entries = {e["key"]: e for e in platform_dp.admin.report_entries(node.id)}
    assert entries["status.mesh"]["value"] == '{"interface":"plexd0"}'
    resp = node.delete("state/reports/status.mesh")
    assert resp.status_code == 204 and resp.content == b""
    assert "status.mesh" not in {e["key"] for e in node.state()["state"]["reports"]}
    assert_problem(node.delete("state/reports/status.mesh"), 404, "report_not_found")
    kinds = [("put" if r["entries"] else "delete") for r in platform_dp.admin.reports(node.id)]
    assert kinds[-2:] == ["put", "delete"]


@pytest.mark.parametrize("key,body", [
    ("Status.mesh", {"value": "x"}), ("9lives", {"value": "x"}), ("a" * 129, {"value": "x"}),
    ("ok.key", {"value": "x" * 4097}), ("ok.key", {"value": 5}), ("ok.key", {}),
    ("ok.key", {"value": "x", "content_type": "text/plain"}),
])
def test_report_refusals(node, key, body):
    assert_problem(node.put(f"state/reports/{key}", body), 400, "invalid_report")


def test_reports_can_be_descoped(platform_dp, node):
    platform_dp.admin.set_faults(reports_not_provisioned=True)
    try:
        assert_problem(node.put("state/reports/status.mesh", {"value": "x"}), 501, "reports_not_provisioned")
        assert_problem(node.delete("state/reports/status.mesh"), 501, "reports_not_provisioned")
    finally:
        platform_dp.admin.clear_faults()


# -- endpoint ------------------------------------------------------------------------------------------------------

NOW = object()  # stands for the time the test runs


@pytest.mark.parametrize("body,code", [
    ({"endpoint": "203.0.113.1:51820", "nat_type": "none", "reported_at": "now"}, "malformed_endpoint_request"),
    ({"endpoint": "203.0.113.1:51820", "nat_type": "unknown"}, "malformed_endpoint_request"),
    ({"public_endpoint": "203.0.113.1:51820", "nat_type": "unknown", "reported_at": NOW},
     "malformed_endpoint_request"),
    ({"endpoint": "203.0.113.1:51820", "nat_type": "unknown",
      "reported_at": gojson.format_time(gojson.now_utc() - timedelta(minutes=5))}, "endpoint_clock_skew"),
    ({"endpoint": "127.0.0.1:51820", "nat_type": "unknown", "reported_at": NOW},
     "endpoint_unparseable"),
    ({"endpoint": "host.example:51820", "nat_type": "unknown", "reported_at": NOW},
     "endpoint_unparseable"),
    ({"endpoint": "203.0.113.1:0", "nat_type": "unknown", "reported_at": NOW},
     "endpoint_unparseable"),
])
def test_endpoint_refusals(node, body, code):
    # "now" is taken when the test runs: a time taken at collection is minutes old in a long run (clock skew)
    body = {k: gojson.now_text() if v is NOW else v for k, v in body.items()}
    assert_problem(node.put("endpoint", body), 400, code)


def test_an_ipv6_endpoint_is_bracketed(platform_dp, node):
    resp = node.put("endpoint", {"endpoint": "[2001:db8::1]:51820", "nat_type": "unknown",
                                 "reported_at": gojson.now_text()})
    assert resp.status_code == 200
    assert platform_dp.admin.node(node.id)["endpoint"] == "[2001:db8::1]:51820"


# -- secrets -------------------------------------------------------------------------------------------------------

def test_a_secret_is_sealed_with_the_nsk(platform_dp, node):
    version = platform_dp.admin.set_secret(node.id, "db-password", "hunter2")
    resp = node.get("secrets/db-password")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/octet-stream"
    assert resp.headers["x-plexsphere-secret-version"] == str(version)
    assert resp.headers["x-plexsphere-secret-kid"] and resp.headers["cache-control"] == "no-store"
    sealed = resp.content
    key = base64.b64decode(node.nsk)
    assert AESGCM(key).decrypt(sealed[:12], sealed[12:], None) == b"hunter2"
    assert len(sealed) == 12 + len(b"hunter2") + 16
    assert node.get(f"secrets/db-password?version={version}").status_code == 200
    assert_problem(node.get("secrets/db-password?version=99"), 404, "secret_version_not_found")
    assert_problem(node.get("secrets/nothing"), 404, "secret_not_found")


# -- key rotation --------------------------------------------------------------------------------------------------

def rotate(dp, node, key):
    return httpx.post(f"{dp.url}/v1/keys/rotate", json={"new_public_key": key}, headers=node.headers, timeout=10)


def test_a_key_rotation_needs_arming_and_is_idempotent(platform_dp):
    node, peer = register(platform_dp), register(platform_dp)
    new = new_key()
    assert_problem(rotate(platform_dp, node, new), 409, "keys_rotate_no_pending_rotation")
    assert_problem(rotate(platform_dp, node, node.public_key), 422, "keys_rotate_public_key_unchanged")
    platform_dp.admin.request_key_rotation(node.id)
    assert node.heartbeat().json()["rotate_keys"] is True
    resp = rotate(platform_dp, node, new)
    assert resp.status_code == 200
    receipt = resp.json()
    assert set(receipt) == {"rotation_id", "kid", "wrap_key_version"} and receipt["wrap_key_version"] == 1
    assert node.heartbeat().json()["rotate_keys"] is False
    seen = next(p for p in peer.state()["peers"] if p["node_id"] == node.id)
    assert seen["public_key"] == new
    # the answer was lost: the same call again gets the same receipt, and changes nothing
    assert rotate(platform_dp, node, new).json() == receipt
    # the next rotation needs arming again
    assert_problem(rotate(platform_dp, node, new_key()), 409, "keys_rotate_no_pending_rotation")
    platform_dp.admin.request_heartbeat_flags(node.id, rotate_keys=True)  # the heartbeat flag arms it too
    second = rotate(platform_dp, node, new_key()).json()
    assert second["wrap_key_version"] == 2 and second["rotation_id"] != receipt["rotation_id"]


@pytest.mark.parametrize("body,status,code", [
    ({"new_public_key": "short"}, 422, "keys_rotate_public_key_invalid"),
    ({"new_public_key": "A" * 43 + "="}, 422, "keys_rotate_public_key_invalid"),
    ({"new_public_key": new_key(), "node_id": "x"}, 400, "malformed_keys_rotate_request"),
    ({}, 422, "keys_rotate_public_key_invalid"),
])
def test_key_rotation_refusals(platform_dp, node, body, status, code):
    resp = httpx.post(f"{platform_dp.url}/v1/keys/rotate", json=body, headers=node.headers, timeout=10)
    assert_problem(resp, status, code)


def test_another_nodes_key_is_refused(platform_dp):
    node, other = register(platform_dp), register(platform_dp)
    platform_dp.admin.request_key_rotation(node.id)
    assert_problem(rotate(platform_dp, node, other.public_key), 422, "keys_rotate_public_key_invalid")
    resp = httpx.post(f"{platform_dp.url}/v1/keys/rotate", content=b" " * 5000, headers=node.headers, timeout=10)
    assert_problem(resp, 413, "keys_rotate_body_too_large")


# -- session activity --------------------------------------------------------------------------------------------

def test_session_activity_is_recorded(platform_dp, node):
    sid = platform_dp.admin.create_session(node.id, "tcp", 60, host="127.0.0.1", port=5432)["session"]["session_id"]
    activity = {"tcp": {"phase": "session_started", "target_host": "127.0.0.1", "target_port": 5432,
                        "listener_endpoint": f"{node.mesh_ip}:40511"}}
    resp = node.post(f"sessions/{sid}", activity)
    assert resp.status_code == 204 and resp.content == b""
    assert platform_dp.admin.session_activity(node.id)[-1] == {"session_id": sid, **activity}
    assert_problem(node.post("sessions/ses_nope", activity), 404, "session_not_found")
    assert_problem(node.post(f"sessions/{sid}", {"ssh": {}, "tcp": {}}), 400, "malformed_session_activity")


# -- telemetry -----------------------------------------------------------------------------------------------------

SENT = {"X-Plexsphere-Sent-At": "2026-07-19T19:32:35.123456789Z"}


def test_metrics_are_accepted_and_kept(platform_dp, node):
    batch = [{"group": "node_resources", "name": "cpu", "value": 0.5, "labels": {"core": "0"},
              "timestamp": gojson.now_text()},
             {"group": "peer_latency", "name": "rtt_ms", "value": 3, "timestamp": gojson.now_text()}]
    resp = node.post("metrics", batch, headers=SENT)
    assert resp.status_code == 202
    doc = resp.json()
    assert set(doc) == {"accepted_at", "records"} and doc["records"] == 2
    assert platform_dp.admin.metrics(node.id)[-2:] == batch
    gz = gzip.compress(json.dumps(batch).encode())
    resp = httpx.post(node.path("metrics"), content=gz, timeout=10,
                      headers={**node.headers, **SENT, "Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert resp.status_code == 202


def test_logs_and_audit_are_ndjson(platform_dp, node):
    lines = [{"severity": "info", "unit": "plexd.service", "message": "up", "timestamp": gojson.now_text()},
             {"severity": "error", "message": "boom", "timestamp": gojson.now_text()}]
    body = "\n".join(json.dumps(x) for x in lines).encode() + b"\n"
    resp = httpx.post(node.path("logs"), content=body, headers={**node.headers, **SENT}, timeout=10)
    assert resp.status_code == 202 and resp.json()["records"] == 2
    assert platform_dp.admin.logs(node.id)[-2:] == lines
    event = {"source": "auditd", "action": "execve", "outcome": "success", "timestamp": gojson.now_text()}
    resp = httpx.post(node.path("audit"), content=gzip.compress(json.dumps(event).encode()), timeout=10,
                      headers={**node.headers, **SENT, "Content-Encoding": "gzip"})
    assert resp.status_code == 202 and resp.json()["records"] == 1
    assert platform_dp.admin.audit(node.id)[-1] == event


@pytest.mark.parametrize("route,content,headers,status,code", [
    ("metrics", b"[]", SENT, 400, "ingest_batch_malformed"),
    ("metrics", b'[{"group":"disk","name":"x","value":1,"timestamp":"2026-01-01T00:00:00Z"}]', SENT, 400,
     "ingest_batch_malformed"),
    ("metrics", b'[{"group":"agent_stats","name":"x","value":1,"timestamp":"2026-01-01T00:00:00Z"}]', {}, 400,
     "ingest_sent_at_invalid"),
    ("logs", b'{"severity":"info"}\n', SENT, 400, "ingest_batch_malformed"),
    ("logs", b"not json\n", SENT, 400, "ingest_batch_malformed"),
    ("audit", b'{"source":"syslog","action":"a","outcome":"o","timestamp":"2026-01-01T00:00:00Z"}', SENT, 400,
     "ingest_batch_malformed"),
    ("audit", b"x", {**SENT, "Content-Encoding": "br"}, 415, "ingest_encoding_unsupported"),
])
def test_ingest_refusals(node, route, content, headers, status, code):
    resp = httpx.post(node.path(route), content=content, headers={**node.headers, **headers}, timeout=10)
    assert_problem(resp, status, code)


def test_ingest_can_be_descoped(platform_dp, node):
    platform_dp.admin.set_faults(ingest_not_provisioned=True)
    try:
        resp = node.post("metrics", [], headers=SENT)
        assert_problem(resp, 501, "observability_ingest_not_provisioned")
    finally:
        platform_dp.admin.clear_faults()


def test_only_the_ingest_routes_read_gzip(node):
    body = gzip.compress(json.dumps({"value": "x"}).encode())
    resp = httpx.put(node.path("state/reports/gz.key"), content=body, timeout=10,
                     headers={**node.headers, "Content-Encoding": "gzip"})
    assert_problem(resp, 400, "invalid_report")
