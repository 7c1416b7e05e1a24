"""The admin API (`/admin/v1/...`, Bearer admin token): what an operator or a test does to the deployment.

Faults are applied only to the agent API (server.FaultMiddleware), never here, so a test can always heal the
control plane it broke.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from plexd.base import gojson
from plexd.base.log import fingerprint
from plexd.devplane import platform_executions, platform_tokens, session_issuer, wire
from plexd.devplane.deployment import Deployment, valid_public_key
from plexd.devplane.events import event_id
from plexd.devplane.platform_events import key_id
from plexd.devplane.store import Node
from plexd.devplane.wire import DevplaneAPIError, read_json
from plexd.trust.integrity import sha256_file

log = logging.getLogger(__name__)

RECORD_KINDS = {
    "drift": "drift", "reports": "report", "integrity": "integrity", "heartbeats": "heartbeat",
    "metrics": "metrics", "logs": "logs", "audit": "audit", "tunnels": "tunnel_ready",
    "tunnels-closed": "tunnel_closed", "endpoints": "endpoint", "capabilities": "capabilities",
    "session-activity": "session",
}
FLATTENED = {"metrics", "logs", "audit"}  # bodies are arrays; the admin view is one list of entries
FAULT_KEYS = {"events_status": "int", "retry_after": "str", "close_after_events": "int", "silent": "bool",
              "all_status": "int", "state_body": "str",
              "report_status": "int",  # POST /report answers this (a control plane refusing report batches)
              "rotate_status": "int",  # POST /v1/keys/rotate refuses with this status (nothing changes)
              "rotate_answer_after": "int",  # ... takes the new key, then answers N seconds later (a crash test)
              # send every node every other node, whatever the policies (a control plane that leaves peer
              # visibility to the agents): the node's own visibility filter is then all that hides a peer
              "ignore_visibility": "bool",
              # the platform dialect's descoped surfaces, each a 501 with the code plexd keys its fallback on
              "events_not_provisioned": "bool",  # GET .../events: signed_event_bus_not_provisioned (pull only)
              "reports_not_provisioned": "bool",  # PUT/DELETE .../state/reports/{key}: reports_not_provisioned
              "ingest_not_provisioned": "bool"}  # metrics, logs, audit: observability_ingest_not_provisioned


PREFIX = "/admin"


class AdminTokenGuard:
    """The one admin-token check: every route mounted under /admin passes through it, whatever the route's
    handler does, so a route added later cannot forget it (tests/security/test_admin_routes.py walks the table).
    Unknown admin paths get the 401 too: no route enumeration without the token."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            token = wire.bearer(request) or ""
            if not hmac.compare_digest(token.encode(), request.app.state.admin_token.encode()):
                log.warning("admin API request refused: %s %s without the admin token", request.method,
                            request.url.path)
                await wire.error_response(401, "admin API needs Authorization: Bearer <admin token>")(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def _dep(request: Request) -> Deployment:
    dep: Deployment = request.app.state.deployment
    return dep


def _any_node(dep: Deployment, node_id: str) -> Node:
    """A node, including removed ones (their history stays readable)."""
    node = dep.nodes.get(node_id)
    if node is None:
        raise DevplaneAPIError(404, f"unknown node {node_id!r}")
    return node


def node_summary(dep: Deployment, node: Node) -> dict[str, Any]:
    return {
        "id": node.id, "hostname": node.hostname, "mesh_ip": node.mesh_ip, "public_key": node.public_key,
        "endpoint": node.endpoint, "nat_type": node.nat_type, "status": node.status,
        "last_seen": gojson.format_unix(node.last_seen) if node.last_seen else "",
        "registered_at": node.registered_at, "streams": dep.hub.stream_count(node.id),
    }


def _obj(body: Any, what: str = "body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise DevplaneAPIError(400, f"{what}: must be a JSON object, got {wire.kind(body)}")
    return body


def _str(body: dict[str, Any], key: str, *, required: bool = True) -> str:
    value = body.get(key)
    if value is None:
        if required:
            raise DevplaneAPIError(400, f"{key}: required")
        return ""
    if not isinstance(value, str):
        raise DevplaneAPIError(400, f"{key}: must be a string, got {wire.kind(value)}")
    if required and not value:
        raise DevplaneAPIError(400, f"{key}: must not be empty")
    return value


# -- tokens and nodes -------------------------------------------------------------------------------------------

async def create_token(request: Request) -> Response:
    """A one-time bootstrap token; optional body `{kind: node|bridge, ttl_seconds}`. The platform dialect's tokens
    are `psb_dev_<project>_<kind>_<random>` and the answer names the project; a bridge token only ever meets
    `kind_mismatch` at /v1/register (bridges enrol elsewhere on the platform)."""
    dep = _dep(request)
    body = _obj(await read_json(request, {"kind": "str", "ttl_seconds": "num"}, allow_empty=True) or {})
    kind = _str(body, "kind", required=False) or "node"
    if kind not in platform_tokens.KINDS or (kind != "node" and dep.dialect != "platform"):
        raise DevplaneAPIError(400, f"kind: {kind!r} (node, or bridge in the platform dialect)")
    ttl = body.get("ttl_seconds")
    if ttl is not None and ttl <= 0:
        raise DevplaneAPIError(400, f"ttl_seconds: must be positive, got {ttl!r}")
    answer: dict[str, Any] = {}
    if dep.dialect == "platform":
        project = platform_tokens.project_id(dep.store)
        token = platform_tokens.new_token(project, kind)
        answer.update(project_id=project, kind=kind)
    else:
        token = "plx_enroll_" + secrets.token_hex(16)
    with dep.store.transaction():
        dep.store.add_token(token, dep.now_text())
        if ttl is not None:
            expires = dep.clock.now().timestamp() + float(ttl)
            dep.store.limit_token(token, expires_at=expires)
            answer["expires_at"] = gojson.format_unix(expires)
    log.info("bootstrap token created", extra={"token": fingerprint(token)})
    return JSONResponse({"token": token, **answer}, status_code=201)


async def revoke_token(request: Request) -> Response:
    """A token nobody may register with any more (a used one stays used)."""
    dep = _dep(request)
    token = request.path_params["token"]
    if dep.store.token_status(token) == "unknown":
        raise DevplaneAPIError(404, "unknown bootstrap token")
    dep.store.limit_token(token, revoked_at=dep.now_text())
    log.info("bootstrap token revoked", extra={"token": fingerprint(token)})
    return JSONResponse({})


async def list_tokens(request: Request) -> Response:
    dep = _dep(request)
    return JSONResponse([{**t, "token": t["token"][:15] + "…"} for t in dep.store.tokens()])


async def list_nodes(request: Request) -> Response:
    dep = _dep(request)
    include_removed = request.query_params.get("all", "") in ("1", "true", "yes")
    nodes = [n for n in dep.nodes.values() if include_removed or not n.removed]
    nodes.sort(key=lambda n: (n.registered_at, n.id))
    return JSONResponse([node_summary(dep, n) for n in nodes])


async def show_node(request: Request) -> Response:
    dep = _dep(request)
    node = _any_node(dep, request.path_params["node_id"])
    out = node_summary(dep, node)
    out.update({
        "metadata": node.metadata, "capabilities": node.capabilities, "last_heartbeat": node.last_heartbeat,
        "data": list(node.data.values()),
        "secret_refs": node.secret_refs(),
        "pending_flags": node.flags,
        "peers": [p.id for p in dep.visible_peers(node)] if not node.removed else [],
        "bridge": _redacted(node.bridge),
    })
    return JSONResponse(out)


def _redacted(doc: Any) -> Any:
    """A bridge block as an admin may see it: preshared and private keys only said to be set."""
    if isinstance(doc, dict):
        return {k: ("(set)" if v else "") if k in ("psk", "key_pem") else _redacted(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_redacted(v) for v in doc]
    return doc


async def forget_node(request: Request) -> Response:
    dep = _dep(request)
    dep.remove(dep.node(request.path_params["node_id"], rejoinable=True), "forgotten by the admin")
    return JSONResponse({})


# -- access sessions --------------------------------------------------------------------------------------------

async def create_session(request: Request) -> Response:
    """Mint a session: {kind, ttl_seconds, user | host+port | groups, allowed_commands, idle_timeout_seconds} →
    {session, token}. The token is shown once (the devplane keeps only the session)."""
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    session, token = dep.create_session(node, _obj(await read_json(request)))
    return JSONResponse({"session": session_issuer.summary(node, session, dep.clock.now()), "token": token},
                        status_code=201)


async def revoke_session(request: Request) -> Response:
    dep = _dep(request)
    dep.revoke_session(dep.node(request.path_params["node_id"]), request.path_params["session_id"])
    return JSONResponse({})


async def list_node_sessions(request: Request) -> Response:
    dep = _dep(request)
    node = _any_node(dep, request.path_params["node_id"])
    now = dep.clock.now()
    return JSONResponse([session_issuer.summary(node, s, now) for s in node.sessions.values()])


async def list_sessions(request: Request) -> Response:
    dep = _dep(request)
    now = dep.clock.now()
    return JSONResponse([session_issuer.summary(n, s, now) for n in dep.live_nodes() for s in n.sessions.values()])


# -- bridge mode ------------------------------------------------------------------------------------------------

async def set_bridge(request: Request) -> Response:
    """A bridge node's `bridge` block ({relay, user_access, ingress, site_to_site}, each nullable), or null."""
    dep = _dep(request)
    body = await read_json(request, allow_empty=True)  # empty or null: not a bridge any more
    if body is not None:
        body = _obj(body, "bridge")
        unknown = set(body) - {"relay", "user_access", "ingress", "site_to_site"}
        if unknown:
            raise DevplaneAPIError(400, f"bridge: unknown member(s) {', '.join(sorted(unknown))}")
    dep.set_bridge(dep.node(request.path_params["node_id"]), body)
    return JSONResponse({})


# -- policies ---------------------------------------------------------------------------------------------------

def validate_policies(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise DevplaneAPIError(400, f"policies: must be an array, got {wire.kind(value)}")
    out, seen = [], set()
    for i, pol in enumerate(value):
        path = f"policies[{i}]"
        pol = _obj(pol, path)
        pid = pol.get("id")
        if not isinstance(pid, str) or not pid:
            raise DevplaneAPIError(400, f"{path}.id: must be a non-empty string")
        if pid in seen:
            raise DevplaneAPIError(400, f"{path}.id: duplicate policy id {pid!r}")
        seen.add(pid)
        rules = pol.get("rules") or []
        if not isinstance(rules, list):
            raise DevplaneAPIError(400, f"{path}.rules: must be an array, got {wire.kind(rules)}")
        clean = []
        for j, rule in enumerate(rules):
            rpath = f"{path}.rules[{j}]"
            rule = _obj(rule, rpath)
            for side in ("src", "dst"):
                if not isinstance(rule.get(side), str) or not rule[side]:
                    raise DevplaneAPIError(400, f"{rpath}.{side}: must be a node id, a CIDR or \"*\"")
            port = rule.get("port", 0) or 0
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise DevplaneAPIError(400, f"{rpath}.port: must be an integer 0-65535 (0 = any), got {port!r}")
            protocol = rule.get("protocol", "") or ""
            if protocol not in ("", "tcp", "udp", "icmp"):
                raise DevplaneAPIError(400, f"{rpath}.protocol: must be \"tcp\", \"udp\", \"icmp\" or \"\" (any), "
                                     f"got {protocol!r}")
            action = rule.get("action", "allow")
            if action not in ("allow", "deny"):
                raise DevplaneAPIError(400, f"{rpath}.action: must be \"allow\" or \"deny\", got {action!r}")
            clean.append({"src": rule["src"], "dst": rule["dst"], "port": port, "protocol": protocol,
                          "action": action})
        out.append({"id": pid, "rules": clean})
    return out


async def get_policies(request: Request) -> Response:
    return JSONResponse(_dep(request).policies)


async def set_policies(request: Request) -> Response:
    dep = _dep(request)
    body = await read_json(request)
    if isinstance(body, dict) and "policies" in body:
        body = body["policies"]
    if request.query_params.get("unchecked") == "1":
        # Test hook: store the document as given (an array of anything), to show what nodes do with rules a
        # real control plane might send them; visibility here only reads well-formed allow rules.
        if not isinstance(body, list):
            raise DevplaneAPIError(400, f"policies: must be an array, got {wire.kind(body)}")
        policies = body
    else:
        policies = validate_policies(body)
    dep.set_policies(policies)
    return JSONResponse(policies)


# -- node data ----------------------------------------------------------------------------------------------

async def set_metadata(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = await read_json(request, ("map", "str"))
    dep.set_metadata(node, _obj(body))
    return JSONResponse(node.metadata)


async def set_data(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = _obj(await read_json(request))
    content_type = _str(body, "content_type")
    if "payload" not in body:
        raise DevplaneAPIError(400, "payload: required (any JSON value)")
    return JSONResponse(dep.set_data(node, request.path_params["key"], content_type, body["payload"]))


async def set_secret(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = _obj(await read_json(request))
    value = _str(body, "value", required=False)
    if "value" not in body:
        raise DevplaneAPIError(400, "value: required")
    version = dep.set_secret(node, request.path_params["key"], value)
    return JSONResponse({"key": request.path_params["key"], "version": version})


async def set_endpoint(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = _obj(await read_json(request))
    endpoint = _str(body, "endpoint", required=False)
    dep.set_endpoint(node, endpoint)
    return JSONResponse({"endpoint": node.endpoint})


async def set_public_key(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = _obj(await read_json(request))
    key = _str(body, "public_key")
    if not valid_public_key(key):
        raise DevplaneAPIError(400, "public_key: must be the standard base64 encoding of 32 bytes")
    dep.rotate_node_key(node, key)
    return JSONResponse({"public_key": key})


async def set_heartbeat_flags(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = _obj(await read_json(request, {"reconcile": "bool", "rotate_keys": "bool"}))
    for flag in ("reconcile", "rotate_keys"):
        if body.get(flag):
            node.flags[flag] = True
    dep.store.save_node(node)
    return JSONResponse(node.flags)


# -- actions and events -----------------------------------------------------------------------------------------

async def request_action(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = _obj(await read_json(request))
    action = _str(body, "action")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise DevplaneAPIError(400, f"parameters: must be an object, got {wire.kind(parameters)}")
    timeout = _str(body, "timeout", required=False) or None
    checksum = _str(body, "checksum", required=False) or None
    # the platform dialect's builtin|hook; without it, hook when the node declared a hook of that name
    action_type = _str(body, "type", required=False) or None
    execution_id = dep.request_action(node, action, parameters, timeout, checksum, action_type)
    return JSONResponse({"execution_id": execution_id}, status_code=201)


async def arm_key_rotation(request: Request) -> Response:
    """Ask a node for a new mesh key (`rotate_keys` in its heartbeats; the platform dialect also sends the event
    and keeps asking until the node completes it at /v1/keys/rotate)."""
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    dep.arm_key_rotation(node)
    return JSONResponse(node.flags)


async def execution_output(request: Request) -> Response:
    """What a platform-dialect execution delivered with its terminal callback: the inline output decoded, or the
    object uploaded to the devplane (404 when there is none)."""
    dep = _dep(request)
    node = _any_node(dep, request.path_params["node_id"])
    data = platform_executions.output_bytes(dep, node.id, request.path_params["execution_id"])
    if data is None:
        raise DevplaneAPIError(404, "no output delivered for that execution")
    return Response(data, media_type="application/octet-stream")


async def resend_action(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    execution_id = request.path_params["execution_id"]
    try:
        event_id = dep.resend_action(node, execution_id)
    except KeyError:
        raise DevplaneAPIError(404, f"no action was requested with execution id {execution_id!r}") from None
    return JSONResponse({"execution_id": execution_id, "event_id": event_id}, status_code=201)


def _event_args(body: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {"payload": body.get("payload")}
    for key in ("payload_raw", "issued_at", "nonce", "signature", "raw_data", "raw_frame"):
        if body.get(key) is not None:
            args[key] = _str(body, key, required=False)
    if "payload_raw" in args:
        try:
            json.loads(args["payload_raw"])
        except RecursionError:
            pass  # nested deeper than Python's decoder goes: exactly what a hostile-input test wants to send
        except ValueError:
            raise DevplaneAPIError(400, "payload_raw: must be valid JSON text (use raw_data for arbitrary text)") \
                from None
    if "issued_at" in args:
        try:
            gojson.canonical_time(args["issued_at"])
        except ValueError as exc:
            raise DevplaneAPIError(400, f"issued_at: {exc}") from None
    return args


async def publish_event(request: Request) -> Response:
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = _obj(await read_json(request))
    eid = dep.hub.publish([node.id], _str(body, "event_type"), **_event_args(body))
    return JSONResponse({"event_id": eid}, status_code=201)


async def broadcast_event(request: Request) -> Response:
    """One event (one id, one signature) to many nodes: `node_ids` or every registered node."""
    dep = _dep(request)
    body = _obj(await read_json(request))
    node_ids = body.get("node_ids")
    if node_ids is None:
        targets = [n.id for n in dep.live_nodes()]
    else:
        if not isinstance(node_ids, list) or not all(isinstance(n, str) for n in node_ids):
            raise DevplaneAPIError(400, "node_ids: must be an array of node ids")
        targets = [dep.node(n).id for n in node_ids]
    eid = dep.hub.publish(targets, _str(body, "event_type"), **_event_args(body))
    return JSONResponse({"event_id": eid, "targets": len(targets)}, status_code=201)


async def rotate_signing_key(request: Request) -> Response:
    dep = _dep(request)
    body = await read_json(request, allow_empty=True) or {}
    transition = _str(_obj(body), "transition", required=False) or "24h"
    try:
        seconds = gojson.parse_duration(transition)
    except ValueError as exc:
        raise DevplaneAPIError(400, f"transition: {exc}") from None
    if seconds < 0:
        raise DevplaneAPIError(400, f"transition: must not be negative, got {transition!r}")
    return JSONResponse(dep.rotate_signing_key(seconds))


# -- releases and upgrades ---------------------------------------------------------------------------------------

MAX_ARTIFACT = 256 << 20


def _artifacts_dir(request: Request) -> Path:
    root: Path | None = request.app.state.artifacts_dir
    if root is None:
        raise DevplaneAPIError(409, "this devplane serves no artifacts (no --artifacts-dir)")
    return root


def _component(value: str, what: str) -> str:
    if not wire.safe_component(value):
        raise DevplaneAPIError(400, f"{what}: {value[:80]!r} is not a safe path component (letters, digits, . _ + -)")
    return value


async def put_artifact(request: Request) -> Response:
    """Store the body as the artifact plexd/{version}/{os}/{arch}; answer its SHA-256 and size."""
    parts = [_component(request.path_params[k], k) for k in ("version", "os", "arch")]
    path = _artifacts_dir(request).joinpath(*parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as fh:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_ARTIFACT:
                    raise DevplaneAPIError(413, f"artifact larger than {MAX_ARTIFACT} bytes")
                digest.update(chunk)
                fh.write(chunk)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    log.info("artifact plexd/%s stored (%d bytes, sha256 %s)", "/".join(parts), size, digest.hexdigest())
    return JSONResponse({"path": "/".join(parts), "size": size, "sha256": digest.hexdigest()}, status_code=201)


async def start_upgrade(request: Request) -> Response:
    """Ask a node to run service.upgrade to `version` (with allow_downgrade when the body says so; the signature
    is the node's to fetch, at the artifact's path + .sig). The checksum defaults to the stored artifact's (for `arch`,
    or the one architecture stored for that version); a given one is sent as it is (tests send wrong ones)."""
    dep = _dep(request)
    node = dep.node(request.path_params["node_id"])
    body = _obj(await read_json(request))
    version = _component(_str(body, "version"), "version")
    checksum = _str(body, "checksum", required=False)
    if not checksum:
        stored = _artifacts_dir(request) / version / "linux"
        arch = _str(body, "arch", required=False)
        candidates = ([stored / _component(arch, "arch")] if arch
                      else sorted(p for p in stored.glob("*") if not p.name.endswith(".sig")))
        files = [f for f in candidates if f.is_file()]
        if len(files) != 1:
            raise DevplaneAPIError(404 if not files else 400, f"no single artifact for plexd {version} under {stored} "
                            f"({len(files)} found); give arch or checksum")
        checksum = sha256_file(files[0])
    params: dict[str, Any] = {"version": version, "checksum": checksum}
    if dep.dialect == "platform":  # as the platform words them: the release's tag, a typed digest
        params = {"version": f"v{version}", "checksum": f"sha256:{checksum}"}
    allow_downgrade = body.get("allow_downgrade", False)
    if not isinstance(allow_downgrade, bool):
        raise DevplaneAPIError(400, f"allow_downgrade: must be a boolean, got {wire.kind(allow_downgrade)}")
    if allow_downgrade:
        params["allow_downgrade"] = True  # an extra parameter of service.upgrade; the node's config must agree
    execution_id = dep.request_action(node, "service.upgrade", params, None, None)
    return JSONResponse({"execution_id": execution_id, **params}, status_code=201)


# -- what nodes reported ----------------------------------------------------------------------------------------

async def node_records(request: Request) -> Response:
    dep = _dep(request)
    node = _any_node(dep, request.path_params["node_id"])
    what = request.path_params["kind"]
    if what == "executions":
        return JSONResponse(dep.store.executions(node.id))
    kind = RECORD_KINDS.get(what)
    if kind is None:
        raise DevplaneAPIError(404, f"unknown record kind {what!r} (one of: executions, {', '.join(RECORD_KINDS)})")
    bodies = [json.loads(body) for _, body in dep.store.records(node.id, kind)]
    if what in FLATTENED:
        bodies = [entry for batch in bodies for entry in (batch or [])]
    return JSONResponse(bodies)


async def report_entries(request: Request) -> Response:
    """The report entries the node has now (what its POST /report batches add up to)."""
    dep = _dep(request)
    node = _any_node(dep, request.path_params["node_id"])
    return JSONResponse(sorted(node.reports.values(), key=lambda e: e["key"]))


# -- faults and status ------------------------------------------------------------------------------------------

async def set_faults(request: Request) -> Response:
    dep = _dep(request)
    body = _obj(await read_json(request))
    for key, value in body.items():
        want = FAULT_KEYS.get(key)
        if want is None:
            raise DevplaneAPIError(400, f"unknown fault {key!r} (known: {', '.join(FAULT_KEYS)})")
        if value is None:
            continue
        wire.check(value, want, key)
    dep.faults = {k: v for k, v in body.items() if v not in (None, False, 0, "")}
    log.warning("faults injected: %s", dep.faults)
    if dep.faults.get("events_status") or dep.faults.get("all_status") or dep.faults.get("events_not_provisioned"):
        # A refused event stream is no stream: the ones open now end too (their reconnects meet the fault).
        for node_id in list(dep.hub.subscribers):
            dep.hub.close_streams(node_id)
    return JSONResponse(dep.faults)


async def clear_faults(request: Request) -> Response:
    dep = _dep(request)
    dep.faults = {}
    return JSONResponse({})


async def status(request: Request) -> Response:
    dep = _dep(request)
    live = list(dep.live_nodes())
    platform = dep.dialect == "platform"
    keys = dep.signer.keys(dep.clock.now())
    doc = {
        "nodes": len(live),
        "by_status": {s: sum(1 for n in live if n.status == s) for s in ("online", "unreachable", "offline")},
        "streams": dep.hub.stream_count(),
        # the platform's SSE ids are the bare sequence numbers
        "last_event_id": (str(dep.hub.seq) if platform else event_id(dep.hub.seq)) if dep.hub.seq else "",
        "signing_keys": {**keys, "key_id": key_id(keys["current"])} if platform else keys,
        "heartbeat_interval": gojson.format_duration(dep.heartbeat_interval),
        "faults": dep.faults,
    }
    if platform:
        doc.update(dialect="platform", project_id=platform_tokens.project_id(dep.store))
    return JSONResponse(doc)


async def requests(request: Request) -> Response:
    """The agent API's requests since the devplane started (or since the last DELETE), by node and route."""
    return JSONResponse(_dep(request).requests.by_node())


async def clear_requests(request: Request) -> Response:
    _dep(request).requests.clear()
    return JSONResponse({})


def mount() -> Mount:
    """The admin API: its routes behind the admin-token guard."""
    return Mount(PREFIX, routes=routes(), middleware=[Middleware(AdminTokenGuard)])


def routes() -> list[Route]:
    """The admin routes, relative to /admin (mounted with the guard by `mount`)."""
    node = "/v1/nodes/{node_id}"
    return [
        Route("/v1/status", status, methods=["GET"]),
        Route("/v1/tokens", create_token, methods=["POST"]),
        Route("/v1/tokens", list_tokens, methods=["GET"]),
        Route("/v1/tokens/{token}", revoke_token, methods=["DELETE"]),
        Route("/v1/nodes", list_nodes, methods=["GET"]),
        Route(node, show_node, methods=["GET"]),
        Route(node, forget_node, methods=["DELETE"]),
        Route("/v1/policies", get_policies, methods=["GET"]),
        Route("/v1/policies", set_policies, methods=["PUT"]),
        Route(node + "/metadata", set_metadata, methods=["PUT"]),
        Route(node + "/data/{key:path}", set_data, methods=["PUT"]),
        Route(node + "/secrets/{key:path}", set_secret, methods=["PUT"]),
        Route(node + "/endpoint", set_endpoint, methods=["PUT"]),
        Route(node + "/public-key", set_public_key, methods=["PUT"]),
        Route(node + "/heartbeat-flags", set_heartbeat_flags, methods=["PUT"]),
        Route(node + "/keys/rotate", arm_key_rotation, methods=["POST"]),
        Route(node + "/actions", request_action, methods=["POST"]),
        Route(node + "/actions/{execution_id}/resend", resend_action, methods=["POST"]),
        Route(node + "/executions/{execution_id}/output", execution_output, methods=["GET"]),
        Route(node + "/upgrade", start_upgrade, methods=["POST"]),
        Route("/v1/artifacts/{version}/{os}/{arch}", put_artifact, methods=["PUT"]),
        Route(node + "/events", publish_event, methods=["POST"]),
        Route("/v1/events", broadcast_event, methods=["POST"]),
        Route("/v1/signing-key/rotate", rotate_signing_key, methods=["POST"]),
        Route(node + "/report-entries", report_entries, methods=["GET"]),
        Route(node + "/sessions", create_session, methods=["POST"]),
        Route(node + "/sessions", list_node_sessions, methods=["GET"]),
        Route(node + "/sessions/{session_id}", revoke_session, methods=["DELETE"]),
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route(node + "/bridge", set_bridge, methods=["PUT"]),
        Route(node + "/{kind}", node_records, methods=["GET"]),
        Route("/v1/faults", set_faults, methods=["PUT"]),
        Route("/v1/faults", clear_faults, methods=["DELETE"]),
        Route("/v1/requests", requests, methods=["GET"]),
        Route("/v1/requests", clear_requests, methods=["DELETE"]),
    ]
