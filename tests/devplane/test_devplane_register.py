"""Registration over real HTTP: tokens, keys, hostnames, mesh IPs, node secrets, re-registration (§1.3)."""

from __future__ import annotations

import base64
import ipaddress
import os

import httpx
import pytest
from devplane_helpers import new_public_key, register


def _post(dp, body, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{dp.url}/v1/register", json=body, headers=headers, timeout=10)


def test_register_returns_identity_and_consumes_token(fresh_dp):
    dp = fresh_dp  # its first node: whatever order the module's tests run in
    token = dp.admin.create_token()
    key = new_public_key()
    resp = _post(dp, {"token": token, "public_key": key, "hostname": "reg-a", "metadata": {"env": "test"}}, token)
    assert resp.status_code == 201
    body = resp.json()
    assert set(body) == {"node_id", "mesh_ip", "signing_public_key", "node_secret_key", "peers"}
    assert body["node_id"].startswith("n_")
    assert ipaddress.ip_address(body["mesh_ip"]) in ipaddress.ip_network("10.100.0.0/16")
    assert not body["mesh_ip"].endswith((".0", ".255"))
    assert len(base64.b64decode(body["signing_public_key"], validate=True)) == 32
    secret = body["node_secret_key"]
    assert len(secret) == 32 and secret.isascii() and len(secret.encode()) == 32
    assert body["peers"] == []  # the first node of the deployment has nobody to see
    node = dp.admin.node(body["node_id"])
    assert node["hostname"] == "reg-a" and node["public_key"] == key and node["metadata"] == {"env": "test"}
    # The same token again: refused, whatever the hostname.
    again = _post(dp, {"token": token, "public_key": new_public_key(), "hostname": "reg-b"}, token)
    assert again.status_code == 401
    assert "already used" in again.json()["error"]
    # ... unless it is the same registration once more (same token, same key: a retry whose answer was lost on
    # the way): the same identity, so a node that timed out waiting does not lose its token and its registration
    retry = _post(dp, {"token": token, "public_key": key, "hostname": "reg-a", "metadata": {"env": "test"}}, token)
    assert retry.status_code in (200, 201)
    assert (retry.json()["node_id"], retry.json()["node_secret_key"]) == (body["node_id"], secret)
    assert len(dp.admin.nodes()) == 1


def test_unknown_and_missing_token_are_401(dp):
    resp = _post(dp, {"token": "plx_enroll_nope", "public_key": new_public_key(), "hostname": "x1"})
    assert resp.status_code == 401 and "unknown bootstrap token" in resp.json()["error"]
    resp = _post(dp, {"public_key": new_public_key(), "hostname": "x2"})
    assert resp.status_code == 401 and "token" in resp.json()["error"]


def test_token_only_in_bearer_header_is_accepted(dp):
    token = dp.admin.create_token()
    resp = _post(dp, {"token": "", "public_key": new_public_key(), "hostname": "bearer-only"}, token)
    assert resp.status_code == 201, resp.text


@pytest.mark.parametrize("key", [
    "", "not base64!", base64.b64encode(b"x" * 31).decode(), base64.b64encode(b"x" * 33).decode(),
    base64.urlsafe_b64encode(b"\xff" * 32).decode(), 12345,
])
def test_malformed_public_key_is_400_and_keeps_the_token(dp, key):
    token = dp.admin.create_token()
    resp = _post(dp, {"token": token, "public_key": key, "hostname": "badkey"}, token)
    assert resp.status_code == 400
    assert "public_key" in resp.json()["error"]
    # The token was not spent on a refused request.
    hostname = f"badkey-fixed-{os.urandom(4).hex()}"
    ok = _post(dp, {"token": token, "public_key": new_public_key(), "hostname": hostname}, token)
    assert ok.status_code == 201, ok.text


def test_duplicate_hostname_is_409(dp):
    first = register(dp, hostname="dup-host")
    token = dp.admin.create_token()
    resp = _post(dp, {"token": token, "public_key": new_public_key(), "hostname": "dup-host"}, token)
    assert resp.status_code == 409 and "dup-host" in resp.json()["error"]
    # Once the first one deregisters, the hostname is free again.
    assert first.post("deregister").status_code == 200
    assert _post(dp, {"token": token, "public_key": new_public_key(), "hostname": "dup-host"}, token).status_code == 201


def test_mesh_ips_are_unique_and_peers_listed(dp):
    nodes = [register(dp) for _ in range(3)]
    ips = [n.mesh_ip for n in nodes]
    assert len(set(ips)) == 3
    last = nodes[-1].response
    peer_ids = {p["id"] for p in last["peers"]}
    assert {nodes[0].id, nodes[1].id} <= peer_ids
    peer = next(p for p in last["peers"] if p["id"] == nodes[0].id)
    assert peer == {"id": nodes[0].id, "public_key": nodes[0].public_key, "mesh_ip": nodes[0].mesh_ip,
                    "endpoint": "", "allowed_ips": [f"{nodes[0].mesh_ip}/32"], "psk": ""}


def test_reregistration_with_node_secret_keeps_identity(dp):
    node = register(dp)
    resp = _post(dp, {"token": "", "public_key": node.public_key, "hostname": node.hostname}, node.secret)
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["node_id"] == node.id and body["mesh_ip"] == node.mesh_ip
    assert body["node_secret_key"] == node.secret
    assert body["signing_public_key"] == node.response["signing_public_key"]
    # Another public key with the same secret is refused: that is a different machine.
    other = _post(dp, {"token": "", "public_key": new_public_key(), "hostname": node.hostname}, node.secret)
    assert other.status_code == 409


def test_forgotten_node_secret_is_refused_then_fresh_registration_works(dp):
    node = register(dp)
    dp.admin.forget_node(node.id)
    assert node.post("heartbeat", {}).status_code == 401
    resp = _post(dp, {"token": "", "public_key": node.public_key, "hostname": node.hostname}, node.secret)
    assert resp.status_code == 401
    again = register(dp, hostname=node.hostname, public_key=node.public_key)
    assert again.id != node.id


def test_released_ip_is_not_reused_during_cooldown(dp):
    node = register(dp)
    assert node.post("deregister").status_code == 200
    later = [register(dp) for _ in range(2)]
    assert node.mesh_ip not in {n.mesh_ip for n in later}


def test_register_wrong_types_name_the_field(dp):
    token = dp.admin.create_token()
    resp = _post(dp, {"token": token, "public_key": new_public_key(), "hostname": 7}, token)
    assert resp.status_code == 400 and resp.json()["error"].startswith("hostname:")
    resp = _post(dp, {"token": token, "public_key": new_public_key(), "hostname": "h", "metadata": {"k": True}}, token)
    assert resp.status_code == 400 and "metadata.k" in resp.json()["error"]
    resp = httpx.post(f"{dp.url}/v1/register", content=b"[1,2]", timeout=10)
    assert resp.status_code == 400 and "object" in resp.json()["error"]
    resp = _post(dp, {"token": token, "public_key": new_public_key(), "hostname": ""}, token)
    assert resp.status_code == 400 and "hostname" in resp.json()["error"]
