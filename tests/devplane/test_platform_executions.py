"""Actions in the platform dialect: the `executions` block and the one callback route's state machine, inline
and uploaded output, and every callback kept for the admin API."""

from __future__ import annotations

import base64
import hashlib
import os
import time

import httpx
import pytest
from platform_helpers import assert_problem, digest, register

from plexd.base import gojson


@pytest.fixture(scope="module")
def node(platform_dp):
    return register(platform_dp)


def queued(platform_dp, node, action="diagnostics.collect", **kw):
    return platform_dp.admin.request_action(node.id, action, kw.pop("parameters", {"include_network": True}), **kw)


def test_a_requested_action_is_queued_in_the_block(platform_dp, node):
    first = queued(platform_dp, node, timeout="5m")
    second = queued(platform_dp, node, "service.restart", parameters={}, action_type="hook")
    block = node.state()["executions"]
    entries = {e["execution_id"]: e for e in block}
    assert [e["execution_id"] for e in block if e["execution_id"] in (first, second)] == [first, second]
    entry = entries[first]
    assert set(entry) == {"execution_id", "action", "type", "parameters", "status", "requested_at", "expires_at"}
    assert entry["action"] == "diagnostics.collect" and entry["type"] == "builtin" and entry["status"] == "pending"
    assert entry["parameters"] == {"include_network": True}
    span = gojson.parse_time(entry["expires_at"]) - gojson.parse_time(entry["requested_at"])
    assert span.total_seconds() == 300
    assert entries[second]["type"] == "hook"


def test_a_hook_the_node_declared_is_a_hook(platform_dp):
    node = register(platform_dp)
    resp = node.put("capabilities", {"binary_version": "1", "binary_checksum": digest(),
                                     "declared_hooks": [{"name": "backup", "checksum": digest()}]})
    assert resp.status_code == 200
    eid = platform_dp.admin.request_action(node.id, "backup")
    assert next(e for e in node.state()["executions"] if e["execution_id"] == eid)["type"] == "hook"


def test_the_legal_walk_ends_the_execution(platform_dp, node):
    eid = queued(platform_dp, node)
    path = f"executions/{eid}"
    for status in ("ack", "started"):
        resp = node.post(path, {"status": status})
        assert resp.status_code == 200 and resp.json() == {"status": status}
        assert next(e for e in node.state()["executions"] if e["execution_id"] == eid)["status"] == status
    out = base64.b64encode(b"all good\n").decode()
    resp = node.post(path, {"status": "succeeded", "exit_code": 0, "output": {"inline": out}})
    assert resp.status_code == 200 and resp.json() == {"status": "succeeded"}
    assert eid not in {e["execution_id"] for e in node.state()["executions"]}
    doc = platform_dp.admin.execution(node.id, eid)
    assert doc["status"] == "succeeded" and doc["exit_code"] == 0
    assert platform_dp.admin.execution_output(node.id, eid) == b"all good\n"
    calls = platform_dp.admin.execution_callbacks(node.id, eid)
    assert [c["body"]["status"] for c in calls] == ["ack", "started", "succeeded"]
    assert all(c["http_status"] == 200 and c["code"] == "" and c["received_at"] for c in calls)
    # terminal: nothing more
    assert_problem(node.post(path, {"status": "failed", "error": "late"}), 409, "execution_already_terminal")
    last = platform_dp.admin.execution_callbacks(node.id, eid)[-1]  # refused ones are kept too
    assert last["body"] == {"status": "failed", "error": "late"}
    assert (last["http_status"], last["code"]) == (409, "execution_already_terminal")


@pytest.mark.parametrize("walk,refused", [
    (["started"], "started"),  # pending -> started skips the ack
    (["ack", "failed"], "failed"),  # ack -> failed is not an edge
    (["ack", "ack"], "ack"),
    (["ack", "started", "ack"], "ack"),
    (["ack", "started", "started"], "started"),  # started again only to declare an output
])
def test_illegal_transitions_are_409(platform_dp, node, walk, refused):
    eid = queued(platform_dp, node)
    for status in walk[:-1]:
        assert node.post(f"executions/{eid}", {"status": status}).status_code == 200
    assert_problem(node.post(f"executions/{eid}", {"status": refused}), 409, "invalid_state_transition")


def test_cancelled_and_failed_are_terminal_too(platform_dp, node):
    for end in ({"status": "failed", "error": "unknown_action"}, {"status": "cancelled"}):
        eid = queued(platform_dp, node)
        for status in ("ack", "started"):
            node.post(f"executions/{eid}", {"status": status})
        assert node.post(f"executions/{eid}", end).json() == {"status": end["status"]}
        assert platform_dp.admin.execution(node.id, eid)["error"] == end.get("error")


