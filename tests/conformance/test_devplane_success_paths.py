"""The devplane's successful answers against the platform's OpenAPI. Generated requests rarely get past the
platform's checks (a fresh clock, a real digest, a token, an armed rotation), so each node-facing operation is also
called once with a request the platform takes, and its answer (status, media type, headers, body) is validated by
schemathesis against the operation; it must be a 2xx.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from devplane.platform_helpers import digest, heartbeat_body, new_key, register_body
from devplane_checks import checks_for
from openapi_contract import OPENAPI

from plexd.base import gojson

schema = schemathesis.openapi.from_path(OPENAPI)
Request = dict[str, Any]


def node_call(**fields: Any) -> Callable[[Any], Request]:
    return lambda env: {"path_parameters": {"id": env.node.id}, **fields}


def register(env: Any) -> Request:
    return {"body": register_body(env.dp), "anonymous": True}


def secret(env: Any) -> Request:
    env.dp.admin.set_secret(env.node.id, "db-password", "hunter2")
    return {"path_parameters": {"id": env.node.id, "name": "db-password"}}


def rotation(env: Any) -> Request:
    env.dp.admin.request_key_rotation(env.node.id)
    return {"body": {"new_public_key": new_key()}}


def execution(env: Any) -> Request:
    exec_id = env.dp.admin.request_action(env.node.id, "system.info", action_type="builtin")
    return {"path_parameters": {"id": env.node.id, "exec_id": exec_id}, "body": {"status": "ack"}}


def session(env: Any) -> Request:
    created = env.dp.admin.create_session(env.node.id, "tcp", 60, host="127.0.0.1", port=5432)
    return {"path_parameters": {"id": env.node.id, "session_id": created["session"]["session_id"]},
            "body": {"tcp": {"phase": "session_started", "target_host": "127.0.0.1", "target_port": 5432}}}


def sent_now() -> dict[str, str]:
    return {"X-Plexsphere-Sent-At": gojson.now_text()}


PROBES: dict[str, Callable[[Any], Request]] = {
    "PostRegister": register,
    "GetNodeState": node_call(),
    "PostNodeHeartbeat": lambda env: {"path_parameters": {"id": env.node.id}, "body": heartbeat_body()},
    "PostNodeExecutionCallback": execution,
    "PutNodeCapabilities": node_call(body={"binary_version": "1.2.3", "binary_checksum": digest(),
                                           "declared_hooks": [{"name": "backup", "checksum": digest()}]}),
    "PostNodeIntegrityViolations": node_call(body={"violations": [
        {"kind": "binary_checksum", "detected_by": "startup_scan", "artifact_id": "/usr/local/bin/plexd",
         "observed_checksum": digest()}]}),
    "PutNodeStateReport": lambda env: {"path_parameters": {"id": env.node.id, "key": "app-health"},
                                       "body": {"value": '{"status":"healthy"}'}},
    "DeleteNodeStateReport": lambda env: {"path_parameters": {"id": env.node.id, "key": "app-health"}},
    "FetchNodeSecret": secret,
    # Times are taken when the probe runs, not at collection (minutes earlier in a long run: clock skew).
    "PutNodeEndpoint": lambda env: node_call(body={"endpoint": "203.0.113.7:51820", "nat_type": "full_cone",
                                                   "reported_at": gojson.now_text()})(env),
    "PostNodeSessionCallback": session,
    "PostNodeMetrics": lambda env: node_call(headers=sent_now(), body=[
        {"group": "node_resources", "name": "cpu_usage_percent", "value": 1.5, "timestamp": gojson.now_text()}])(env),
    "PostNodeLogs": lambda env: node_call(headers=sent_now(), body=[
        {"severity": "info", "message": "started", "timestamp": gojson.now_text()}])(env),
    "PostNodeAudit": lambda env: node_call(headers=sent_now(), body=[
        {"source": "auditd", "action": "open", "outcome": "failure", "timestamp": gojson.now_text()}])(env),
    "PostKeysRotate": rotation,
    "GetHealth": lambda env: {"anonymous": True},
    "GetVersion": lambda env: {"anonymous": True},
}


def test_every_node_facing_operation_has_a_probe() -> None:
    operations = {op.ok().definition.raw["operationId"] for op in schema.get_all_operations()}
    assert operations - {"GetNodeEvents"} == set(PROBES)  # the stream: tests/devplane/test_platform_events.py


@pytest.mark.parametrize("operation_id", list(PROBES))  # in order: the report is put before it is deleted
def test_a_request_the_platform_takes_is_answered_as_the_openapi_says(operation_id: str, platform_devplane) -> None:
    request = PROBES[operation_id](platform_devplane)
    bearer = {} if request.pop("anonymous", False) else platform_devplane.node.headers
    case = schema.find_operation_by_id(operation_id).Case(headers={**bearer, **request.pop("headers", {})},
                                                          **request)
    response = case.call_and_validate(base_url=platform_devplane.url, checks=checks_for(operation_id))
    assert 200 <= response.status_code < 300, (operation_id, response.status_code, response.text[:300])
