"""POST /v1/register in the platform dialect: the answer's shape, the bootstrap tokens, and every refusal in the
contract's order, over real HTTP."""

from __future__ import annotations

import base64
import re
import time
import uuid

import httpx
import nacl.signing
import pytest
from platform_helpers import assert_problem, new_key, register, register_body

from plexd.controlplane.platform_envelope import bearer
from plexd.devplane.harness import AdminError

TOKEN = re.compile(r"^psb_dev_([a-z2-7]+)_(node|bridge)_([a-z2-7]{20,})$")


def post(dp, body, **kw) -> httpx.Response:
    return httpx.post(f"{dp.url}/v1/register", json=body, timeout=10, **kw)


def test_tokens_carry_the_project_and_their_kind(platform_dp):
    project = platform_dp.admin.project_id()
    assert str(uuid.UUID(project)) == project
    segment = base64.b32encode(uuid.UUID(project).bytes).decode().rstrip("=").lower()
    for kind in ("node", "bridge"):
        info = platform_dp.admin.create_token_info(kind if kind == "bridge" else None)
        assert info["project_id"] == project and info["kind"] == kind
        m = TOKEN.match(info["token"])
        assert m and m.group(1) == segment and m.group(2) == kind, info
    assert platform_dp.admin.status()["dialect"] == "platform"


def test_registration_answers_the_identity(platform_dp):
    earlier = register(platform_dp)
    body = register_body(platform_dp, resource_handle="edge-router-01")
    resp = post(platform_dp, body)
    assert resp.status_code == 201, resp.text
    doc = resp.json()
    assert set(doc) == {"node_id", "mesh_ip", "signing_public_key", "signing_key_id", "nsk", "peer_snapshot",
                        "domain_mesh_cidr"}
    node = uuid.UUID(doc["node_id"])
    assert str(node) == doc["node_id"] and node.version == 7
    assert len(base64.b64decode(doc["nsk"], validate=True)) == 32
    nacl.signing.VerifyKey(base64.b64decode(doc["signing_public_key"], validate=True))  # a 32-byte Ed25519 key
    assert doc["signing_key_id"].startswith("did:web:devplane.invalid#key-")
    assert doc["domain_mesh_cidr"] == "10.100.0.0/16" and doc["mesh_ip"].startswith("10.100.")
    peers = {p["node_id"]: p for p in doc["peer_snapshot"]}
    assert peers[earlier.id] == {"node_id": earlier.id, "mesh_ip": earlier.mesh_ip, "public_key": earlier.public_key}
    assert [p["node_id"] for p in doc["peer_snapshot"]] == sorted(peers)
    shown = platform_dp.admin.node(doc["node_id"])
    assert shown["hostname"] == "edge-router-01" and shown["public_key"] == body["public_key"]
    # the registration request is sent without any Authorization; the bearer envelope works from then on
    resp = httpx.get(f"{platform_dp.url}/v1/nodes/{doc['node_id']}/state",
                     headers={"Authorization": "Bearer " + bearer(doc["node_id"], doc["nsk"])}, timeout=10)
    assert resp.status_code == 200


def test_the_older_resource_id_spelling_is_taken(platform_dp):
    body = register_body(platform_dp)
    body["resource_id"] = body.pop("resource_handle")
    resp = post(platform_dp, body)
    assert resp.status_code == 201, resp.text
    assert platform_dp.admin.node(resp.json()["node_id"])["hostname"] == body["resource_id"]


def test_a_body_that_is_not_json_is_400_without_a_code(platform_dp):
    resp = httpx.post(f"{platform_dp.url}/v1/register", content=b"{not json", timeout=10)
    assert_problem(resp, 400, None)
    assert_problem(post(platform_dp, ["an", "array"]), 400, None)
    assert_problem(post(platform_dp, register_body(platform_dp, nonce=5)), 400, None)


@pytest.mark.parametrize("field,value", [
    ("bootstrap_token", ""), ("nonce", ""), ("resource_handle", ""), ("resource_handle", "   "),
    ("project_id", ""), ("project_id", "00000000-0000-0000-0000-000000000000"), ("project_id", "not-a-uuid"),
    ("nonce", "n" * 4097),
])
def test_empty_or_bad_fields_are_422(platform_dp, field, value):
    body = register_body(platform_dp, **{field: value})
    assert_problem(post(platform_dp, body), 422, None)
    # nothing was spent: the same token still registers
    assert post(platform_dp, {**body, field: register_body(platform_dp)[field]}).status_code == 201


@pytest.mark.parametrize("key", ["", "short", "A" * 43 + "=", base64.b64encode(b"x" * 31).decode(),
                                 "!" * 43 + "="])
def test_a_bad_public_key_is_public_key_invalid(platform_dp, key):
    body = register_body(platform_dp, public_key=key)
    assert_problem(post(platform_dp, body), 400, "public_key_invalid")
    assert post(platform_dp, {**body, "public_key": new_key()}).status_code == 201  # the token was not spent


