"""An action request (docs/protocol.md §7.3), parsed strictly and bounded: what the dispatcher
(`plexd.actions.dispatcher`) admits and runs, whichever way it came.

It comes as the payload of a spec ``action_request`` event, or as an entry of the platform state's ``executions``
block, which the wire layer (`plexd.controlplane.platform_actions`) turns into the same request, with what that
contract adds (`kind`, `expires_at`, `reported_started`, `checksum_announced`, `problem`): a request that comes in
the state is offered on every pull until the control plane has its result, so the dispatcher must know when it
lapses and whether the control plane already holds it as started.

Keys are matched case-insensitively, as Go's decoder does. Parameters are ``map[string]string`` on the wire; as
settled (docs/decisions.md, Actions) any JSON scalar is accepted and stringified (``true``, ``3``,
``null`` → ``""``), an object or array refuses the request with ``invalid_request`` naming the parameter — never
a silent drop. A request without an ``execution_id`` cannot be acknowledged at all: `MissingExecutionId`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from plexd.base.errors import PlexdError, WireFormatError
from plexd.base.gojson import parse_duration
from plexd.state.fields import object_fields as _fields  # Go's case-insensitive keys

# Ack reasons ([C] vocabulary, plus the two the project decisions add).
ACTIONS_DISABLED = "actions_disabled"
SHUTTING_DOWN = "shutting_down"
DUPLICATE = "duplicate_execution_id"
MAX_CONCURRENT = "max_concurrent_reached"
UNKNOWN_ACTION = "unknown_action"
INVALID_REQUEST = "invalid_request"
INTEGRITY_VIOLATION = "integrity_violation"
UNSUPPORTED_TYPE = "unsupported_action_type"  # a `kind` neither builtin nor hook

BUILTIN, HOOK = "builtin", "hook"  # the kinds

# Result statuses ([C]).
SUCCESS, FAILED, TIMEOUT, CANCELLED, ERROR = "success", "failed", "timeout", "cancelled", "error"

MAX_ID_BYTES = 256
MAX_NAME_BYTES = 255
MAX_PARAMETERS = 64
MAX_PARAMETER_BYTES = 32 << 10  # one value; the kernel refuses a single environment string over 128 KiB
MAX_PARAMETERS_BYTES = 256 << 10  # all of them
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENV_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


FOR_NOW = frozenset({SHUTTING_DOWN, DUPLICATE, MAX_CONCURRENT})  # refusals a later offer may not meet


class InvalidRequest(PlexdError):
    """The request is refused with `reason` (``invalid_request`` unless said otherwise); the message says why.
    `for_now`: refused only as things are now (busy, shutting down, running already, the journal unwritable), so a
    request the control plane offers again (`ActionDispatcher.offer`) may pass later."""

    def __init__(self, message: str, reason: str = INVALID_REQUEST, *, for_now: bool | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.for_now = reason in FOR_NOW if for_now is None else for_now


class MissingExecutionId(WireFormatError):
    """No usable execution id: nothing can be acknowledged, the event is refused as a bad payload."""


@dataclass(frozen=True)
class ActionRequest:
    execution_id: str
    action: str
    parameters: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None  # seconds; None: the hook's sidecar, else actions.timeout
    checksum: str = ""
    triggered_by: dict[str, Any] | None = None  # echoed verbatim in the result
    # From a control plane that lists its executions in the state (see the module's docstring); a spec event
    # leaves them as they are.
    kind: str = ""  # "builtin" or "hook": where the action is looked up ("" either)
    expires_at: float | None = None  # unix time: not started after it, never run past it
    reported_started: bool = False  # the control plane holds it as started: never run unless this node runs it
    checksum_announced: bool = False  # names no checksum: a hook runs only as it was last announced
    problem: str = ""  # the request could not be read: refused invalid_request with this reason

    def to_json(self) -> dict[str, Any]:
        return {"execution_id": self.execution_id, "action": self.action, "parameters": self.parameters,
                "timeout": self.timeout, "checksum": self.checksum, "triggered_by": self.triggered_by}


def execution_id_of(payload: Any) -> str:
    """The payload's execution id, or MissingExecutionId saying what is wrong with it."""
    if not isinstance(payload, dict):
        raise MissingExecutionId("payload", "must be a JSON object")
    value = _fields(payload, "payload").get("execution_id")
    if not isinstance(value, str) or not value:
        raise MissingExecutionId("payload.execution_id", "missing" if value in (None, "") else "must be a string")
    problem = id_problem(value)
    if problem:
        raise MissingExecutionId("payload.execution_id", problem)
    return value


