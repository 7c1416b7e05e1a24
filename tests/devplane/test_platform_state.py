"""The platform dialect's heartbeat and state snapshot: shapes, refusals, flags, the eight blocks translated from
the deployment's model, and the ETag."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import timedelta

import pytest
from platform_helpers import assert_problem, digest, heartbeat_body, register

from plexd.base import gojson

BLOCKS = {"peers", "reachability", "policy", "bridge", "state", "reports", "executions", "sessions"}


# -- heartbeat ---------------------------------------------------------------------------------------------------

def test_a_heartbeat_is_accepted_and_recorded(platform_dp):
    node = register(platform_dp)
    body = heartbeat_body(nat_summary={"endpoint": "203.0.113.7:51820", "nat_type": "port_restricted"})
    resp = node.post("heartbeat", body)
    assert resp.status_code == 200
    doc = resp.json()
    assert set(doc) == {"accepted_at", "reconcile", "rotate_keys"} and gojson.parse_time(doc["accepted_at"])
    assert doc["reconcile"] is False and doc["rotate_keys"] is False
    assert platform_dp.admin.heartbeats(node.id) == [body]
    shown = platform_dp.admin.node(node.id)
    assert shown["nat_type"] == "port_restricted" and shown["last_heartbeat"] == body


def test_reconcile_is_one_shot_and_rotate_keys_stays_until_done(platform_dp):
    node = register(platform_dp)
    platform_dp.admin.request_heartbeat_flags(node.id, reconcile=True, rotate_keys=True)
    flags = node.heartbeat().json()
    assert flags["reconcile"] is True and flags["rotate_keys"] is True
    flags = node.heartbeat().json()
    assert flags["reconcile"] is False and flags["rotate_keys"] is True  # pending until the node rotates


@pytest.mark.parametrize("fields,code", [
    ({"extra": 1}, "malformed_heartbeat_request"),
    ({"nat_summary": None}, "malformed_heartbeat_request"),
    ({"nat_summary": {"endpoint": "203.0.113.7:51820"}}, "malformed_heartbeat_request"),
    ({"nat_summary": {"endpoint": "203.0.113.7:51820", "nat_type": "none"}}, "malformed_heartbeat_request"),
    ({"nat_summary": {"endpoint": "203.0.113.7:51820", "nat_type": "symmetric", "x": 1}},
     "malformed_heartbeat_request"),
    ({"client_now": "yesterday"}, "malformed_heartbeat_request"),
    ({"binary_version": 3}, "malformed_heartbeat_request"),
    # times taken when the test runs, not at collection (a +90 s taken then is within the skew a minute later)
    (lambda: {"client_now": gojson.format_time(gojson.now_utc() - timedelta(seconds=90))}, "clock_skew"),
    (lambda: {"client_now": gojson.format_time(gojson.now_utc() + timedelta(seconds=90))}, "clock_skew"),
    ({"binary_checksum": "ab" * 32}, "binary_checksum_empty"),  # hex: only base64 is the platform's form
    ({"binary_checksum": ""}, "binary_checksum_empty"),
    ({"binary_version": "  "}, "binary_version_empty"),
])
def test_heartbeat_refusals(platform_dp, fields, code):
    node = register(platform_dp)
    fields = fields() if callable(fields) else fields
    assert_problem(node.post("heartbeat", heartbeat_body(**fields)), 400, code)
    assert platform_dp.admin.heartbeats(node.id) == []


def test_a_heartbeat_missing_a_field(platform_dp):
    node = register(platform_dp)
    for field, code in (("nat_summary", "malformed_heartbeat_request"), ("client_now", "clock_skew"),
                        ("binary_checksum", "binary_checksum_empty"), ("binary_version", "binary_version_empty")):
        body = heartbeat_body()
        del body[field]
        assert_problem(node.post("heartbeat", body), 400, code)


# -- the snapshot ------------------------------------------------------------------------------------------------

def test_the_snapshot_has_eight_blocks(platform_dp):
    node = register(platform_dp)
    doc = node.state()
    assert set(doc) == BLOCKS
    assert doc["reachability"] == {"state": "never_reported", "changed_at": platform_dp.admin.node(node.id)[
        "registered_at"]}
    assert doc["bridge"] is None and doc["executions"] == [] and doc["sessions"] == []
    assert doc["state"] == doc["reports"] == {"metadata": [], "data": [], "reports": []}
    node.heartbeat()
    reach = node.state()["reachability"]
    assert reach["state"] == "healthy" and gojson.parse_time(reach["changed_at"])


def test_peers_are_sorted_and_carry_the_endpoint_to_use(platform_dp):
    node, a, b = register(platform_dp), register(platform_dp), register(platform_dp)
    platform_dp.admin.set_node_endpoint(a.id, "203.0.113.10:51820")
    peers = {p["node_id"]: p for p in node.state()["peers"]}
    assert [p for p in peers] == sorted(peers) and node.id not in peers
    assert peers[a.id] == {"node_id": a.id, "mesh_ip": a.mesh_ip, "public_key": a.public_key,
                           "fallback_endpoint": "203.0.113.10:51820"}
    assert peers[b.id] == {"node_id": b.id, "mesh_ip": b.mesh_ip, "public_key": b.public_key}
    # a relay carrying the pair wins over the peer's own endpoint
    bridge = register(platform_dp)
    relay = {"endpoint": "198.51.100.1:51821", "sessions": [{
        "session_id": "rel_1", "peer_a_id": node.id, "peer_a_endpoint": "203.0.113.5:51820",
        "peer_b_id": a.id, "peer_b_endpoint": "203.0.113.10:51820", "expires_at": "2999-01-01T00:00:00Z"}]}
    platform_dp.admin.set_bridge(bridge.id, {"relay": relay})
    peers = {p["node_id"]: p for p in node.state()["peers"]}
    assert peers[a.id]["fallback_endpoint"] == "198.51.100.1:51821"
    block = bridge.state()["bridge"]
    assert block == {"relay": {"sessions": relay["sessions"]}, "user_access": None, "ingress": None,
                     "site_to_site": None}  # the devplane's relay.endpoint note is its own
    platform_dp.admin.set_bridge(bridge.id, None)


def test_an_endpoint_report_becomes_the_peers_fallback(platform_dp):
    node, other = register(platform_dp), register(platform_dp)
    resp = node.put("endpoint", {"endpoint": "198.51.100.23:40000", "nat_type": "full_cone",
                                 "reported_at": gojson.now_text()})
    assert resp.status_code == 200
    doc = resp.json()
    assert set(doc) == {"accepted_at", "stale_after"}
    assert gojson.parse_time(doc["stale_after"]) > gojson.parse_time(doc["accepted_at"])
    peer = next(p for p in other.state()["peers"] if p["node_id"] == node.id)
    assert peer["fallback_endpoint"] == "198.51.100.23:40000"


def test_metadata_data_and_reports_are_key_sorted_entries(platform_dp):
    node = register(platform_dp)
    platform_dp.admin.set_metadata(node.id, {"zone": "b", "env": "prod"})
    platform_dp.admin.set_data(node.id, "app/config", "application/json", {"log_level": "info", "n": [1, 2]})
    platform_dp.admin.set_data(node.id, "a/first", "text/plain", "hello")
    node.put("state/reports/status.mesh", {"value": '{"peer_count":1}'})
    node.put("state/reports/app.tagged", {"value": "v", "workload_tag": "web"})
    doc = node.state()
    assert doc["state"] == doc["reports"]
    assert doc["state"]["metadata"] == [{"key": "env", "value": "prod"}, {"key": "zone", "value": "b"}]
    assert doc["state"]["data"] == [{"key": "a/first", "value": '"hello"'},
                                    {"key": "app/config", "value": '{"log_level":"info","n":[1,2]}'}]
    assert doc["state"]["reports"] == [{"key": "app.tagged", "value": "v", "workload_tag": "web"},
                                       {"key": "status.mesh", "value": '{"peer_count":1}'}]


def test_sessions_are_the_spec_block(platform_dp):
    node = register(platform_dp)
    created = platform_dp.admin.create_session(node.id, "ssh", 300, user="deploy",
                                               allowed_commands=["systemctl status nginx"])
    sessions = node.state()["sessions"]
    assert len(sessions) == 1
    s = sessions[0]
    assert s["session_id"] == s["jti"] == created["session"]["session_id"] and s["kind"] == "ssh"
    assert s["target"] == {"ssh": {"user": "deploy", "allowed_commands": ["systemctl status nginx"]}}
    platform_dp.admin.revoke_session(node.id, s["session_id"])
    assert node.state()["sessions"] == []


def test_the_etag_answers_304_until_something_changes(platform_dp):
    node = register(platform_dp)
    node.heartbeat()
    first = node.get("state")
    etag = first.headers["etag"]
    again = node.get("state", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    node.heartbeat()  # a beat changes nothing the node is told
    assert node.get("state", headers={"If-None-Match": etag}).status_code == 304
    platform_dp.admin.set_metadata(node.id, {"k": "v"})
    changed = node.get("state", headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag


# -- policy --------------------------------------------------------------------------------------------------------

def test_the_policies_are_one_flat_rule_list(fresh_platform_dp):
    dp = fresh_platform_dp
    a, b = register(dp), register(dp)
    default = a.state()["policy"]
    assert default["rules"] == [{"action": "allow", "protocol": "any", "source_cidr": "0.0.0.0/0",
                                 "destination_cidr": "0.0.0.0/0"}]
    assert len(base64.b64decode(default["fingerprint"])) == 32 and default["revision_id"]
    dp.admin.set_policies([
        {"id": "web", "rules": [
            {"src": a.id, "dst": b.id, "port": 443, "protocol": "tcp", "action": "allow"},
            {"src": "*", "dst": b.id, "port": 53, "protocol": "", "action": "allow"},
            {"src": "10.100.0.0/24", "dst": "*", "port": 0, "protocol": "icmp", "action": "allow"},
            {"src": "*", "dst": "*", "port": 0, "protocol": "udp", "action": "deny"}]},
        {"id": "ghost", "rules": [{"src": "n_gone", "dst": "*", "action": "allow"}]},
    ])
    policy = a.state()["policy"]
    assert policy["rules"] == [
        {"action": "allow", "protocol": "tcp", "source_cidr": f"{a.mesh_ip}/32",
         "destination_cidr": f"{b.mesh_ip}/32", "ports": {"from": 443, "to": 443}},
        {"action": "allow", "protocol": "tcp", "source_cidr": "0.0.0.0/0", "destination_cidr": f"{b.mesh_ip}/32",
         "ports": {"from": 53, "to": 53}},
        {"action": "allow", "protocol": "udp", "source_cidr": "0.0.0.0/0", "destination_cidr": f"{b.mesh_ip}/32",
         "ports": {"from": 53, "to": 53}},
        {"action": "allow", "protocol": "icmp", "source_cidr": "10.100.0.0/24", "destination_cidr": "0.0.0.0/0"},
        {"action": "deny", "protocol": "udp", "source_cidr": "0.0.0.0/0", "destination_cidr": "0.0.0.0/0",
         "ports": {"from": 1, "to": 65535}},
    ]
    assert policy["fingerprint"] != default["fingerprint"] and policy["revision_id"] != default["revision_id"]
    assert b.state()["policy"] == policy
    canonical = json.dumps(policy["rules"], sort_keys=True, separators=(",", ":")).encode()
    assert base64.b64decode(policy["fingerprint"]) == hashlib.sha256(canonical).digest()
    dp.admin.set_policies([])
    assert a.state()["policy"] is None and a.state()["peers"] == []  # no rules: no peers, as in the spec


def test_capabilities_feed_nothing_into_the_state(platform_dp):
    node = register(platform_dp)
    before = node.get("state").headers["etag"]
    assert node.put("capabilities", {"binary_version": "1", "binary_checksum": digest()}).status_code == 200
    assert node.get("state").headers["etag"] == before
