"""The node-facing API in the platform dialect (docs/platform-dialect.md), served instead of server.ROUTES by a
devplane started with `--dialect platform`.

Handlers authenticate (the bearer envelope `nsk_<env>_<b64url(node uuid ‖ NSK)>`), read and check the body
(platform_bodies), and hand over to the same Deployment the spec dialect uses; platform_state and
platform_executions translate its model at the edge. Every error is a Problem, answered as problem+json.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import os
import subprocess
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from plexd import __version__
from plexd.base import gojson
from plexd.controlplane.platform_envelope import parse_bearer
from plexd.devplane import (
    platform_bodies,
    platform_executions,
    platform_register,
    platform_rotation,
    platform_state,
    wire,
)
from plexd.devplane.deployment import Deployment
from plexd.devplane.platform_events import API_VERSION, format_sse
from plexd.devplane.platform_wire import Problem, canonical_uuid, parse_json, read_raw
from plexd.devplane.sse_stream import event_stream
from plexd.devplane.store import Node
from plexd.devplane.wire import DevplaneAPIError, bearer

ENDPOINT_STALE_AFTER = 300.0  # seconds an endpoint report stays fresh
KB = 1024


def _dep(request: Request) -> Deployment:
    return request.app.state.deployment


def _now(request: Request) -> str:
    return _dep(request).now_text()


def authenticate(request: Request, mismatch: str = "node_id_mismatch") -> Node:
    """The calling node, from its bearer envelope; the node in the path must be that node (403 `mismatch`)."""
    dep = _dep(request)
    token = bearer(request)
    if token is None:
        raise Problem(401, "unauthorized", "missing Authorization: Bearer nsk_<env>_<payload>")
    try:
        node_id, nsk = parse_bearer(token)
    except ValueError as exc:
        raise Problem(401, "unauthorized", f"{exc} (a raw node secret key is not a bearer)") from None
    node = dep.nodes.get(node_id)
    if node is None or not hmac.compare_digest(node.secret.encode(), base64.b64encode(nsk)):
        raise Problem(401, "nsk_invalid", "the bearer's node secret key is not known")
    if node.removed:
        raise Problem(401, "nsk_revoked", f"node {node.id} was removed; its node secret key is revoked")
    path_id = request.path_params.get("node_id")
    if path_id is not None and canonical_uuid(path_id) != node.id:
        raise Problem(403, mismatch, f"the bearer belongs to node {node.id}, not {path_id[:64]!r}")
    return node


async def _json(request: Request, limit: int, too_large: str, malformed: str) -> Any:
    return parse_json(await read_raw(request, limit, too_large), malformed)


def _refuse_if(dep: Deployment, fault: str, code: str, what: str) -> None:
    """A surface the admin said is not provisioned answers 501 with its code (plexd falls back on its own)."""
    if dep.faults.get(fault):
        raise Problem(501, code, f"{what} is not provisioned (devplane fault {fault})")


def _injected(dep: Deployment, fault: str, code_for_501: str) -> None:
    """The spec dialect's status faults (`report_status`, `rotate_status`), told as problems."""
    status = dep.faults.get(fault)
    if status:
        raise Problem(int(status), code_for_501 if int(status) == 501 else "",
                      f"injected fault: status {status} ({fault})")


# -- registration and liveness ----------------------------------------------------------------------------------

async def register(request: Request) -> Response:
    raw = await read_raw(request, 64 * KB, "")
    body = parse_json(raw, "")
    return JSONResponse(platform_register.register(_dep(request), body), status_code=201)


async def heartbeat(request: Request) -> Response:
    node = authenticate(request)
    dep = _dep(request)
    body = await _json(request, 16 * KB, "", platform_bodies.HEARTBEAT)
    nat_type = platform_bodies.heartbeat(body, dep.clock.now())
    try:
        flags = dep.heartbeat(node, body, nat_type=nat_type, sticky=("rotate_keys",))
    except DevplaneAPIError as exc:  # removed while the body was read
        raise Problem(401, "nsk_revoked", exc.message) from None
    return JSONResponse({"accepted_at": _now(request), **flags})


# -- state and events -------------------------------------------------------------------------------------------

async def state(request: Request) -> Response:
    """The snapshot with an ETag of its bytes: asked again with `If-None-Match` and unchanged, a 304."""
    node = authenticate(request)
    return wire.etagged_json(request, platform_state.snapshot(_dep(request), node, request.app.state.reachability))


