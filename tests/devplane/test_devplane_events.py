"""The SSE stream (§2) and event signatures (§3), checked independently of plexd's own envelope code.

Signatures are verified with PyNaCl against canonical bytes built by hand in the test, so a bug shared by the
signer and the agent's verifier (both use plexd.controlplane.envelope) would still be caught here.
"""

from __future__ import annotations

import base64
import json
import time

import httpx
import nacl.exceptions
import nacl.signing
import pytest
from devplane_helpers import addressed, new_public_key, register, wait_streams
from waiting import scaled

from plexd.devplane.harness import AdminError, Devplane


def verify(signing_key_b64: str, canonical: bytes, signature_b64: str) -> bool:
    key = nacl.signing.VerifyKey(base64.b64decode(signing_key_b64))
    try:
        key.verify(canonical, base64.b64decode(signature_b64))
        return True
    except nacl.exceptions.BadSignatureError:
        return False


def raw_payload(data: str) -> str:
    """The payload text exactly as sent (between `"payload":` and `,"signature"`)."""
    start = data.index('"payload":') + len('"payload":')
    end = data.rindex(',"signature":')
    return data[start:end]


def canonical_of(data: str) -> bytes:
    """Canonical bytes of an envelope the devplane emitted: its own fields are already in Go form."""
    env = json.loads(data)
    return ('{"event_type":"' + env["event_type"] + '","event_id":"' + env["event_id"] + '","issued_at":"'
            + env["issued_at"] + '","nonce":"' + env["nonce"] + '","payload":' + raw_payload(data) + "}").encode()


@pytest.mark.parametrize("payload_raw,issued_at,expected_payload,expected_time", [
    ('{"b":2, "a":"<x> & y", "c":[1, 2]}', "2025-01-15T10:30:00.500+00:00",
     '{"b":2,"a":"\\u003cx\\u003e \\u0026 y","c":[1,2]}', "2025-01-15T10:30:00.5Z"),
    ('{"z": {"y": 1, "x": "\u2028"}, "a": null}', "2025-01-15T10:30:00.123456789+02:00",
     '{"z":{"y":1,"x":"\\u2028"},"a":null}', "2025-01-15T10:30:00.123456789+02:00"),
    ('[3, 1, 2]', "2025-01-15T10:30:00.000Z", "[3,1,2]", "2025-01-15T10:30:00Z"),
])
def test_signature_covers_go_canonical_bytes(dp, readers, payload_raw, issued_at, expected_payload, expected_time):
    node = register(dp)
    eid = dp.admin.publish_event(node.id, "custom_test", payload_raw=payload_raw, issued_at=issued_at,
                                 nonce="nonce-<1>")
    event = readers(node).wait_for("custom_test")
    assert event.id == eid
    env = json.loads(event.data)
    assert env["issued_at"] == issued_at and env["nonce"] == "nonce-<1>"
    assert env["payload"] == json.loads(payload_raw)
    expected = ('{"event_type":"custom_test","event_id":"' + eid + '","issued_at":"' + expected_time
                + '","nonce":"nonce-\\u003c1\\u003e","payload":' + expected_payload + "}").encode()
    assert verify(node.response["signing_public_key"], expected, env["signature"])
    # And not over the sorted-keys re-serialisation a naive verifier would build.
    naive = json.dumps({"event_type": "custom_test", "event_id": eid, "issued_at": expected_time,
                        "nonce": "nonce-<1>", "payload": json.loads(payload_raw)}, sort_keys=True).encode()
    assert not verify(node.response["signing_public_key"], naive, env["signature"])


