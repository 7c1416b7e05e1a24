"""The agent-facing HTTP API (docs/protocol.md §1.2) and the SSE stream (§2), as a Starlette app.

Handlers authenticate (Bearer node secret), read and type-check the body (wire.py), and hand over to the
Deployment. Every error a client can cause is a JSON `{"error": "..."}` with the documented status. A deployment
of the platform dialect gets platform_routes instead, whose errors (and this app's 404s, 405s and injected
faults) are problem+json; the admin API is the same in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from plexd.devplane import admin, platform_routes, wire
from plexd.devplane.admission import StreamAdmission
from plexd.devplane.deployment import Deployment, cancel_quietly
from plexd.devplane.events import format_sse, parse_event_id
from plexd.devplane.platform_state import Reachability
from plexd.devplane.platform_wire import problem_response
from plexd.devplane.sse_stream import event_stream
from plexd.devplane.wire import DevplaneAPIError, bearer, error_response, read_json

log = logging.getLogger(__name__)

_EVENTS_PATH = re.compile(r"^/v1/nodes/[^/]+/events$")
_STATE_PATH = re.compile(r"^/v1/nodes/[^/]+/state$")


def _dep(request: Request) -> Deployment:
    return request.app.state.deployment


def _node(request: Request) -> Any:
    return _dep(request).authenticate(bearer(request), request.path_params["node_id"])


def _object(body: Any) -> dict[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise DevplaneAPIError(400, f"body: must be a JSON object, got {wire.kind(body)}")
    return {k.lower(): v for k, v in body.items()}


def ok() -> JSONResponse:
    return JSONResponse({})


# -- registration and liveness ----------------------------------------------------------------------------------

async def register(request: Request) -> Response:
    body = _object(await read_json(request, wire.REGISTER))
    return JSONResponse(_dep(request).register(body, bearer(request)), status_code=201)


async def heartbeat(request: Request) -> Response:
    node = _node(request)
    body = _object(await read_json(request, wire.HEARTBEAT, allow_empty=True))
    return JSONResponse(_dep(request).heartbeat(node, body))


async def deregister(request: Request) -> Response:
    node = _node(request)
    # `?purge=true` (plexd deregister --purge; a Go control plane ignores it) also revokes the secret and frees the
    # mesh IP; without it the node may come back with its secret as the same node.
    purge = request.query_params.get("purge", "") in ("1", "true")
    _dep(request).remove(node, "deregistered and purged" if purge else "deregistered", rejoinable=not purge)
    return ok()


async def rotate_key(request: Request) -> Response:
    dep = _dep(request)
    token = bearer(request)
    caller = dep.by_secret.get(token or "")
    if caller is None:
        raise DevplaneAPIError(401, "invalid node secret")
    body = _object(await read_json(request, wire.KEY_ROTATE))
    node_id = body.get("node_id") or caller.id
    node = dep.authenticate(token, node_id)
    status = dep.faults.get("rotate_status")
    if status:
        raise DevplaneAPIError(int(status), f"injected fault: key rotation refused with {status}")
    peers = dep.rotate_node_key(node, body.get("new_public_key") or "")
    await asyncio.sleep(int(dep.faults.get("rotate_answer_after") or 0))  # taken, but the answer is late
    return JSONResponse({"updated_peers": peers})


async def capabilities(request: Request) -> Response:
    node = _node(request)
    body = _object(await read_json(request, wire.CAPABILITIES))
    dep = _dep(request)
    with dep.store.transaction():
        node.capabilities = body
        dep.store.save_node(node)
        dep.store.add_record(node.id, "capabilities", dep.now_text(), wire_json(body))
    return ok()


async def endpoint(request: Request) -> Response:
    node = _node(request)
    body = _object(await read_json(request, wire.ENDPOINT))
    public = body.get("public_endpoint") or ""
    if public and not wire.is_host_port(public):
        raise DevplaneAPIError(400, f"public_endpoint: {public!r} is not HOST:PORT")
    dep = _dep(request)
    dep.store.add_record(node.id, "endpoint", dep.now_text(), wire_json(body))
    if public:
        dep.set_endpoint(node, public, body.get("nat_type") or "")
    return JSONResponse({"peer_endpoints": dep.peer_endpoints(node)})


# -- state, secrets, reports ------------------------------------------------------------------------------------

async def state(request: Request) -> Response:
    """The node's state, with an ETag of its bytes (`wire.etagged_json`)."""
    node = _node(request)
    return wire.etagged_json(request, _dep(request).state(node))


async def secret(request: Request) -> Response:
    node = _node(request)
    return JSONResponse(_dep(request).secret(node, request.path_params["key"]))


def wire_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


