"""The platform dialect's event stream: frames, signed envelopes scoped to the node, what each admin change is
told as, the cursor, the signing-key rotation, and the descoped bus."""

from __future__ import annotations

import base64
import json
import queue

import httpx
import nacl.exceptions
import nacl.signing
import pytest
from devplane_helpers import SSEReader, wait_streams
from platform_helpers import assert_problem, register

from plexd.base import gojson
from plexd.controlplane.platform_envelope import parse_envelope


def verify(data: str, public_key: str) -> dict:
    """The envelope, after checking its Ed25519 signature over the canonical bytes."""
    env = parse_envelope(data)
    nacl.signing.VerifyKey(base64.b64decode(public_key)).verify(env.canonical_bytes(), base64.b64decode(env.signature))
    return {"id": env.id, "type": env.type, "scope": env.scope, "key_id": env.key_id, "issued_at": env.issued_at,
            "payload": env.payload()}


@pytest.fixture
def reader():
    opened: list[SSEReader] = []

    def open_reader(node, last_event_id: str | None = None) -> SSEReader:
        r = SSEReader(node, last_event_id)
        opened.append(r)
        return r.start()

    yield open_reader
    for r in opened:
        r.close()


def test_frames_are_signed_envelopes_scoped_to_the_node(platform_dp, reader):
    node = register(platform_dp)
    signing = node.response["signing_public_key"]
    stream = reader(node)
    wait_streams(platform_dp, node.id)
    platform_dp.admin.set_metadata(node.id, {"env": "prod"})
    ev = stream.wait_for("node_state_updated")
    assert ev.id is not None and ev.id.isdigit() and int(ev.id) >= 1
    doc = json.loads(ev.data)
    assert list(doc) == ["id", "type", "scope", "key_id", "issued_at", "payload", "signature"]
    env = verify(ev.data, signing)
    assert env["type"] == "node_state_updated" and env["scope"] == f"node:{node.id}"
    assert env["key_id"] == node.response["signing_key_id"]
    assert env["payload"] == {"revision": int(ev.id)}
    assert gojson.parse_time(env["issued_at"])