def test_sse_framing_and_live_peer_events(dp, readers):
    a = register(dp)
    reader = readers(a)
    wait_streams(dp, a.id)
    c = register(dp)
    added = reader.wait_for("peer_added")
    env = json.loads(added.data)
    assert added.id == env["event_id"] and added.event == env["event_type"] == "peer_added"
    assert "\n" not in added.data and len(added.data) < 64 * 1024
    assert addressed(env["payload"], a.id) == {"id": c.id, "public_key": c.public_key, "mesh_ip": c.mesh_ip,
                                               "endpoint": "",
                              "allowed_ips": [f"{c.mesh_ip}/32"], "psk": ""}
    assert verify(a.response["signing_public_key"], canonical_of(added.data), env["signature"])
    issued = env["issued_at"]
    assert issued.endswith("Z") and not issued.endswith("0Z")

    assert c.put("endpoint", {"public_endpoint": "192.0.2.7:51820", "nat_type": "none"}).status_code == 200
    moved = json.loads(reader.wait_for("peer_endpoint_changed").data)["payload"]
    assert moved["id"] == c.id and moved["endpoint"] == "192.0.2.7:51820" and moved["public_key"] == c.public_key
    dp.admin.set_node_endpoint(c.id, "192.0.2.8:51820")
    assert json.loads(reader.wait_for("peer_endpoint_changed").data)["payload"]["endpoint"] == "192.0.2.8:51820"

    new_key = new_public_key()
    resp = httpx.post(f"{dp.url}/v1/keys/rotate", headers=c.headers, json={"new_public_key": new_key}, timeout=10)
    assert resp.status_code == 200
    rotated = json.loads(reader.wait_for("peer_key_rotated").data)["payload"]
    assert rotated["id"] == c.id and rotated["public_key"] == new_key

    assert c.post("deregister").status_code == 200
    removed = json.loads(reader.wait_for("peer_removed").data)
    assert addressed(removed["payload"], a.id) == {"peer_id": c.id}
    ids = [int(e.split("_")[1]) for e in (added.id,)]
    assert ids[0] > 0


def test_admin_events_reach_the_node(dp, readers):
    a = register(dp)
    reader = readers(a)
    eid = dp.admin.request_action(a.id, "backup", {"target": "/srv"}, timeout="30s", checksum="ab" * 32)
    req = addressed(json.loads(reader.wait_for("action_request").data)["payload"], a.id)
    assert req == {"execution_id": eid, "action": "backup", "parameters": {"target": "/srv"}, "timeout": "30s",
                   "checksum": "ab" * 32,
                   "triggered_by": {"type": "control_plane", "session_id": "", "user_id": "", "email": ""}}
    dp.admin.set_metadata(a.id, {"env": "prod"})
    state = addressed(json.loads(reader.wait_for("node_state_updated").data)["payload"], a.id)
    assert state == {"metadata": {"env": "prod"}, "data": []}
    dp.admin.set_secret(a.id, "k1", "v1")
    secrets = addressed(json.loads(reader.wait_for("node_secrets_updated").data)["payload"], a.id)
    assert secrets == {"secret_refs": [{"key": "k1", "version": 1}]}
    dp.admin.publish_event(a.id, "peer_added", {"id": "n_fake"}, signature="forge")
    forged = reader.wait_for("peer_added")
    assert not verify(a.response["signing_public_key"], canonical_of(forged.data), json.loads(forged.data)["signature"])
    dp.admin.publish_event(a.id, "anything", raw_data='{"not an envelope"')
    raw = reader.next()
    assert raw.data == '{"not an envelope"' and raw.event == "anything"


def test_policy_change_updates_visibility_and_notifies(fresh_dp, readers):
    dp = fresh_dp
    a, b, c = register(dp), register(dp), register(dp)
    ra, rc = readers(a, last_event_id="evt_999999"), readers(c, last_event_id="evt_999999")
    dp.admin.set_policies([{"id": "pol_ab", "rules": [{"src": a.id, "dst": b.id, "port": 443, "protocol": "tcp",
                                                       "action": "allow"}]}])
    assert addressed(json.loads(ra.wait_for("policy_updated").data)["payload"], a.id) == {"policy_ids": ["pol_ab"]}
    assert addressed(json.loads(ra.wait_for("peer_removed").data)["payload"], a.id) == {"peer_id": c.id}
    rc.wait_for("policy_updated")
    removed_from_c = {json.loads(rc.wait_for("peer_removed").data)["payload"]["peer_id"] for _ in range(2)}
    assert removed_from_c == {a.id, b.id}
    assert [p["id"] for p in a.get("state").json()["peers"]] == [b.id]
    assert [p["id"] for p in b.get("state").json()["peers"]] == [a.id]  # allows are bidirectional
    assert c.get("state").json()["peers"] == []
    # A CIDR rule covering the mesh brings c back.
    dp.admin.set_policies([{"id": "pol_mesh", "rules": [{"src": "10.100.0.0/16", "dst": "*"}]}])
    back = json.loads(rc.wait_for("peer_added").data)["payload"]
    assert back["id"] in (a.id, b.id)
    assert len(c.get("state").json()["peers"]) == 2
    # No policies at all: nobody sees anybody.
    dp.admin.set_policies([])
    assert a.get("state").json()["peers"] == []