async def events(request: Request) -> Response:
    node = authenticate(request)
    dep = _dep(request)
    _refuse_if(dep, "events_not_provisioned", "signed_event_bus_not_provisioned", "the signed event bus")
    cursor = request.headers.get("last-event-id", "").strip()
    if cursor and not (cursor.isascii() and cursor.isdigit()):
        raise Problem(400, "invalid_cursor", "Last-Event-ID: must be a non-negative integer (an event's id)")
    retry_after = request.app.state.admission.admit()
    if retry_after is not None:
        raise Problem(503, "event_stream_unavailable", "too many event streams opening at once; retry later",
                      {"Retry-After": str(retry_after)})
    after = int(cursor) if cursor else None  # no cursor: from now on, nothing replayed

    def backlog() -> list[Any]:
        return dep.hub.backlog(node.id, after, dep.replay_window) if after is not None else []

    return event_stream(dep, node.id, after, backlog, keepalive=request.app.state.keepalive, render=format_sse,
                        keepalive_comment="keep-alive",
                        headers={"Cache-Control": "no-cache", "X-Plexsphere-API-Version": API_VERSION})


# -- executions -------------------------------------------------------------------------------------------------

async def execution_callback(request: Request) -> Response:
    node = authenticate(request, mismatch="nsk_node_mismatch")
    body = await _json(request, platform_executions.BODY_CAP, "execution_callback_too_large",
                       platform_executions.MALFORMED)
    answer = platform_executions.callback(_dep(request), node, request.path_params["execution_id"], body,
                                          str(request.base_url))
    return JSONResponse(answer)


async def upload(request: Request) -> Response:
    """The PUT of an over-ceiling output to the URL a callback answered (no bearer: the URL is the credential)."""
    dep = _dep(request)
    token = request.path_params["token"]
    stored = dep.store.upload(token)
    if stored is None:
        raise Problem(404, "upload_not_found", "no such upload")
    data = await read_raw(request, stored["declared"], "upload_too_large")
    platform_executions.upload(dep, token, data)
    return Response(status_code=200)


# -- what a node tells ------------------------------------------------------------------------------------------

async def capabilities(request: Request) -> Response:
    node = authenticate(request)
    body = platform_bodies.capabilities(await _json(request, 32 * KB, "capabilities_body_too_large",
                                                    platform_bodies.CAPABILITIES))
    dep = _dep(request)
    changed = platform_bodies.capability_changes(node.capabilities, body)
    with dep.store.transaction():
        node.capabilities = body
        dep.store.save_node(node)
        dep.store.add_record(node.id, "capabilities", dep.now_text(), _compact(body))
    # The platform's answer: what changed since the last manifest, the host key's change broken out.
    return JSONResponse({"accepted_at": dep.now_text(), "fields_changed": changed,
                         "host_key_changed": "ssh_host_key_fingerprint" in changed})


async def integrity_violations(request: Request) -> Response:
    node = authenticate(request)
    body = await _json(request, 32 * KB, "integrity_violations_body_too_large", platform_bodies.INTEGRITY)
    violations = platform_bodies.integrity(body)
    dep = _dep(request)
    dep.store.add_record(node.id, "integrity", dep.now_text(), _compact(body))
    return JSONResponse({"accepted_at": dep.now_text(), "violation_count": len(violations)})


def _report_route(request: Request) -> tuple[Node, Deployment, str]:
    """A report route's node, deployment and key, after its refusals (the fault knobs)."""
    node = authenticate(request)
    dep = _dep(request)
    _refuse_if(dep, "reports_not_provisioned", "reports_not_provisioned", "node-authored reports")
    _injected(dep, "report_status", "reports_not_provisioned")
    return node, dep, request.path_params["key"]


async def put_report(request: Request) -> Response:
    node, dep, key = _report_route(request)
    body = await _json(request, 16 * KB, "payload_too_large", "invalid_report")
    entry = platform_bodies.report(key, body)
    dep.record_reports(node, [entry], [])
    return JSONResponse({"accepted_at": dep.now_text(), "key": key})


async def delete_report(request: Request) -> Response:
    node, dep, key = _report_route(request)
    if key not in node.reports:
        raise Problem(404, "report_not_found", f"node {node.id} has no report {key[:140]!r}")
    dep.record_reports(node, [], [key])
    return Response(status_code=204)


