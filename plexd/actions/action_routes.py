"""The daemon's socket routes for actions and hooks (``plexd actions``, ``plexd hooks``).

    GET  /v1/daemon/actions        built-ins, hooks (and refused ones), running executions, the outbox
    POST /v1/daemon/actions/run    {"action","parameters":{k: v},"timeout":"30s"} → NDJSON, streamed as it comes:
                                   {"type":"accepted",...}, {"type":"output","stream":"stdout","data":"..."}...,
                                   {"type":"result", <the §1.13 result>, "signal"}
    GET  /v1/daemon/hooks          the hook set: checksums (scanned and announced), sidecars, refusals and why,
                                   and the watcher's state ("watch")
    POST /v1/daemon/hooks/verify   each hook's file hashed now against its scanned and announced checksum
    POST /v1/daemon/hooks/reload   re-scan now and re-announce if anything changed

Actions routes: uid 0, or — when ``actions.local_auth.require_root`` is false — a member of
``actions.local_auth.group``, as SO_PEERCRED says. Hooks routes: the daemon's admin check. A refused local run
answers 4xx with the [C] reason and the detail; an accepted one keeps running if the caller goes away, and its
result goes upstream all the same.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import AsyncIterator
from typing import Any

from plexd.actions import request as rq
from plexd.actions.dispatcher import LOCAL, ActionDispatcher
from plexd.actions.request import InvalidRequest
from plexd.base import boundedjson
from plexd.nodeapi.local_api import Authorize, LocalAPI, LocalAPIError, Request, Response
from plexd.trust.integrity import RefusedHook, inspect_hook

ACTIONS_PATH = "/v1/daemon/actions"
RUN_PATH = "/v1/daemon/actions/run"
HOOKS_PATH = "/v1/daemon/hooks"
VERIFY_PATH = "/v1/daemon/hooks/verify"
RELOAD_PATH = "/v1/daemon/hooks/reload"

STATUS_OF_REASON = {rq.INVALID_REQUEST: 400, rq.ACTIONS_DISABLED: 403, rq.UNKNOWN_ACTION: 404,
                    rq.DUPLICATE: 409, rq.INTEGRITY_VIOLATION: 409, rq.MAX_CONCURRENT: 429, rq.SHUTTING_DOWN: 503}


def local_runner(dispatcher: ActionDispatcher) -> Authorize:
    """Root, or the configured group when the config allows it (read at each request: reloadable)."""

    def check(req: Request) -> str | None:
        auth = dispatcher.config.local_auth
        cred = req.cred
        if cred is not None and (cred.uid == 0 or (not auth.require_root and cred.in_group(auth.group))):
            return None
        if cred is None:
            why = "forbidden: peer credentials unavailable"
        elif auth.require_root:
            why = "forbidden: local actions need root (actions.local_auth.require_root is true)"
        else:
            why = f"forbidden: local actions need root or membership of group {auth.group}"
        if req.path == RUN_PATH:  # an attempt to run something is audited, allowed or not
            dispatcher.audit.record("refused", execution_id="", action=_requested_action(req), reason="forbidden",
                                    detail=why, **({"uid": cred.uid, "gid": cred.gid, "pid": cred.pid}
                                                   if cred else {}))
        return why

    return check


def add_action_routes(api: LocalAPI, dispatcher: ActionDispatcher, admin: Authorize) -> None:
    runner = local_runner(dispatcher)

    async def listing(req: Request) -> Response:
        hooks = dispatcher.hooks.current
        status = dispatcher.status()
        return Response(200, {
            **status, "hook_watch": status["hooks"],
            "builtin_actions": [b.to_wire() for b in dispatcher.builtins.values()],
            "hooks": [h.to_wire() for h in hooks.hooks],
            "refused_hooks": hooks.refused_json()})

    async def run(req: Request) -> Response:
        body = req.json()
        if not isinstance(body, dict):
            raise LocalAPIError(400, "body must be a JSON object")
        request = _local_request(dispatcher, body, req)
        caller = {"uid": req.cred.uid, "gid": req.cred.gid, "pid": req.cred.pid} if req.cred else {}
        output: asyncio.Queue[bytes] = asyncio.Queue()
        decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name in ("stdout", "stderr")}

        def on_output(stream: str, data: bytes) -> None:
            text = decoders[stream].decode(data)
            if text:
                output.put_nowait(_line({"type": "output", "stream": stream, "data": text}))

        try:
            running = await dispatcher.submit(request, LOCAL, on_output=on_output, caller=caller)
        except InvalidRequest as exc:
            return Response(STATUS_OF_REASON.get(exc.reason, 400), {"error": str(exc), "reason": exc.reason})
        return Response(200, stream=_stream(request, running.done, output), content_type="application/x-ndjson")

    async def hooks(req: Request) -> Response:
        hooks = dispatcher.hooks
        return Response(200, {**hooks.current.to_json(hooks.directory, hooks.announced_checksum),
                              "watch": hooks.status()})

    async def verify(req: Request) -> Response:
        return Response(200, await verify_hooks(dispatcher))

    async def reload(req: Request) -> Response:
        changes = await dispatcher.hooks.rescan("plexd hooks reload")
        return Response(200, {"changes": changes, "watch": dispatcher.hooks.status()})

    api.add("GET", ACTIONS_PATH, listing, runner)
    api.add("POST", RUN_PATH, run, runner)
    api.add("GET", HOOKS_PATH, hooks, admin)
    api.add("POST", VERIFY_PATH, verify, admin)
    api.add("POST", RELOAD_PATH, reload, admin)


def _requested_action(req: Request) -> str:
    try:
        return rq.action_of(boundedjson.parse(req.body or b"{}"))
    except ValueError:
        return ""


def _local_request(dispatcher: ActionDispatcher, body: dict[str, Any], req: Request) -> rq.ActionRequest:
    """The body as an action request (the same parser as the control plane's), run as the caller."""
    uid = req.cred.uid if req.cred else -1
    try:
        parsed = rq.parse_request({"execution_id": "local", "action": body.get("action"),
                                   "parameters": body.get("parameters"), "timeout": body.get("timeout")})
    except InvalidRequest as exc:
        raise LocalAPIError(400, str(exc)) from None
    return dispatcher.local_request(parsed.action, parsed.parameters, parsed.timeout, uid)


async def _stream(request: rq.ActionRequest, done: asyncio.Future[dict[str, Any]],
                  output: asyncio.Queue[bytes]) -> AsyncIterator[bytes]:
    yield _line({"type": "accepted", "execution_id": request.execution_id, "action": request.action})
    while True:
        getter = asyncio.ensure_future(output.get())
        await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            yield getter.result()
            continue
        getter.cancel()
        while not output.empty():
            yield output.get_nowait()
        yield _line({"type": "result", **done.result()})
        return


def _line(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def verify_hooks(dispatcher: ActionDispatcher) -> dict[str, Any]:
    """Hash every scanned hook again now: ok when the file still has the scanned and the announced checksum."""
    hooks = dispatcher.hooks
    rows = []
    for hook in hooks.current.hooks:
        found = await asyncio.to_thread(inspect_hook, hooks.directory, hook.name)
        row: dict[str, Any] = {"name": hook.name, "path": hook.path, "scanned": hook.checksum,
                               "announced": hooks.announced_checksum(hook.name), "now": None, "ok": False,
                               "problem": ""}
        if found is None:
            row["problem"] = "the file is gone"
        elif isinstance(found, RefusedHook):
            row["problem"] = f"refused now: {found.reason}"
        else:
            row["now"] = found[0].checksum
            row["problem"], _ = hooks.checksum_problem(hook.name, row["now"], hook.checksum,
                                                       "changed since the last scan")
            row["ok"] = not row["problem"]
        rows.append(row)
    refused = [{"name": r.name, "problem": f"refused: {r.reason}"} for r in hooks.current.refused]
    return {"ok": all(r["ok"] for r in rows) and not refused, "hooks": rows, "refused": refused}