def test_replay_from_last_event_id_survives_restart(fresh_dp, readers):
    dp = fresh_dp
    a = register(dp)
    ids = [dp.admin.publish_event(a.id, "custom", {"n": i}) for i in range(3)]
    dp.restart()
    ids += [dp.admin.publish_event(a.id, "custom", {"n": i}) for i in range(3, 5)]
    reader = readers(a, last_event_id=ids[0])
    got = reader.take(4)
    assert [e.id for e in got] == ids[1:]
    assert [json.loads(e.data)["payload"]["n"] for e in got] == [1, 2, 3, 4]
    assert reader.drain() == []
    # Events emitted before the restart still verify with the (persisted) signing key.
    assert all(verify(a.response["signing_public_key"], canonical_of(e.data), json.loads(e.data)["signature"])
               for e in got)


def test_state_survives_a_crash(fresh_dp):
    dp = fresh_dp
    token_used = dp.admin.create_token()
    a = register(dp)
    httpx.post(f"{dp.url}/v1/register", json={"token": token_used, "public_key": new_public_key(),
                                               "hostname": "crash-b"}, timeout=10).raise_for_status()
    dp.admin.set_secret(a.id, "k", "v")
    dp.admin.set_policies([{"id": "pol_x", "rules": [{"src": "*", "dst": "*"}]}])
    eid = dp.admin.publish_event(a.id, "custom", {"before": "crash"})
    dp.kill()  # SIGKILL: no clean shutdown
    dp.start()
    state = a.get("state").json()
    assert state["signing_keys"]["current"] == a.response["signing_public_key"]
    assert state["secret_refs"] == [{"key": "k", "version": 1}]
    assert [p["id"] for p in state["policies"]] == ["pol_x"]
    assert len(state["peers"]) == 1
    resp = httpx.post(f"{dp.url}/v1/register", json={"token": token_used, "public_key": new_public_key(),
                                                      "hostname": "crash-c"}, timeout=10)
    assert resp.status_code == 401
    with httpx.stream("GET", a.path("events"), headers=a.headers, timeout=10) as s:
        ids = []
        for line in s.iter_lines():  # no Last-Event-ID: the recent events are replayed, ours last
            if line.startswith("id: "):
                ids.append(line[4:])
            if line == f"id: {eid}":
                break
        assert ids[-1] == eid and "evt_2" in ids  # evt_2: peer_added of crash-b, before the crash
    # The next event id continues after the crash, never repeats.
    assert int(dp.admin.publish_event(a.id, "custom").split("_")[1]) > int(eid.split("_")[1])


def test_keepalive_comments(tmp_path, readers):
    with Devplane(tmp_path, keepalive="200ms") as dp:
        a = register(dp)
        reader = readers(a, last_event_id="evt_999999")
        deadline = time.monotonic() + scaled(10)
        while len(reader.comments) < 3 and time.monotonic() < deadline:  # 3 keepalives: ~0.6 s when not loaded
            time.sleep(0.05)
        assert len(reader.comments) >= 3
        assert all(c[1].startswith(":") for c in reader.comments)


def test_faults(fresh_dp, readers):
    dp = fresh_dp
    a = register(dp)
    dp.admin.set_faults(events_status=503)
    resp = httpx.get(a.path("events"), headers=a.headers, timeout=10)
    assert resp.status_code == 503 and "injected" in resp.json()["error"]
    assert a.get("state").status_code == 200  # only the stream is hit
    dp.admin.set_faults(events_status=429, retry_after="7")
    resp = httpx.get(a.path("events"), headers=a.headers, timeout=10)
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "7"
    dp.admin.set_faults(all_status=500)
    assert a.get("state").status_code == 500
    assert a.post("heartbeat", {}).status_code == 500
    assert dp.admin.nodes()  # the admin API is never faulted
    dp.admin.set_faults(close_after_events=1)
    dp.admin.publish_event(a.id, "one")
    dp.admin.publish_event(a.id, "two")
    reader = readers(a)
    assert reader.next().event == "one"
    assert reader.closed.wait(5)
    dp.admin.set_faults(silent=True)
    silent = readers(a, last_event_id="evt_0")
    assert silent.status == 200
    dp.admin.publish_event(a.id, "three")
    time.sleep(1.5)  # keepalive is 1s on this devplane
    assert silent.events.empty() and silent.comments == [] and not silent.closed.is_set()
    dp.admin.clear_faults()
    assert a.get("state").status_code == 200
    with pytest.raises(AdminError, match="unknown fault") as refused:
        dp.admin.set_faults(explode=True)
    assert refused.value.status == 400


