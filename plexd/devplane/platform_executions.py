"""Actions in the platform dialect: the `executions` block of a node's state and the one callback route.

An admin's action request queues an execution (`pending`, with an absolute `expires_at`) and publishes
`action_request`; the node finds it in its next pull. The node reports its way through
`POST /v1/nodes/{id}/executions/{eid}` along the legal edges: pending → ack → started → succeeded | failed |
cancelled, and started → started only to declare an output larger than the 16 KiB inline ceiling, which answers
a one-time upload URL on this devplane (`PUT /v1/uploads/{token}`, no bearer). A terminal execution leaves the
block; one whose `expires_at` passed leaves it too, and after a grace minute (a result posted right at the
deadline still lands) it is `timeout`, terminal.

Every callback that reaches a known execution is kept in its document, refused ones with their status and code,
so a test reads what the node said in order (`admin executions NODE`).
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from datetime import timedelta
from typing import Any

from plexd.base import gojson
from plexd.devplane.platform_wire import Problem, is_int, std_b64_bytes, strict_object, uuid7
from plexd.devplane.store import Node
from plexd.devplane.wire import DevplaneAPIError

INLINE_CAP = 16 * 1024  # decoded inline output
BODY_CAP = 64 * 1024
MAX_DECLARED = 16 << 20  # what the devplane keeps of an uploaded output
DEFAULT_TIMEOUT = 300.0
GRACE = 60.0
CALLBACKS_KEPT = 50
EXECUTIONS_KEPT_PER_NODE = 1000
UPLOAD_PREFIX = "v1/uploads/"

REPORTABLE = ("ack", "started", "succeeded", "failed", "cancelled")  # pending and timeout are the server's
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "timeout"})
_NEXT = {"pending": {"ack"}, "ack": {"started"}, "started": {"succeeded", "failed", "cancelled"}}
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
MALFORMED = "malformed_execution_callback"


def _hook_names(capabilities: Any) -> set[str]:
    hooks = capabilities.get("declared_hooks") if isinstance(capabilities, dict) else None
    return {h["name"] for h in hooks or () if isinstance(h, dict) and isinstance(h.get("name"), str)}


def queue(dep: Any, node: Node, action: str, parameters: dict[str, Any], timeout: str | None,
          action_type: str | None = None) -> str:
    """Queue an execution for `node` and tell it; a hook is an action the node declared as one."""
    try:
        seconds = gojson.parse_duration(timeout) if timeout else DEFAULT_TIMEOUT
    except ValueError as exc:
        raise DevplaneAPIError(400, f"timeout: {exc}") from None
    if seconds <= 0:
        raise DevplaneAPIError(400, f"timeout: must be positive, got {timeout!r}")
    kind = action_type or ("hook" if action in _hook_names(node.capabilities) else "builtin")
    now = dep.clock.now()
    execution_id = uuid7()
    doc = {"execution_id": execution_id, "action": action, "type": kind, "parameters": parameters,
           "status": "pending", "requested_at": gojson.format_time(now),
           "expires_at": gojson.format_time(now + timedelta(seconds=seconds)),
           "exit_code": None, "error": None, "output": None, "upload": None, "callbacks": []}
    with dep.store.transaction():
        dep.store.save_execution(node.id, execution_id, doc)
        dep.store.prune_executions(node.id, EXECUTIONS_KEPT_PER_NODE)
        _announce(dep, node, doc, seconds)
    return execution_id


def _announce(dep: Any, node: Node, doc: dict[str, Any], seconds: float) -> str:
    payload = {"execution_id": doc["execution_id"], "node_id": node.id, "action": doc["action"],
               "type": doc["type"], "parameters": doc["parameters"], "timeout_seconds": int(seconds),
               "occurred_at": dep.now_text(),
               "callback_url": f"/v1/nodes/{node.id}/executions/{doc['execution_id']}"}
    return dep.hub.publish([node.id], "action_request", payload)


def resend(dep: Any, node: Node, execution_id: str) -> str:
    """`action_request` again for a queued execution (a control plane retrying); the block stays as it is."""
    doc = dep.store.execution(node.id, execution_id)
    if doc is None or "callbacks" not in doc:
        raise KeyError(execution_id)
    seconds = (gojson.parse_time(doc["expires_at"]) - gojson.parse_time(doc["requested_at"])).total_seconds()
    with dep.store.transaction():
        return _announce(dep, node, doc, seconds)


def block(dep: Any, node: Node) -> list[dict[str, Any]]:
    """The node's `executions` block: queued and running executions not yet past `expires_at`, oldest first."""
    now = dep.clock.now()
    live = [d for d in dep.store.executions(node.id) if d.get("status") in _NEXT
            and "callbacks" in d and gojson.parse_time(d["expires_at"]) > now]
    live.sort(key=lambda d: (gojson.parse_time(d["requested_at"]), d["execution_id"]))
    return [{k: d[k] for k in ("execution_id", "action", "type", "parameters", "status", "requested_at",
                               "expires_at")} for d in live]


# -- the callback ------------------------------------------------------------------------------------------------