def test_token_refusals(platform_dp):
    admin = platform_dp.admin
    body = register_body(platform_dp)
    # not a platform token at all (the spec dialect's shape), or a token this devplane never issued
    assert_problem(post(platform_dp, {**body, "bootstrap_token": "plx_enroll_" + "ab" * 16}), 403, None)
    forged = body["bootstrap_token"][:-20] + "a" * 20
    assert_problem(post(platform_dp, {**body, "bootstrap_token": forged}), 403, None)
    # a bridge token cannot register a node
    bridge = admin.create_token("bridge")
    assert_problem(post(platform_dp, {**body, "bootstrap_token": bridge}), 403, "kind_mismatch")
    # revoked, expired, consumed
    revoked = admin.create_token()
    admin.revoke_token(revoked)
    assert_problem(post(platform_dp, {**body, "bootstrap_token": revoked}), 403, "token_revoked")
    expiring = admin.create_token_info(ttl_seconds=0.2)
    assert expiring["expires_at"]
    time.sleep(0.4)
    assert_problem(post(platform_dp, {**body, "bootstrap_token": expiring["token"]}), 403, "token_expired")
    assert post(platform_dp, body).status_code == 201
    again = register_body(platform_dp, bootstrap_token=body["bootstrap_token"])  # another key, another nonce
    assert_problem(post(platform_dp, again), 403, "token_consumed")
    with pytest.raises(AdminError) as err:
        admin.revoke_token("psb_dev_nothing_node_" + "a" * 20)
    assert err.value.status == 404


def test_a_project_that_is_not_the_tokens_is_project_mismatch(platform_dp):
    body = register_body(platform_dp, project_id=str(uuid.uuid4()))
    assert_problem(post(platform_dp, body), 403, "project_mismatch")
    assert post(platform_dp, {**body, "project_id": platform_dp.admin.project_id()}).status_code == 201


def test_a_nonce_is_refused_once_it_registered_a_node(platform_dp):
    first = register_body(platform_dp)
    assert post(platform_dp, first).status_code == 201
    other = register_body(platform_dp, nonce=first["nonce"])
    assert_problem(post(platform_dp, other), 403, "nonce_collision")
    # the refused registration spent nothing: its token works with a fresh nonce
    assert post(platform_dp, {**other, "nonce": str(uuid.uuid4())}).status_code == 201


def test_a_refused_registration_records_no_nonce(platform_dp):
    body = register_body(platform_dp, resource_handle="unknown-resource")
    assert_problem(post(platform_dp, body), 404, "resource_not_found")
    assert post(platform_dp, {**body, "resource_handle": "known"}).status_code == 201  # same nonce, same token


def test_the_same_token_and_key_again_get_the_same_identity(platform_dp):
    """The devplane's extension: a node killed between the answer and saving it asks again (its retry may reuse
    the nonce, or a restarted node brings a new one) and gets the same node, not token_consumed."""
    body = register_body(platform_dp)
    first = post(platform_dp, body).json()
    for nonce in (body["nonce"], str(uuid.uuid4())):
        again = post(platform_dp, {**body, "nonce": nonce})
        assert again.status_code == 201 and again.json() == first
    # another key with the spent token: consumed
    assert_problem(post(platform_dp, {**body, "public_key": new_key()}), 403, "token_consumed")
    # the repeat still checks the project
    assert_problem(post(platform_dp, {**body, "project_id": str(uuid.uuid4())}), 403, "project_mismatch")


def test_the_repeat_ends_when_the_node_is_forgotten(platform_dp):
    body = register_body(platform_dp)
    node = post(platform_dp, body).json()
    platform_dp.admin.forget_node(node["node_id"])
    assert_problem(post(platform_dp, {**body, "nonce": str(uuid.uuid4())}), 403, "token_consumed")


def test_a_public_key_of_another_node_is_refused(platform_dp):
    taken = register(platform_dp)
    assert_problem(post(platform_dp, register_body(platform_dp, public_key=taken.public_key)), 409,
                   "public_key_in_use")


def test_a_database_serves_the_dialect_it_was_made_with(fresh_platform_dp, tmp_path):
    from plexd.devplane.harness import Devplane

    fresh_platform_dp.stop()
    spec = Devplane(fresh_platform_dp.dir)  # the same --db, now asked for the spec dialect
    with pytest.raises(RuntimeError, match="serves the platform dialect"):
        spec.start()


def test_token_limits_hold_for_the_spec_dialect_too_which_is_otherwise_unchanged(dp):
    """The admin's token expiry and revocation are dialect-agnostic; nothing of the platform shows in spec mode."""
    admin = dp.admin
    assert "dialect" not in admin.status() and "project_id" not in admin.status()
    info = admin.create_token_info()
    assert set(info) == {"token"} and info["token"].startswith("plx_enroll_")
    revoked = admin.create_token()
    admin.revoke_token(revoked)
    body = {"token": revoked, "public_key": new_key(), "hostname": f"spec-{uuid.uuid4().hex[:6]}"}
    resp = httpx.post(f"{dp.url}/v1/register", json=body, timeout=10)
    assert resp.status_code == 401 and "revoked" in resp.json()["error"]
    expired = admin.create_token(ttl_seconds=0.1)
    time.sleep(0.3)
    resp = httpx.post(f"{dp.url}/v1/register", json={**body, "token": expired}, timeout=10)
    assert resp.status_code == 401 and "expired" in resp.json()["error"]
    with pytest.raises(AdminError) as err:
        admin.create_token("bridge")
    assert err.value.status == 400
    resp = httpx.get(f"{dp.url}/v1/health", timeout=10)
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json" and "error" in resp.json()