async def endpoint(request: Request) -> Response:
    node = authenticate(request)
    dep = _dep(request)
    body = await _json(request, 4 * KB, "endpoint_body_too_large", platform_bodies.ENDPOINT)
    address, nat_type = platform_bodies.endpoint(body, dep.clock.now())
    dep.store.add_record(node.id, "endpoint", dep.now_text(), _compact(body))
    try:
        dep.set_endpoint(node, address, nat_type)
    except DevplaneAPIError as exc:
        raise Problem(410, "endpoint_peer_gone", exc.message) from None
    now = dep.clock.now()
    return JSONResponse({"accepted_at": gojson.format_time(now),
                         "stale_after": gojson.format_time(now + timedelta(seconds=ENDPOINT_STALE_AFTER))})


async def session_activity(request: Request) -> Response:
    node = authenticate(request, mismatch="nsk_node_mismatch")
    body = await _json(request, 64 * KB, "payload_too_large", "malformed_session_activity")
    try:
        _dep(request).session_activity(node, request.path_params["session_id"], body)
    except DevplaneAPIError as exc:  # session_issuer's refusals, given the platform's codes
        raise Problem(exc.status, "session_not_found" if exc.status == 404 else "malformed_session_activity",
                      exc.message) from None
    return Response(status_code=204)


def _ingest(kind: str) -> Any:
    """metrics (a JSON array), logs and audit (NDJSON): the only routes that take a gzip body."""
    async def handler(request: Request) -> Response:
        node = authenticate(request)
        dep = _dep(request)
        _refuse_if(dep, "ingest_not_provisioned", "observability_ingest_not_provisioned", "observability ingest")
        try:
            gojson.parse_time(request.headers.get("x-plexsphere-sent-at", ""))
        except ValueError:
            raise Problem(400, "ingest_sent_at_invalid", "X-Plexsphere-Sent-At: must be an RFC 3339 time") from None
        raw = _inflate(request, await read_raw(request, 1 << 20, "ingest_batch_too_large"))
        if kind == "metrics":
            batch = platform_bodies.metrics(parse_json(raw, platform_bodies.INGEST))
        else:
            lines = [parse_json(line.encode(), platform_bodies.INGEST)
                     for line in raw.decode("utf-8", "replace").splitlines() if line.strip()]
            if not lines:
                raise Problem(400, platform_bodies.INGEST, "body: no NDJSON lines")
            batch = (platform_bodies.log_lines if kind == "logs" else platform_bodies.audit_events)(lines)
        dep.store.add_record(node.id, kind, dep.now_text(), _compact(batch))
        return JSONResponse({"accepted_at": dep.now_text(), "records": len(batch)}, status_code=202)

    handler.__name__ = f"ingest_{kind}"
    return handler


def _inflate(request: Request, raw: bytes) -> bytes:
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding != "gzip":
        raise Problem(415, "ingest_encoding_unsupported", f"Content-Encoding {encoding!r}: only gzip")
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(raw, (1 << 20) + 1)
    except zlib.error as exc:
        raise Problem(400, platform_bodies.INGEST, f"body is not valid gzip: {exc}") from None
    if len(out) > 1 << 20 or inflater.unconsumed_tail:
        raise Problem(413, "ingest_batch_too_large", "decompressed body is larger than 1 MiB")
    return out


# -- secrets and keys -------------------------------------------------------------------------------------------

async def secret(request: Request) -> Response:
    """`nonce(12) ‖ ciphertext ‖ tag(16)`, AES-256-GCM under the node's NSK, no associated data."""
    node = authenticate(request)
    name = request.path_params["name"]
    entry = node.secrets.get(name)
    if entry is None:
        raise Problem(404, "secret_not_found", f"node {node.id} has no secret {name[:80]!r}")
    wanted = request.query_params.get("version")
    if wanted is not None and wanted != str(entry["version"]):
        raise Problem(404, "secret_version_not_found", f"secret {name[:80]!r} has no version {wanted[:20]!r} (the "
                                                       f"devplane keeps only the current one, {entry['version']})")
    try:
        key = base64.b64decode(node.secret, validate=True)
    except (binascii.Error, ValueError):
        raise Problem(500, "", f"node {node.id}'s secret key is not base64") from None
    nonce = os.urandom(12)
    sealed = nonce + AESGCM(key).encrypt(nonce, entry["value"].encode("utf-8"), None)
    return Response(sealed, media_type="application/octet-stream",
                    headers={"X-Plexsphere-Secret-Version": str(entry["version"]),
                             "X-Plexsphere-Secret-KID": f"nsk:{node.id}", "Cache-Control": "no-store"})