def _check(body: Any) -> tuple[dict[str, Any], int]:
    """The callback's fields checked (400 malformed_execution_callback); returns them and the inline size."""
    body = strict_object(body, ("status", "exit_code", "error", "declared_output_bytes", "output"), MALFORMED)
    if body.get("status") not in REPORTABLE:
        raise Problem(400, MALFORMED, f"status: must be one of {', '.join(REPORTABLE)}")
    if body.get("exit_code") is not None and not is_int(body["exit_code"]):
        raise Problem(400, MALFORMED, "exit_code: must be an integer")
    if body.get("error") is not None and not isinstance(body["error"], str):
        raise Problem(400, MALFORMED, "error: must be a string")
    declared = body.get("declared_output_bytes")
    if declared is not None and (not is_int(declared) or declared < 0):
        raise Problem(400, MALFORMED, "declared_output_bytes: must be a whole number")
    output = body.get("output")
    inline = 0
    if output is not None:
        output = strict_object(output, ("inline", "object_key", "sha256"), MALFORMED, "output")
        if output.get("inline") is not None:
            raw = std_b64_bytes(output["inline"]) if output["inline"] != "" else b""
            if raw is None:
                raise Problem(400, MALFORMED, "output.inline: must be standard base64")
            inline = len(raw)
        key, digest = output.get("object_key"), output.get("sha256")
        if (key is None) != (digest is None) or (key is not None and not isinstance(key, str)):
            raise Problem(400, MALFORMED, "output: object_key and sha256 go together")
        if digest is not None and not (isinstance(digest, str) and _SHA256_HEX.match(digest)):
            raise Problem(400, MALFORMED, "output.sha256: must be 64 lower-case hex digits")
    return body, inline


def callback(dep: Any, node: Node, execution_id: str, body: Any, base_url: str) -> dict[str, Any]:
    """Apply one callback; returns the answer `{status[, output_upload_url]}` or raises the refusal. Either way
    it is kept in the execution's `callbacks`."""
    doc = dep.store.execution(node.id, execution_id)
    if doc is None or "callbacks" not in doc:
        raise Problem(404, "execution_not_found", f"node {node.id} has no execution {execution_id!r}")
    entry: dict[str, Any] = {"received_at": dep.now_text(), "body": body}
    try:
        answer = _advance(dep, node, doc, body, base_url)
        entry.update(http_status=200, code="")
        return answer
    except Problem as exc:
        entry.update(http_status=exc.status, code=exc.code)
        raise
    finally:
        if len(doc["callbacks"]) < CALLBACKS_KEPT:  # a node repeating itself for ever must not grow the row
            doc["callbacks"].append(entry)
        dep.store.save_execution(node.id, execution_id, doc)


def _advance(dep: Any, node: Node, doc: dict[str, Any], body: Any, base_url: str) -> dict[str, Any]:
    body, inline = _check(body)
    if inline > INLINE_CAP:
        raise Problem(413, "inline_output_too_large", f"output.inline decodes to {inline} bytes, more than "
                                                      f"{INLINE_CAP}; declare it and upload it instead")
    now = dep.clock.now()
    if doc["status"] not in TERMINAL and now > gojson.parse_time(doc["expires_at"]) + timedelta(seconds=GRACE):
        doc["status"] = "timeout"
    status, new = doc["status"], body["status"]
    if status in TERMINAL:
        raise Problem(409, "execution_already_terminal", f"execution {doc['execution_id']} is already {status}")
    declared = body.get("declared_output_bytes") or 0
    if new not in _NEXT.get(status, ()) and not (status == new == "started" and declared > 0):
        raise Problem(409, "invalid_state_transition", f"execution {doc['execution_id']}: {status} -> {new} is not "
                                                       "a legal transition")
    answer: dict[str, Any] = {"status": new}
    if new == "started" and declared > INLINE_CAP:
        if declared > MAX_DECLARED:
            raise Problem(400, MALFORMED, f"declared_output_bytes: this devplane keeps at most {MAX_DECLARED} bytes")
        token = secrets.token_urlsafe(24)
        dep.store.add_upload(token, node.id, doc["execution_id"], declared)
        doc["upload"] = {"object_key": UPLOAD_PREFIX + token, "declared": declared}
        answer["output_upload_url"] = base_url.rstrip("/") + "/" + UPLOAD_PREFIX + token
    output = body.get("output")
    if output and output.get("object_key") is not None:
        _check_upload(dep, doc, output)
    doc["status"] = new
    if new in TERMINAL:
        doc.update(exit_code=body.get("exit_code"), error=body.get("error"), output=output)
    return answer


def _check_upload(dep: Any, doc: dict[str, Any], output: dict[str, Any]) -> None:
    upload = doc.get("upload") or {}
    if output["object_key"] != upload.get("object_key"):
        raise Problem(400, MALFORMED, "output.object_key: not the upload this execution was given")
    stored = dep.store.upload(upload["object_key"].removeprefix(UPLOAD_PREFIX))
    if stored is None or stored["sha256"] is None:
        raise Problem(400, MALFORMED, "output.object_key: nothing was uploaded there")
    if stored["sha256"] != output["sha256"]:
        raise Problem(400, MALFORMED, "output.sha256: does not match the uploaded bytes")


def upload(dep: Any, token: str, data: bytes) -> None:
    """Keep the bytes PUT to an upload URL: once, and no more than declared."""
    stored = dep.store.upload(token)
    if stored is None:
        raise Problem(404, "upload_not_found", "no such upload")
    if stored["data"] is not None:
        raise Problem(409, "upload_already_used", "this upload URL was used already")
    if len(data) > stored["declared"]:
        raise Problem(413, "upload_too_large", f"{len(data)} bytes, more than the {stored['declared']} declared")
    dep.store.finish_upload(token, hashlib.sha256(data).hexdigest(), data)


def output_bytes(dep: Any, node_id: str, execution_id: str) -> bytes | None:
    """What an execution's terminal callback delivered: the inline output decoded, or the uploaded object."""
    doc = dep.store.execution(node_id, execution_id)
    output = (doc or {}).get("output") or {}
    if output.get("object_key"):
        stored = dep.store.upload(output["object_key"].removeprefix(UPLOAD_PREFIX))
        return stored["data"] if stored else None
    if output.get("inline") is not None:
        return base64.b64decode(output["inline"])
    return None
