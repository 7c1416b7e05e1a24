"""Actions in the platform dialect (docs/platform-dialect.md, Executions): the state's ``executions`` block as the
action requests the dispatcher takes, and its acks and results as the one callback route.

The block lists each execution until the control plane has its terminal callback, so it is offered on every pull;
the dispatcher's journal keeps it to one run and one result. Each entry ``{execution_id, action, type, parameters,
status, requested_at, expires_at}`` becomes an `ActionRequest`: without an execution id it is dropped, with fields
that cannot be read it is answered ``failed`` with ``invalid_request``; its status says whether the control plane
holds it as started already, and a missing or zero ``expires_at`` has lapsed.

``POST /v1/nodes/{id}/executions/{eid}`` walks ``ack → started → succeeded | failed | cancelled``:

- an accepted ack posts ``ack`` (unless the last pull showed it acked) and ``started``; a rejected one walks the
  remaining edges to ``failed`` with the reason as the error;
- a result posts the terminal status, with stdout and stderr as one inline output (base64) up to 16 KiB; above,
  ``started`` declares the size, the bytes go to the answer's upload URL (no bearer) and the terminal callback
  names the object; an upload that fails sends the first 16 KiB inline.

An edge already taken (``invalid_state_transition`` before the last step: a resend after a restart) is stepped
over. ``nsk_node_mismatch``, ``invalid_state_transition`` and ``execution_already_terminal`` otherwise settle the
execution: a PermanentError, which the outbox drops with a line; anything else is retried as any report is.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol
from urllib.parse import urlsplit

from plexd.base.errors import PlexdError, WireFormatError
from plexd.base.gojson import parse_time
from plexd.controlplane import http_client
from plexd.controlplane.answers import path_escape
from plexd.controlplane.client_errors import AlreadySettled, ControlPlaneError, PermanentError
from plexd.state.action_request import (
    CANCELLED,
    FAILED,
    SUCCESS,
    TIMEOUT,
    ActionRequest,
    InvalidRequest,
    action_of,
    execution_id_of,
    name_problem,
    parse_request,
)
from plexd.state.model import _fields

log = logging.getLogger(__name__)

JSON = Any
PENDING, ACK, STARTED = "pending", "ack", "started"  # what the block may say of an execution
INLINE_CAP = 16 * 1024  # decoded bytes of inline output
MAX_ERROR_TEXT = 1024
INVALID_TRANSITION = "invalid_state_transition"
NSK_NODE_MISMATCH = "nsk_node_mismatch"  # a refusal: this node may not report on it (an error, not a settle)
SETTLED = frozenset({NSK_NODE_MISMATCH, INVALID_TRANSITION, "execution_already_terminal"})
TERMINAL = {SUCCESS: "succeeded", CANCELLED: "cancelled"}  # every other outcome is "failed"


class ControlPlaneClient(Protocol):
    """What the callbacks use of `plexd.controlplane.client.ControlPlaneClient` (which hands itself in)."""

    base_url: str
    user_agent: str
    request_timeout: float
    _http: http_client.HTTPClient

    async def _json(self, method: str, path: str, body: JSON = None, *, has_body: bool = False,
                    token: str | None = None, what: str = "") -> JSON: ...


# -- the block ---------------------------------------------------------------------------------------------------

def action_requests(block: Any) -> tuple[ActionRequest, ...]:
    """The entries of an ``executions`` block as action requests, in block order; `null` is none."""
    if block is None:
        return ()
    if not isinstance(block, list):
        log.warning("the state's executions block is not an array; no action taken from it")
        return ()
    out = []
    for i, entry in enumerate(block):
        request = _request(entry, f"executions[{i}]")
        if request is not None:
            out.append(request)
    return tuple(out)


def _request(entry: Any, path: str) -> ActionRequest | None:
    try:
        f = _fields(entry, path)
        execution_id = execution_id_of(f)
    except WireFormatError as exc:  # not an object, or no usable execution id
        log.warning("%s dropped: %s", path, exc)  # nothing to answer it by
        return None
    status = f.get("status")
    if status not in (PENDING, ACK, STARTED):
        log.warning("execution %s skipped: status %r is not one a node acts on", execution_id, str(status)[:20])
        return None
    kind = f.get("type")
    extra = {"kind": kind[:64] if isinstance(kind, str) else "" if kind is None else "?",
             "expires_at": _unix(f.get("expires_at")), "reported_started": status == STARTED,
             "checksum_announced": True}
    payload = {"execution_id": execution_id, "action": f.get("action"),
               "parameters": _as_spec_parameters(f.get("action"), f.get("parameters"))}
    try:
        return replace(parse_request(payload), **extra)
    except InvalidRequest as exc:
        action = action_of(payload)
        return ActionRequest(execution_id, "" if name_problem(action) else action, problem=str(exc), **extra)


UPGRADE = "service.upgrade"
_RELEASE_TAG = re.compile(r"[vV](?=[0-9])")  # the platform names releases by tag (v1.4.2); plexd by version (1.4.2)
_CHECKSUM_PREFIX = "sha256:"


def _as_spec_parameters(action: Any, parameters: Any) -> Any:
    """`service.upgrade`'s parameters as the platform may word them, in the spec's words: a version may be its
    release tag (``v1.4.2``: the store's path adds the ``v`` back) and a checksum may carry ``sha256:``."""
    if action != UPGRADE or not isinstance(parameters, dict):
        return parameters
    out = dict(parameters)
    version, checksum = out.get("version"), out.get("checksum")
    if isinstance(version, str) and _RELEASE_TAG.match(version):
        out["version"] = version[1:]
    if isinstance(checksum, str) and checksum[:len(_CHECKSUM_PREFIX)].lower() == _CHECKSUM_PREFIX:
        out["checksum"] = checksum[len(_CHECKSUM_PREFIX):]
    return out


def _unix(value: Any) -> float:
    """An absolute time as unix seconds; 0 (long lapsed) when absent, zero or unreadable."""
    try:
        return max(0.0, parse_time(value).timestamp()) if isinstance(value, str) else 0.0
    except (ValueError, OverflowError):
        return 0.0


class Statuses:
    """What the last pull said of each listed execution (pending, ack, started): an ack skips the edges taken."""

    def __init__(self) -> None:
        self._of: dict[str, str] = {}

    def note(self, doc: JSON) -> None:
        block = doc.get("executions") if isinstance(doc, dict) else None
        self._of = {e["execution_id"]: e["status"] for e in block if isinstance(e, dict)
                    and isinstance(e.get("execution_id"), str) and isinstance(e.get("status"), str)
                    } if isinstance(block, list) else {}

    def of(self, execution_id: str) -> str:
        return self._of.get(execution_id, PENDING)


# -- the callbacks ------------------------------------------------------------------------------------------------

async def acknowledge(client: ControlPlaneClient, node_id: str, execution_id: str, status: str, reason: str,
                      pulled: str) -> None:
    """The spec's ack (``accepted`` or ``rejected`` with `reason`) as the edges from `pulled` on."""
    steps: list[dict[str, JSON]] = [{"status": ACK}, {"status": STARTED}]
    if status != "accepted":
        steps.append({"status": "failed", "error": reason or "rejected"})
    await _walk(client, node_id, execution_id, steps[{ACK: 1, STARTED: 2}.get(pulled, 0):])


async def report_result(client: ControlPlaneClient, node_id: str, execution_id: str,
                        result: Mapping[str, JSON]) -> None:
    """The spec's result body (`plexd.actions.dispatcher.result_body`) as the terminal callback."""
    body = terminal_body(result)
    output = (str(result.get("stdout") or "") + str(result.get("stderr") or "")).encode("utf-8", "replace")
    if output:
        body["output"] = await _output(client, node_id, execution_id, output)
    await _walk(client, node_id, execution_id, [body])


def terminal_body(result: Mapping[str, JSON]) -> dict[str, JSON]:
    """Status, the exit code of a process that exited on its own, and the error of a failure (no output)."""
    status, code = result.get("status"), result.get("exit_code")
    body: dict[str, JSON] = {"status": TERMINAL.get(str(status), "failed")}
    if status in (SUCCESS, FAILED) and isinstance(code, int):
        body["exit_code"] = code
    if body["status"] == "failed":
        body["error"] = _error(result)
    return body


def _error(result: Mapping[str, JSON]) -> str:
    status = result.get("status")
    if status == FAILED:
        return f"exit status {result.get('exit_code')}"
    if status == TIMEOUT:
        return f"timed out after {result.get('duration')}"
    # plexd's own reason (an interrupted run, an internal error) is the last line it wrote to stderr
    lines = [line for line in str(result.get("stderr") or "").splitlines() if line.strip()]
    return (lines[-1].strip() if lines else str(status or "error"))[:MAX_ERROR_TEXT]


async def _output(client: ControlPlaneClient, node_id: str, execution_id: str, data: bytes) -> dict[str, JSON]:
    if len(data) <= INLINE_CAP:
        return {"inline": _b64(data)}
    try:
        answer = await _post(client, node_id, execution_id, {"status": STARTED, "declared_output_bytes": len(data)})
    except AlreadySettled:
        raise
    except ControlPlaneError as exc:  # a control plane that takes no declared output still gets the result
        log.warning("execution %s: its output (%d bytes) could not be declared (%s); the first %d bytes go inline",
                    execution_id, len(data), exc, INLINE_CAP, extra={"execution_id": execution_id})
        return {"inline": _b64(data[:INLINE_CAP])}
    try:
        object_key = await _upload(client, answer.get("output_upload_url") if isinstance(answer, dict) else None,
                                   data)
    except UploadFailed as exc:
        log.warning("execution %s: its output (%d bytes) could not be uploaded (%s); the first %d bytes go inline",
                    execution_id, len(data), exc, INLINE_CAP, extra={"execution_id": execution_id})
        return {"inline": _b64(data[:INLINE_CAP])}
    return {"object_key": object_key, "sha256": hashlib.sha256(data).hexdigest()}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def _walk(client: ControlPlaneClient, node_id: str, execution_id: str,
                steps: Sequence[dict[str, JSON]]) -> None:
    for i, body in enumerate(steps):
        try:
            await _post(client, node_id, execution_id, body)
        except PermanentError as exc:
            if exc.code != INVALID_TRANSITION or i == len(steps) - 1:
                raise
            log.debug("execution %s: %s taken already", execution_id, body["status"])


async def _post(client: ControlPlaneClient, node_id: str, execution_id: str, body: dict[str, JSON]) -> JSON:
    what = f"execution {body['status']} callback"
    path = f"/v1/nodes/{path_escape(node_id)}/executions/{path_escape(execution_id)}"
    try:
        return await client._json("POST", path, body, has_body=True, what=what)
    except ControlPlaneError as exc:
        if exc.code not in SETTLED:
            raise
        settled = AlreadySettled if exc.code != NSK_NODE_MISMATCH else PermanentError
        raise settled(what, exc.status, f"execution {execution_id} is settled on the control plane: {exc.message}",
                      exc.code) from None


class UploadFailed(PlexdError):
    """The output could not be put where the control plane said."""


async def _upload(client: ControlPlaneClient, url: Any, data: bytes) -> str:
    """PUT `data` to the presigned `url`, without the bearer and following no redirect; the object key is its path."""
    if not isinstance(url, str) or not url:
        raise UploadFailed("the declaring callback's answer has no output_upload_url")
    target = urlsplit(url)
    weaker = urlsplit(client.base_url).scheme == "https" and target.scheme != "https"
    if target.scheme not in ("http", "https") or weaker:
        raise UploadFailed(f"the upload URL's scheme {target.scheme!r} is weaker than the control plane's")
    headers = {"User-Agent": client.user_agent, "Content-Type": "application/octet-stream"}
    try:
        async with asyncio.timeout(client.request_timeout):
            response = await client._http.send("PUT", url, headers=headers, content=data)
            try:
                await response.aread(4096, truncate=True)
            finally:
                await response.aclose()
    except TimeoutError:
        raise UploadFailed(f"no answer within {client.request_timeout:g}s") from None
    except http_client.RequestFailed as exc:
        raise UploadFailed(str(exc)) from None
    if not 200 <= response.status_code < 300:
        raise UploadFailed(f"HTTP {response.status_code}")
    return target.path.lstrip("/")
