"""`POST /v1/register` in the platform dialect: checks in the contract's order, then the Deployment's enrollment.

Order (each failure leaves the token unspent): JSON (400) → required fields (422) → public key (400
public_key_invalid) → the token (403: malformed, kind_mismatch, unknown, token_revoked, token_expired,
token_consumed) → project (403 project_mismatch) → nonce (403 nonce_collision) → resource (404
resource_not_found, for the handle `unknown-resource`) → mesh IP (503 pool_exhausted) → 201.

`(project_id, nonce)` is recorded only on success. The devplane's one extension: the same token and public key
again within 5 minutes (a node killed between the answer and saving it) get the same identity, whatever the
nonce, instead of token_consumed.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import Any

from plexd.base.log import fingerprint
from plexd.devplane import platform_tokens
from plexd.devplane.deployment import MESH_NETWORK, Deployment
from plexd.devplane.platform_events import key_id
from plexd.devplane.platform_state import peers
from plexd.devplane.platform_wire import Problem, canonical_uuid, is_wireguard_key, uuid7
from plexd.devplane.store import Node
from plexd.devplane.wire import DevplaneAPIError

log = logging.getLogger(__name__)

MAX_FIELD = 4096
UNKNOWN_RESOURCE = "unknown-resource"  # the reference mock's handle for a resource the platform does not know
_STRINGS = ("project_id", "resource_handle", "resource_id", "bootstrap_token", "nonce", "public_key",
            "requested_resource_id")


def _fields(body: Any) -> dict[str, str]:
    """The request's string fields (400 when the body is not an object of strings); `resource_id` is the older
    spelling of `resource_handle`."""
    if not isinstance(body, dict):
        raise Problem(400, "", "body: must be a JSON object")
    out = {}
    for key in _STRINGS:
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise Problem(400, "", f"{key}: must be a string")
        out[key] = value or ""
    out["resource_handle"] = out["resource_handle"] or out.pop("resource_id")
    for key in ("bootstrap_token", "nonce", "resource_handle"):
        if not out[key].strip():
            raise Problem(422, "", f"{key}: must not be empty")
    too_long = next((k for k, v in out.items() if len(v) > MAX_FIELD), None)
    if too_long:
        raise Problem(422, "", f"{too_long}: longer than {MAX_FIELD} characters")
    if canonical_uuid(out["project_id"]) is None:
        raise Problem(422, "", "project_id: must be a non-zero UUID")
    return out


def register(dep: Deployment, body: Any) -> dict[str, Any]:
    f = _fields(body)
    project = canonical_uuid(f["project_id"])
    assert project is not None
    if not is_wireguard_key(f["public_key"]):
        raise Problem(400, "public_key_invalid", "public_key: must be 32 bytes in standard base64 (44 characters), "
                                                 "not all zero")
    token = f["bootstrap_token"]
    parts = platform_tokens.parse_token(token)
    if parts is None:
        raise Problem(403, "", "bootstrap_token: not a platform bootstrap token")
    if parts.kind != "node":
        raise Problem(403, "kind_mismatch", f"bootstrap_token: a {parts.kind} token cannot register a node")
    status = dep.store.token_status(token)
    if status == "unknown":
        raise Problem(403, "", "bootstrap_token: unknown")
    refusal = dep.store.token_refusal(token, dep.clock.now().timestamp())
    if refusal:
        raise Problem(403, f"token_{refusal}", f"bootstrap_token: {refusal}")
    repeat = None  # the node this token registered, asked for again
    if status == "used":
        repeat = dep.nodes.get(dep.store.token_node(token) or "")
        if (repeat is None or repeat.removed or repeat.public_key != f["public_key"]
                or not dep.within_retry_window(repeat)):
            raise Problem(403, "token_consumed", "bootstrap_token: already used; create a new one")
    if parts.project != platform_tokens.project_segment(project):
        raise Problem(403, "project_mismatch", "project_id: not the project of the bootstrap token")
    if repeat is not None:
        log.info("registration repeated with the same token and key; same answer",
                 extra={"node_id": repeat.id, "token": fingerprint(token)})
        dep.store.record_nonce(project, f["nonce"], repeat.id, dep.now_text())
        return answer(dep, repeat)
    if dep.store.nonce_node(project, f["nonce"]) is not None:
        raise Problem(403, "nonce_collision", "nonce: already used in this project; a new registration needs a "
                                              "new nonce")
    if f["resource_handle"] == UNKNOWN_RESOURCE:
        raise Problem(404, "resource_not_found", f"resource {UNKNOWN_RESOURCE!r} is not known in this project")
    try:
        dep.refuse_taken_key(f["public_key"], None)
        node = dep.new_node(uuid7(), f["resource_handle"], f["public_key"],
                            base64.b64encode(os.urandom(32)).decode())
    except DevplaneAPIError as exc:
        code = {409: "public_key_in_use", 503: "pool_exhausted"}.get(exc.status, "")
        raise Problem(exc.status, code, exc.message) from None
    if not dep.enroll(node, token, lambda: dep.store.record_nonce(project, f["nonce"], node.id,
                                                                  node.registered_at)):
        raise Problem(403, "token_consumed", "bootstrap_token: already used; create a new one")
    log.info("node registered", extra={"node_id": node.id, "hostname": node.hostname, "mesh_ip": node.mesh_ip,
                                       "token": fingerprint(token)})
    return answer(dep, node)


def answer(dep: Deployment, node: Node) -> dict[str, Any]:
    return {
        "node_id": node.id,
        "mesh_ip": node.mesh_ip,
        "signing_public_key": dep.signer.public_key,
        "signing_key_id": key_id(dep.signer.public_key),
        "nsk": node.secret,
        "peer_snapshot": peers(dep, node),
        "domain_mesh_cidr": str(MESH_NETWORK),
    }
