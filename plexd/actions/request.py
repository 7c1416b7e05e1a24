"""What a hook is given, and the request it runs for (`plexd.state.action_request`, re-exported here: the request
is a wire type the control plane's state can carry too, so it lives in the model layer).

The hook's environment is exactly ``PATH`` and ``HOME`` (the daemon's), ``PLEXD_NODE_ID``,
``PLEXD_EXECUTION_ID``, ``PLEXD_ACTION_NAME``, ``PLEXD_HOOK_PATH`` and ``PLEXD_HOOKS_DIR`` (a hook, not a built-in)
and one ``PLEXD_PARAM_<NAME>`` per parameter, ``<NAME>`` being the parameter's name with every character outside
``[A-Za-z0-9_]`` replaced by ``_``, upper-cased.
"""

from __future__ import annotations

import os
from typing import Any

from plexd.base.childenv import child_environment
from plexd.state.action_request import (
    ACTIONS_DISABLED,
    BUILTIN,
    CANCELLED,
    DUPLICATE,
    ERROR,
    FAILED,
    HOOK,
    INTEGRITY_VIOLATION,
    INVALID_REQUEST,
    MAX_CONCURRENT,
    MAX_ID_BYTES,
    MAX_NAME_BYTES,
    MAX_PARAMETER_BYTES,
    MAX_PARAMETERS,
    MAX_PARAMETERS_BYTES,
    SHUTTING_DOWN,
    SUCCESS,
    TIMEOUT,
    UNKNOWN_ACTION,
    UNSUPPORTED_TYPE,
    ActionRequest,
    InvalidRequest,
    MissingExecutionId,
    action_of,
    env_name,
    execution_id_of,
    id_problem,
    name_problem,
    parse_parameters,
    parse_request,
    parse_timeout,
    stringify,
)

__all__ = [
    "ACTIONS_DISABLED", "BUILTIN", "CANCELLED", "DUPLICATE", "ERROR", "FAILED", "HOOK", "INTEGRITY_VIOLATION",
    "INVALID_REQUEST", "MAX_CONCURRENT", "MAX_ID_BYTES", "MAX_NAME_BYTES", "MAX_PARAMETERS", "MAX_PARAMETERS_BYTES",
    "MAX_PARAMETER_BYTES", "SHUTTING_DOWN", "SUCCESS", "TIMEOUT", "UNKNOWN_ACTION", "UNSUPPORTED_TYPE",
    "ActionRequest", "InvalidRequest", "MissingExecutionId", "action_of", "check_declared", "env_name",
    "execution_id_of", "hook_environment", "id_problem", "name_problem", "parse_parameters", "parse_request",
    "parse_timeout", "stringify",
]


def check_declared(parameters: dict[str, str], declared: Any) -> None:
    """Refuse a request missing a required parameter, or naming one the action does not declare (`declared` is
    the sidecar's or built-in's list; None: the action declares nothing and takes anything)."""
    if declared is None:
        return
    names = {p["name"] for p in declared}
    unknown = sorted(set(parameters) - names)
    if unknown:
        raise InvalidRequest(f"parameters: {', '.join(map(repr, unknown))} not declared (declared: "
                             f"{', '.join(sorted(names)) or 'none'})")
    missing = [p["name"] for p in declared if p.get("required") and p["name"] not in parameters]
    if missing:
        raise InvalidRequest(f"parameters: required {', '.join(map(repr, missing))} missing")


def hook_environment(node_id: str, request: ActionRequest, hook_path: str = "") -> dict[str, str]:
    """The hook's whole environment: the allow-list of `plexd.base.childenv`, the execution's names, where the hook
    lives and its parameters; nothing else of the daemon's (its bootstrap token least of all). A hook runs from the
    sealed copy that was hashed, so its `$0` is `/proc/self/fd/N`: `PLEXD_HOOK_PATH` (its file in hooks.dir) and
    `PLEXD_HOOKS_DIR` are how it finds the files beside it (`. "$PLEXD_HOOKS_DIR/lib.sh"`)."""
    extra = {"PLEXD_NODE_ID": node_id, "PLEXD_EXECUTION_ID": request.execution_id,
             "PLEXD_ACTION_NAME": request.action}
    if hook_path:
        extra |= {"PLEXD_HOOK_PATH": hook_path, "PLEXD_HOOKS_DIR": os.path.dirname(hook_path)}
    for name, value in request.parameters.items():
        extra[env_name(name)] = value
    return child_environment(extra)