@pytest.mark.parametrize("body", [
    {"status": "pending"}, {"status": "timeout"}, {"status": "done"}, {}, {"status": "ack", "extra": 1},
    {"status": "ack", "exit_code": "0"}, {"status": "ack", "error": 5}, {"status": "ack", "declared_output_bytes": -1},
    {"status": "ack", "output": {"inline": "not base64!"}}, {"status": "ack", "output": {"object_key": "k"}},
    {"status": "ack", "output": {"object_key": "k", "sha256": "ABC"}}, {"status": "ack", "output": {"x": 1}},
    ["ack"],
])
def test_malformed_callbacks_are_400(platform_dp, node, body):
    eid = queued(platform_dp, node)
    assert_problem(node.post(f"executions/{eid}", body), 400, "malformed_execution_callback")
    assert platform_dp.admin.execution_callbacks(node.id, eid)[0]["http_status"] == 400


def test_not_json_is_400_and_an_unknown_execution_404(platform_dp, node):
    eid = queued(platform_dp, node)
    resp = httpx.post(node.path(f"executions/{eid}"), content=b"{", headers=node.headers, timeout=10)
    assert_problem(resp, 400, "malformed_execution_callback")
    assert_problem(node.post("executions/0190a8b8-a0c0-7a0a-8a0a-a0a0a0a0a0d1", {"status": "ack"}), 404,
                   "execution_not_found")


def test_another_nodes_execution_is_not_found_and_its_path_is_nsk_node_mismatch(platform_dp, node):
    other = register(platform_dp)
    eid = queued(platform_dp, other)
    assert_problem(node.post(f"executions/{eid}", {"status": "ack"}), 404, "execution_not_found")
    resp = httpx.post(other.path(f"executions/{eid}"), json={"status": "ack"}, headers=node.headers, timeout=10)
    assert_problem(resp, 403, "nsk_node_mismatch")


def test_inline_output_has_a_16_kib_ceiling(platform_dp, node):
    eid = queued(platform_dp, node)
    for status in ("ack", "started"):
        node.post(f"executions/{eid}", {"status": status})
    big = base64.b64encode(b"x" * (16 * 1024 + 1)).decode()
    assert_problem(node.post(f"executions/{eid}", {"status": "succeeded", "output": {"inline": big}}), 413,
                   "inline_output_too_large")
    ok = base64.b64encode(b"x" * 16 * 1024).decode()
    assert node.post(f"executions/{eid}", {"status": "succeeded", "output": {"inline": ok}}).status_code == 200


def test_the_body_is_capped_at_64_kib(platform_dp, node):
    eid = queued(platform_dp, node)
    body = b'{"status":"ack","error":"' + b"x" * (64 * 1024) + b'"}'
    resp = httpx.post(node.path(f"executions/{eid}"), content=body, headers=node.headers, timeout=10)
    assert resp.status_code == 413


def test_a_large_output_is_declared_uploaded_and_named(platform_dp, node):
    eid = queued(platform_dp, node)
    path = f"executions/{eid}"
    node.post(path, {"status": "ack"})
    assert node.post(path, {"status": "started"}).json() == {"status": "started"}
    data = os.urandom(40_000)
    resp = node.post(path, {"status": "started", "declared_output_bytes": len(data)})
    assert resp.status_code == 200
    answer = resp.json()
    assert set(answer) == {"status", "output_upload_url"} and answer["status"] == "started"
    url = answer["output_upload_url"]
    assert url.startswith(platform_dp.url + "/v1/uploads/")
    # more than declared is refused; the upload needs no bearer
    assert httpx.put(url, content=data + b"!", timeout=10).status_code == 413
    assert httpx.put(url, content=data, headers={"Content-Type": "application/octet-stream"},
                     timeout=10).status_code == 200
    assert httpx.put(url, content=data, timeout=10).status_code == 409
    assert httpx.put(platform_dp.url + "/v1/uploads/nope", content=b"x", timeout=10).status_code == 404
    key = url.removeprefix(platform_dp.url + "/")
    wrong = node.post(path, {"status": "succeeded", "exit_code": 0,
                             "output": {"object_key": key, "sha256": "0" * 64}})
    assert_problem(wrong, 400, "malformed_execution_callback")
    done = node.post(path, {"status": "succeeded", "exit_code": 0,
                            "output": {"object_key": key, "sha256": hashlib.sha256(data).hexdigest()}})
    assert done.status_code == 200 and done.json() == {"status": "succeeded"}
    assert platform_dp.admin.execution_output(node.id, eid) == data


def test_a_lapsed_execution_leaves_the_block(platform_dp, node):
    eid = queued(platform_dp, node, timeout="1s")
    assert eid in {e["execution_id"] for e in node.state()["executions"]}
    time.sleep(1.2)
    assert eid not in {e["execution_id"] for e in node.state()["executions"]}
    # a result posted right after the deadline still lands (a grace minute)
    for status in ("ack", "started", "failed"):
        assert node.post(f"executions/{eid}", {"status": status}).status_code == 200


def test_a_resent_request_is_a_new_event_for_the_same_execution(platform_dp, node):
    eid = queued(platform_dp, node)
    event_id = platform_dp.admin.resend_action(node.id, eid)
    assert event_id.isdigit()
    assert [e["execution_id"] for e in node.state()["executions"]].count(eid) == 1