def action_of(payload: Any) -> str:
    """The action a payload names, for a log or audit line about a request that was refused ('' if none)."""
    action = _fields(payload, "payload").get("action") if isinstance(payload, dict) else None
    return action if isinstance(action, str) else ""


def _not_text(value: str) -> bool:
    """A lone surrogate ("\ud800" in the JSON decodes to one): no file, environment or log line can carry it."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return True
    return False


def id_problem(value: str) -> str:
    if _not_text(value):
        return "is not valid Unicode text (a lone surrogate)"
    if len(value.encode()) > MAX_ID_BYTES:
        return f"longer than {MAX_ID_BYTES} bytes"
    if _CONTROL.search(value):
        return "contains a control character"
    return ""


def parse_request(payload: Any) -> ActionRequest:
    """The request in `payload`; MissingExecutionId, or InvalidRequest naming the field that is wrong."""
    execution_id = execution_id_of(payload)
    f = _fields(payload, "payload")
    action = f.get("action")
    if not isinstance(action, str) or not action:
        raise InvalidRequest("action: missing" if action in (None, "") else "action: must be a string")
    problem = name_problem(action)
    if problem:
        raise InvalidRequest(f"action {action!r}: {problem}")
    timeout_text = f.get("timeout")
    if timeout_text not in (None, "") and not isinstance(timeout_text, str):
        raise InvalidRequest("timeout: must be a Go duration string such as \"30s\"")
    checksum = f.get("checksum") or ""
    if not isinstance(checksum, str) or len(checksum) > 128:
        raise InvalidRequest("checksum: must be a hex SHA-256 string")
    triggered_by = f.get("triggered_by")
    if triggered_by is not None and not isinstance(triggered_by, dict):
        raise InvalidRequest("triggered_by: must be an object")
    return ActionRequest(execution_id, action, parse_parameters(f.get("parameters")),
                         parse_timeout(timeout_text or ""), checksum.lower(), triggered_by)


def name_problem(name: str) -> str:
    """Why `name` cannot name an action (a hook is a file in hooks.dir: no path may leave it), or ''."""
    if _not_text(name):
        return "is not valid Unicode text (a lone surrogate)"
    if "/" in name or "\\" in name or ".." in name:
        return "must not contain '/', '\\' or '..'"
    if _CONTROL.search(name):
        return "contains a control character"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"longer than {MAX_NAME_BYTES} bytes"
    return ""


def parse_timeout(text: str) -> float | None:
    if not text:
        return None
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise InvalidRequest(f"timeout: {exc}") from None
    if seconds <= 0:
        raise InvalidRequest(f"timeout {text!r}: must be positive")
    return seconds


def parse_parameters(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidRequest("parameters: must be an object of names to values")
    if len(raw) > MAX_PARAMETERS:
        raise InvalidRequest(f"parameters: more than {MAX_PARAMETERS}")
    out: dict[str, str] = {}
    total = 0
    env_names: dict[str, str] = {}
    for name, value in raw.items():
        if _not_text(name):
            raise InvalidRequest(f"parameters: name {name!r} is not valid Unicode text (a lone surrogate)")
        if not name or _CONTROL.search(name) or len(name.encode()) > MAX_NAME_BYTES:
            raise InvalidRequest(f"parameters: name {name!r} must be 1 to {MAX_NAME_BYTES} bytes without control "
                                 "characters")
        text = stringify(name, value)
        if _not_text(text):
            raise InvalidRequest(f"parameters.{name}: is not valid Unicode text (a lone surrogate)")
        size = len(text.encode())
        if size > MAX_PARAMETER_BYTES or "\x00" in text:
            raise InvalidRequest(f"parameters.{name}: longer than {MAX_PARAMETER_BYTES} bytes or contains NUL")
        total += size
        env = env_name(name)
        if env in env_names:
            raise InvalidRequest(f"parameters: {env_names[env]!r} and {name!r} both become {env}")
        env_names[env] = name
        out[name] = text
    if total > MAX_PARAMETERS_BYTES:
        raise InvalidRequest(f"parameters: {total} bytes in all, more than {MAX_PARAMETERS_BYTES}")
    return out


def stringify(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    kind = "an object" if isinstance(value, dict) else "an array" if isinstance(value, list) else type(value).__name__
    raise InvalidRequest(f"parameters.{name}: is {kind}; only strings, numbers, booleans and null are accepted")


def env_name(parameter: str) -> str:
    return "PLEXD_PARAM_" + _ENV_UNSAFE.sub("_", parameter).upper()