async def report(request: Request) -> Response:
    """§1.12: kept as a record (what was sent) and folded into the node's current report entries."""
    node = _node(request)
    body = _object(await read_json(request, wire.REPORT))
    dep = _dep(request)
    status = dep.faults.get("report_status")
    if status:  # a control plane that refuses report batches (a 409 on a version it does not accept)
        raise DevplaneAPIError(int(status), f"injected fault: report batch refused with {status}")
    entries = []
    for i, entry in enumerate(body.get("entries") or []):
        entry = _object(entry) if isinstance(entry, dict) else entry  # Go's keys are case-insensitive
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"]:
            raise DevplaneAPIError(400, f"entries[{i}]: must be an object with a key")  # a 500 was retried for ever
        entries.append(entry)
    deleted = body.get("deleted") or []
    if not isinstance(deleted, list) or not all(isinstance(k, str) for k in deleted):
        raise DevplaneAPIError(400, "deleted: must be a list of keys")
    dep.record_reports(node, entries, deleted)
    return ok()


def _recorder(kind: str, schema: Any, *, array: bool = False) -> Any:
    async def handler(request: Request) -> Response:
        node = _node(request)
        body = await read_json(request, schema)
        if not array:
            _object(body)
        dep = _dep(request)
        dep.store.add_record(node.id, kind, dep.now_text(), wire_json(body))
        return ok()

    handler.__name__ = f"record_{kind}"
    return handler


def _execution(part: str, schema: Any) -> Any:
    async def handler(request: Request) -> Response:
        node = _node(request)
        body = _object(await read_json(request, schema))
        execution_id = request.path_params["execution_id"]
        body_id = body.get("execution_id")
        if body_id and body_id != execution_id:
            raise DevplaneAPIError(400, f"execution_id: {body_id!r} does not match the path's {execution_id!r}")
        _dep(request).record_execution(node, execution_id, part, body)
        return ok()

    handler.__name__ = f"execution_{part}"
    return handler


def _tunnel(kind: str, schema: Any) -> Any:
    async def handler(request: Request) -> Response:
        node = _node(request)
        body = _object(await read_json(request, schema))
        body = {"session_id": request.path_params["session_id"], **body}
        dep = _dep(request)
        dep.store.add_record(node.id, kind, dep.now_text(), wire_json(body))
        return ok()

    handler.__name__ = kind
    return handler


async def session_activity(request: Request) -> Response:
    """§A1.4: what happened in a session (a command, a Kubernetes request, a TCP phase with its listener)."""
    node = _node(request)
    body = await read_json(request)
    _dep(request).session_activity(node, request.path_params["session_id"], body)
    return ok()


async def artifact(request: Request) -> Response:
    dep = _dep(request)
    if dep.by_secret.get(bearer(request) or "") is None:
        raise DevplaneAPIError(401, "invalid node secret")
    parts = [request.path_params[k] for k in ("version", "os", "arch")]
    for part in parts:
        if not wire.safe_component(part):
            raise DevplaneAPIError(400, f"invalid artifact path component {part!r}")
    root: Path | None = request.app.state.artifacts_dir
    path = root.joinpath(*parts) if root else None
    if path is None or not path.is_file():
        raise DevplaneAPIError(404, f"no artifact plexd/{'/'.join(parts)}")
    return FileResponse(path, media_type="application/octet-stream")


async def ping(request: Request) -> Response:
    return ok()


# -- SSE (§2) ---------------------------------------------------------------------------------------------------

async def events(request: Request) -> Response:
    node = _node(request)
    dep = _dep(request)
    retry_after = request.app.state.admission.admit()
    if retry_after is not None:
        raise DevplaneAPIError(503, "too many event streams opening at once; retry later",
                        {"Retry-After": str(retry_after)})
    last = request.headers.get("last-event-id")
    after = parse_event_id(last) if last else None
    if last and after is None:
        log.info("ignoring unknown Last-Event-ID %r", last[:64], extra={"node_id": node.id})
    return event_stream(dep, node.id, after, lambda: dep.hub.backlog(node.id, after, dep.replay_window),
                        keepalive=request.app.state.keepalive, render=format_sse, keepalive_comment="keepalive",
                        headers={"Cache-Control": "no-cache"})


# -- faults -----------------------------------------------------------------------------------------------------