def test_signing_key_rotation(fresh_dp, readers):
    dp = fresh_dp
    a = register(dp)
    old = a.response["signing_public_key"]
    reader = readers(a, last_event_id="evt_999999")
    wait_streams(dp, a.id)
    keys = dp.admin.rotate_signing_key("1h")
    assert keys["previous"] == old and keys["current"] != old
    event = reader.wait_for("signing_key_rotated")
    env = json.loads(event.data)
    assert addressed(env["payload"], a.id) == keys and set(keys) == {"current", "previous", "transition_expires"}
    # Announced with the key the agent already trusts.
    assert verify(old, canonical_of(event.data), env["signature"])
    state = a.get("state").json()
    assert state["signing_keys"] == keys
    dp.admin.publish_event(a.id, "after_rotation", {"x": 1})
    after = reader.wait_for("after_rotation")
    assert verify(keys["current"], canonical_of(after.data), json.loads(after.data)["signature"])
    assert not verify(old, canonical_of(after.data), json.loads(after.data)["signature"])
    # With a zero transition the previous key drops out of the state.
    dp.admin.rotate_signing_key("0s")
    assert "previous" not in a.get("state").json()["signing_keys"]


def test_stream_edge_cases(dp, readers):
    a = register(dp)
    reader = readers(a, last_event_id="garbage-id")
    assert reader.status == 200
    wait_streams(dp, a.id)
    dp.admin.publish_event(a.id, "hello")
    assert reader.wait_for("hello")
    dp.admin.forget_node(a.id)
    assert reader.closed.wait(5)  # a removed node's stream ends


def test_large_events_stay_under_64k_per_line_and_still_verify(dp):
    a = register(dp)
    big = {f"key{i}": "v" * 200 + "<&>" for i in range(1000)}  # ~210 KB of payload
    eid = dp.admin.publish_event(a.id, "big_event", payload_raw=json.dumps(big))
    with httpx.stream("GET", a.path("events"), headers=dict(a.headers, **{"Last-Event-ID": f"evt_{int(eid[4:]) - 1}"}),
                      timeout=10) as s:
        data_lines = []
        for line in s.iter_lines():
            assert len(line.encode()) < 64 * 1024
            if line.startswith("data: "):
                data_lines.append(line[6:])
            elif line == "" and data_lines:
                break
    assert len(data_lines) >= 4
    data = "\n".join(data_lines)  # how an SSE client joins them
    env = json.loads(data)
    assert env["payload"] == big and env["event_id"] == eid
    expected_payload = json.dumps(big, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e") \
        .replace("&", "\\u0026")
    canonical = ('{"event_type":"big_event","event_id":"' + eid + '","issued_at":"' + env["issued_at"]
                 + '","nonce":"' + env["nonce"] + '","payload":' + expected_payload + "}").encode()
    assert verify(a.response["signing_public_key"], canonical, env["signature"])
    # Test data sent raw is never split: the agent's tests need a real oversize line.
    eid = dp.admin.publish_event(a.id, "raw", raw_data="x" * (1 << 20))
    with httpx.stream("GET", a.path("events"), headers=dict(a.headers, **{"Last-Event-ID": f"evt_{int(eid[4:]) - 1}"}),
                      timeout=10) as s:
        lines = s.iter_lines()
        assert next(lines) == f"id: {eid}" and next(lines) == "event: raw"
        assert len(next(lines)) == len("data: ") + (1 << 20)


def test_restart_with_open_streams_is_quick(fresh_dp, readers):
    dp = fresh_dp
    a = register(dp)
    reader = readers(a)
    wait_streams(dp, a.id)
    start = time.monotonic()
    dp.restart()
    assert time.monotonic() - start < 5
    assert reader.closed.wait(5)
