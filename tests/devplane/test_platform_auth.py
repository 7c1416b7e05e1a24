"""The platform dialect's bearer envelope on every node route, its problem+json errors, the routes it does not
have, and the unauthenticated meta routes."""

from __future__ import annotations

import base64
import os

import httpx
import pytest
from platform_helpers import assert_problem, register

from plexd.controlplane.platform_envelope import bearer

# (method, path suffix, code when the path names another node)
ROUTES = [
    ("POST", "heartbeat", "node_id_mismatch"), ("GET", "state", "node_id_mismatch"),
    ("GET", "events", "node_id_mismatch"), ("PUT", "capabilities", "node_id_mismatch"),
    ("PUT", "endpoint", "node_id_mismatch"), ("POST", "integrity-violations", "node_id_mismatch"),
    ("GET", "secrets/token", "node_id_mismatch"), ("PUT", "state/reports/status.mesh", "node_id_mismatch"),
    ("DELETE", "state/reports/status.mesh", "node_id_mismatch"), ("POST", "metrics", "node_id_mismatch"),
    ("POST", "logs", "node_id_mismatch"), ("POST", "audit", "node_id_mismatch"),
    ("POST", "executions/e1", "nsk_node_mismatch"), ("POST", "sessions/s1", "nsk_node_mismatch"),
]


@pytest.fixture(scope="module")
def pair(platform_dp):
    return register(platform_dp), register(platform_dp)


@pytest.fixture(scope="module")
def forgotten(platform_dp):
    node = register(platform_dp)
    platform_dp.admin.forget_node(node.id)
    return node


@pytest.mark.parametrize("method,suffix,mismatch", ROUTES)
def test_every_node_route_needs_the_nodes_bearer_envelope(platform_dp, pair, forgotten, method, suffix, mismatch):
    a, b = pair
    url = a.path(suffix)
    unknown = bearer(a.id, base64.b64encode(os.urandom(32)).decode())
    for headers, code in [
        ({}, "unauthorized"),
        ({"Authorization": f"Bearer {a.nsk}"}, "unauthorized"),  # the raw NSK is never a bearer
        ({"Authorization": f"Basic {a.bearer}"}, "unauthorized"),
        ({"Authorization": "Bearer nsk_plexd_tooshort"}, "unauthorized"),
        ({"Authorization": "Bearer " + a.bearer.replace("nsk_", "psk_", 1)}, "unauthorized"),
        ({"Authorization": f"Bearer {unknown}"}, "nsk_invalid"),
        ({"Authorization": f"Bearer {forgotten.bearer}"}, "nsk_revoked"),
    ]:
        assert_problem(httpx.request(method, url, headers=headers, json={}, timeout=10), 401, code)
    # b's envelope on a's path: authenticated, but not a's
    assert_problem(httpx.request(method, url, headers=b.headers, json={}, timeout=10), 403, mismatch)


def test_any_env_tag_is_taken(pair):
    a, _ = pair
    resp = httpx.get(a.path("state"), headers={"Authorization": "Bearer " + bearer(a.id, a.nsk, env="e2e")},
                     timeout=10)
    assert resp.status_code == 200


def test_key_rotation_takes_the_node_from_the_bearer(platform_dp, forgotten):
    url = f"{platform_dp.url}/v1/keys/rotate"
    assert_problem(httpx.post(url, json={"new_public_key": "x"}, timeout=10), 401, "unauthorized")
    assert_problem(httpx.post(url, json={}, headers=forgotten.headers, timeout=10), 401, "nsk_revoked")


@pytest.mark.parametrize("method,suffix", [
    ("POST", "deregister"), ("POST", "drift"), ("POST", "report"), ("POST", "executions/e1/ack"),
    ("POST", "executions/e1/result"), ("POST", "tunnels/s1/ready"), ("POST", "tunnels/s1/closed"),
    ("POST", "integrity/violations"),
])
def test_the_spec_routes_are_not_there(pair, method, suffix):
    a, _ = pair
    assert_problem(httpx.request(method, a.path(suffix), headers=a.headers, json={}, timeout=10), 404, None)


def test_nor_are_ping_and_artifacts(platform_dp, pair):
    a, _ = pair
    for path in ("/v1/ping", "/v1/artifacts/plexd/1.0.0/linux/amd64"):
        assert_problem(httpx.get(platform_dp.url + path, headers=a.headers, timeout=10), 404, None)
    assert_problem(httpx.get(platform_dp.url + "/v1/register", timeout=10), 405, None)


def test_health_and_version_need_no_credentials(platform_dp):
    health = httpx.get(platform_dp.url + "/v1/health", timeout=10)
    assert health.status_code == 200 and health.headers["content-type"] == "application/json"
    doc = health.json()
    assert doc["status"] == "ok" and set(doc) == {"status", "checks"}
    assert all(set(c) == {"name", "status", "detail"} for c in doc["checks"])
    version = httpx.get(platform_dp.url + "/v1/version", timeout=10).json()
    assert set(version) == {"version", "commit", "date"} and version["version"]


def test_the_admin_api_keeps_its_own_errors(platform_dp):
    resp = httpx.get(platform_dp.url + "/admin/v1/status", timeout=10)
    assert resp.status_code == 401 and "error" in resp.json()
    resp = httpx.get(platform_dp.url + "/admin/v1/nodes/nope", timeout=10,
                     headers={"Authorization": f"Bearer {platform_dp.admin_token}"})
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json" and "error" in resp.json()


def test_injected_faults_are_problems_too(platform_dp, pair):
    a, _ = pair
    platform_dp.admin.set_faults(all_status=503)
    try:
        assert_problem(a.get("state"), 503, None)
    finally:
        platform_dp.admin.clear_faults()
    platform_dp.admin.set_faults(events_status=503, retry_after="3")
    try:
        assert_problem(a.get("events"), 503, "event_stream_unavailable")
    finally:
        platform_dp.admin.clear_faults()