async def rotate_keys(request: Request) -> Response:
    node = authenticate(request)
    dep = _dep(request)
    _injected(dep, "rotate_status", "keys_rotate_not_provisioned")
    body = await _json(request, 4 * KB, "keys_rotate_body_too_large", "malformed_keys_rotate_request")
    receipt = platform_rotation.complete(dep, node, platform_bodies.new_public_key(body))
    await asyncio.sleep(int(dep.faults.get("rotate_answer_after") or 0))  # taken, but the answer is late
    return JSONResponse(receipt)


# -- meta -------------------------------------------------------------------------------------------------------

async def health(request: Request) -> Response:
    dep = _dep(request)
    try:
        dep.store.db.execute("SELECT 1").fetchone()
        database = {"name": "database", "status": "ok", "detail": "sqlite answers"}
    except Exception as exc:  # a health probe reports, never raises
        database = {"name": "database", "status": "down", "detail": str(exc)[:200]}
    bus = dep.faults.get("events_not_provisioned")
    checks = [database, {"name": "event_bus", "status": "degraded" if bus else "ok",
                         "detail": "not provisioned (fault)" if bus else f"{dep.hub.stream_count()} streams open"}]
    overall = "down" if database["status"] == "down" else "degraded" if bus else "ok"
    return JSONResponse({"status": overall, "checks": checks}, status_code=503 if overall == "down" else 200)


def _build() -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %cI"], capture_output=True,
                             text=True, timeout=5, check=True).stdout.split()
        commit, date = out[0], gojson.canonical_time(out[1])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        commit, date = "unknown", gojson.GO_ZERO_TIME
    return {"version": __version__, "commit": commit, "date": date}


_BUILD: dict[str, str] = {}


async def version(request: Request) -> Response:
    if not _BUILD:
        _BUILD.update(await asyncio.to_thread(_build))
    return JSONResponse(_BUILD)


async def release(request: Request) -> Response:
    """The release page the platform's nodes download from (upgrade.release_url = this devplane's /releases):
    ``/releases/v{version}/plexd-{os}-{arch}[.sig]``, the files the admin API stored, public as a release page is.
    Not part of the platform's API: GitHub's place, in the lab."""
    tag, asset = request.path_params["tag"], request.path_params["asset"]
    os_name, _, arch = asset.removeprefix("plexd-").partition("-")
    parts = [tag.removeprefix("v"), os_name, arch]
    root: Path | None = request.app.state.artifacts_dir
    if not (tag.startswith("v") and asset.startswith("plexd-") and all(map(wire.safe_component, parts))) \
            or root is None or not root.joinpath(*parts).is_file():
        return Response(status_code=404)  # as a release page answers: no body worth reading
    return FileResponse(root.joinpath(*parts), media_type="application/octet-stream")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


NODE = "/v1/nodes/{node_id}"
ROUTES = [
    Route("/v1/register", register, methods=["POST"]),
    Route(NODE + "/heartbeat", heartbeat, methods=["POST"]),
    Route(NODE + "/state", state, methods=["GET"]),
    Route(NODE + "/events", events, methods=["GET"]),
    Route(NODE + "/executions/{execution_id}", execution_callback, methods=["POST"]),
    Route("/" + platform_executions.UPLOAD_PREFIX + "{token}", upload, methods=["PUT"]),
    Route(NODE + "/capabilities", capabilities, methods=["PUT"]),
    Route(NODE + "/integrity-violations", integrity_violations, methods=["POST"]),
    Route(NODE + "/state/reports/{key}", put_report, methods=["PUT"]),
    Route(NODE + "/state/reports/{key}", delete_report, methods=["DELETE"]),
    Route(NODE + "/endpoint", endpoint, methods=["PUT"]),
    Route(NODE + "/secrets/{name}", secret, methods=["GET"]),
    Route("/v1/keys/rotate", rotate_keys, methods=["POST"]),
    Route(NODE + "/sessions/{session_id}", session_activity, methods=["POST"]),
    Route(NODE + "/metrics", _ingest("metrics"), methods=["POST"]),
    Route(NODE + "/logs", _ingest("logs"), methods=["POST"]),
    Route(NODE + "/audit", _ingest("audit"), methods=["POST"]),
    Route("/v1/health", health, methods=["GET"]),
    Route("/v1/version", version, methods=["GET"]),
    Route("/releases/{tag}/{asset}", release, methods=["GET"]),
]