def test_the_stream_answer_says_its_api_version(platform_dp):
    node = register(platform_dp)
    with httpx.stream("GET", node.path("events"), headers=node.headers, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-plexsphere-api-version"] == "v1"
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        for line in resp.iter_lines():  # the keepalive comment (every second here)
            assert line == ": keep-alive"
            break


def test_every_desired_state_change_is_a_pull(platform_dp, reader):
    a, b = register(platform_dp), register(platform_dp)
    stream = reader(a)
    wait_streams(platform_dp, a.id)
    admin = platform_dp.admin
    admin.set_metadata(a.id, {"k": "v"})
    admin.set_data(a.id, "app/config", "application/json", {"x": 1})
    admin.set_secret(a.id, "token", "s3cret")
    admin.set_policies(admin.policies())
    admin.set_node_endpoint(b.id, "203.0.113.9:51820")
    admin.set_node_public_key(b.id, base64.b64encode(b"k" * 32).decode())
    admin.forget_node(b.id)
    events = stream.take(7)
    assert {e.event for e in events} == {"node_state_updated"}, [e.event for e in events]
    ids = [int(e.id) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == 7


def test_action_session_and_rotation_keep_their_names(platform_dp, reader):
    node = register(platform_dp)
    key = node.response["signing_public_key"]
    stream = reader(node)
    wait_streams(platform_dp, node.id)
    eid = platform_dp.admin.request_action(node.id, "diagnostics.collect", {"include_network": True}, "2m")
    env = verify(stream.wait_for("action_request").data, key)
    assert env["payload"]["execution_id"] == eid and env["payload"]["action"] == "diagnostics.collect"
    assert env["payload"]["type"] == "builtin" and env["payload"]["timeout_seconds"] == 120
    platform_dp.admin.create_session(node.id, "tcp", 60, host="127.0.0.1", port=5432)
    assert verify(stream.wait_for("session_setup").data, key)["type"] == "session_setup"
    platform_dp.admin.request_key_rotation(node.id)
    assert verify(stream.wait_for("rotate_keys").data, key)["payload"] == {"node_id": node.id}


def test_last_event_id_replays_what_came_after(platform_dp, reader):
    node = register(platform_dp)
    for i in range(3):
        platform_dp.admin.set_metadata(node.id, {"n": str(i)})
    first = reader(node, "0").take(3)
    assert [e.event for e in first] == ["node_state_updated"] * 3
    later = reader(node, first[0].id).take(2)
    assert [e.id for e in later] == [e.id for e in first[1:]]
    # a cursor from the future replays nothing, but what is published next still arrives
    ahead = reader(node, str(10**9))
    wait_streams(platform_dp, node.id, 3)
    platform_dp.admin.set_metadata(node.id, {"n": "4"})
    assert ahead.next().event == "node_state_updated"


def test_no_cursor_tails_from_now(platform_dp, reader):
    node = register(platform_dp)
    platform_dp.admin.set_metadata(node.id, {"before": "connect"})
    stream = reader(node)
    with pytest.raises(queue.Empty):
        stream.next(0.5)


@pytest.mark.parametrize("cursor", ["evt_3", "-1", "1.5", "abc", "٣".encode()])
def test_a_cursor_that_is_not_a_number_is_refused(platform_dp, cursor):
    node = register(platform_dp)
    resp = httpx.get(node.path("events"), headers={**node.headers, "Last-Event-ID": cursor}, timeout=10)
    assert_problem(resp, 400, "invalid_cursor")


def test_a_signing_key_rotation_is_announced_with_the_old_key(platform_dp, reader):
    node = register(platform_dp)
    old_key, old_id = node.response["signing_public_key"], node.response["signing_key_id"]
    stream = reader(node)
    wait_streams(platform_dp, node.id)
    platform_dp.admin.rotate_signing_key("1h")
    env = verify(stream.wait_for("signing_key_rotated").data, old_key)
    assert env["key_id"] == old_id
    payload = env["payload"]
    assert set(payload) == {"key_id", "public_key", "previous_key_id", "transition_expires"}
    assert payload["previous_key_id"] == old_id and payload["key_id"] != old_id
    assert gojson.parse_time(payload["transition_expires"])
    platform_dp.admin.set_metadata(node.id, {"after": "rotation"})
    later = stream.wait_for("node_state_updated")
    env = verify(later.data, payload["public_key"])
    assert env["key_id"] == payload["key_id"]
    with pytest.raises(nacl.exceptions.BadSignatureError):
        verify(later.data, old_key)
    # the new key is what a node registering now is given
    assert register(platform_dp).response["signing_key_id"] == payload["key_id"]


def test_an_unprovisioned_bus_is_501(platform_dp, reader):
    node = register(platform_dp)
    stream = reader(node)
    wait_streams(platform_dp, node.id)
    platform_dp.admin.set_faults(events_not_provisioned=True)
    try:
        assert stream.closed.wait(5), "the open stream should end"
        assert_problem(node.get("events"), 501, "signed_event_bus_not_provisioned")
        assert httpx.get(platform_dp.url + "/v1/health", timeout=10).json()["status"] == "degraded"
    finally:
        platform_dp.admin.clear_faults()
    assert node.get("state").status_code == 200


def test_admin_events_are_signed_for_the_platform_too(platform_dp, reader):
    node = register(platform_dp)
    stream = reader(node)
    wait_streams(platform_dp, node.id)
    platform_dp.admin.publish_event(node.id, "bridge_config_updated", {"anything": 1})
    platform_dp.admin.publish_event(node.id, "peer_psk_assigned", {"peer": "x"})
    platform_dp.admin.publish_event(node.id, "action_request", {}, signature="forge")
    first, second, forged = stream.take(3)
    key = node.response["signing_public_key"]
    assert verify(first.data, key)["type"] == "node_state_updated"
    assert verify(second.data, key)["payload"] == {"peer": "x"}
    with pytest.raises(nacl.exceptions.BadSignatureError):
        verify(forged.data, key)