class FaultMiddleware:
    """Injected failures for the agent's resilience tests; only on the agent API, never on /admin."""

    def __init__(self, app: ASGIApp, deployment: Deployment) -> None:
        self.app = app
        self.deployment = deployment

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            self.deployment.requests.count(scope["app"].router.routes, scope)
            faults = self.deployment.faults
            status = faults.get("all_status")
            if not status and _EVENTS_PATH.match(scope["path"]):
                status = faults.get("events_status")
            body = faults.get("state_body")
            if body and not status and _STATE_PATH.match(scope["path"]):  # a 200 with a body of the test's choice
                await Response(body, status_code=200, media_type="application/json")(scope, receive, send)
                return
            if status:
                headers = {}
                if int(status) == 429 and faults.get("retry_after"):
                    headers["Retry-After"] = str(faults["retry_after"])
                code = _FAULT_CODES.get(int(status), "") if _EVENTS_PATH.match(scope["path"]) else ""
                response = render_error(self.deployment, scope["path"], int(status),
                                        f"injected fault: status {status}", headers, code)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# What the platform's event route says with these statuses (plexd keys its delivery mode on the code).
_FAULT_CODES = {501: "signed_event_bus_not_provisioned", 503: "event_stream_unavailable"}


def render_error(dep: Deployment, path: str, status: int, message: str, headers: dict[str, str] | None = None,
                 code: str = "") -> Response:
    """An error as the dialect says it: the platform's node API answers problem+json, everything else (the spec
    dialect, the admin API in both) `{"error": message}`."""
    if dep.dialect == "platform" and not path.startswith(admin.PREFIX + "/"):
        return problem_response(status, code, message, path, headers)
    return error_response(status, message, headers)


# -- app --------------------------------------------------------------------------------------------------------

async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, DevplaneAPIError)
    return render_error(_dep(request), request.url.path, exc.status, exc.message, exc.headers,
                        getattr(exc, "code", ""))


async def _starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return render_error(_dep(request), request.url.path, exc.status_code, message, exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return render_error(_dep(request), request.url.path, 500, "internal error (see the devplane log)")


NODE = "/v1/nodes/{node_id}"
ROUTES = [
    Route("/v1/register", register, methods=["POST"]),
    Route(NODE + "/events", events, methods=["GET"]),
    Route(NODE + "/heartbeat", heartbeat, methods=["POST"]),
    Route(NODE + "/deregister", deregister, methods=["POST"]),
    Route("/v1/keys/rotate", rotate_key, methods=["POST"]),
    Route(NODE + "/capabilities", capabilities, methods=["PUT"]),
    Route(NODE + "/endpoint", endpoint, methods=["PUT"]),
    Route(NODE + "/state", state, methods=["GET"]),
    Route(NODE + "/drift", _recorder("drift", wire.DRIFT), methods=["POST"]),
    Route(NODE + "/secrets/{key:path}", secret, methods=["GET"]),
    Route(NODE + "/report", report, methods=["POST"]),
    Route(NODE + "/executions/{execution_id}/ack", _execution("ack", wire.ACK), methods=["POST"]),
    Route(NODE + "/executions/{execution_id}/result", _execution("result", wire.RESULT), methods=["POST"]),
    Route(NODE + "/metrics", _recorder("metrics", wire.METRICS, array=True), methods=["POST"]),
    Route(NODE + "/logs", _recorder("logs", wire.LOGS, array=True), methods=["POST"]),
    Route(NODE + "/audit", _recorder("audit", wire.AUDIT, array=True), methods=["POST"]),
    Route("/v1/artifacts/plexd/{version}/{os}/{arch}", artifact, methods=["GET"]),
    Route(NODE + "/tunnels/{session_id}/ready", _tunnel("tunnel_ready", wire.TUNNEL_READY), methods=["POST"]),
    Route(NODE + "/tunnels/{session_id}/closed", _tunnel("tunnel_closed", wire.TUNNEL_CLOSED), methods=["POST"]),
    Route(NODE + "/integrity/violations", _recorder("integrity", wire.INTEGRITY), methods=["POST"]),
    Route(NODE + "/sessions/{session_id}", session_activity, methods=["POST"]),
    Route("/v1/ping", ping, methods=["GET"]),
]


def create_app(
    deployment: Deployment,
    *,
    admin_token: str,
    keepalive: float = 15.0,
    artifacts_dir: Path | None = None,
) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(deployment.run_liveness())
        try:
            yield
        finally:
            await cancel_quietly(task)

    node_api = platform_routes.ROUTES if deployment.dialect == "platform" else ROUTES
    app = Starlette(
        routes=[*node_api, admin.mount()],
        exception_handlers={DevplaneAPIError: _http_error, HTTPException: _starlette_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.deployment = deployment
    app.state.admin_token = admin_token
    app.state.keepalive = keepalive
    app.state.artifacts_dir = artifacts_dir
    app.state.admission = StreamAdmission(lambda: len(deployment.nodes))
    app.state.reachability = Reachability()  # the platform dialect's verdicts and when they changed
    app.add_middleware(FaultMiddleware, deployment=deployment)
    return app

