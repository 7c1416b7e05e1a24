"""Wire tests: every control-plane call's method, path, headers and body, checked against docs/protocol.md §1.

A recording HTTP server (agentcore_recorder) on loopback captures what the real client sends over a real socket.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gzip
import importlib.abc
import json
import sys
from email.utils import format_datetime

import pytest
from agentcore_recorder import Recorded, Recorder, Reply, self_signed_ca, serving_tls

from plexd import __version__
from plexd.base.gojson import go_marshal
from plexd.controlplane import http_client
from plexd.controlplane.client import (
    ControlPlaneClient,
    HeartbeatRequest,
    MeshInfo,
    NatInfo,
    RegisterRequest,
    parse_retry_after,
)
from plexd.controlplane.client_errors import (
    AuthError,
    BadResponseError,
    ControlPlaneError,
    PermanentError,
    RetryAfterError,
    TransientError,
)

NODE = "n_abc123"
SECRET = "s" * 32
T = dt.datetime(2025, 1, 15, 10, 30, 0, 123456, tzinfo=dt.UTC)
PEER = {"id": "n_peer456", "public_key": "A" * 43 + "=", "mesh_ip": "10.100.1.2", "endpoint": "203.0.113.10:51820",
        "allowed_ips": ["10.100.1.2/32"], "psk": ""}


@pytest.fixture
async def rec():
    async with Recorder() as server:
        yield server


@pytest.fixture
async def cp(rec):
    async with ControlPlaneClient(rec.url + "/", token=SECRET) as client:
        yield client


def assert_common(req: Recorded, *, token: str = SECRET, body: bool) -> None:
    h = req.headers
    assert h["user-agent"] == f"plexd/{__version__}"
    assert h["accept"] == "application/json"
    assert h["accept-encoding"] == "gzip"
    assert h["authorization"] == f"Bearer {token}"
    if body:
        assert h["content-type"] == "application/json"
    else:
        assert "content-type" not in h
        assert req.body == b""


async def test_register_shape_and_response(rec, cp):
    rec.route("POST", "/v1/register", Reply(201, json.dumps({
        "node_id": NODE, "mesh_ip": "10.100.1.1", "signing_public_key": "B" * 43 + "=", "node_secret_key": SECRET,
        "peers": [PEER]})))
    req = RegisterRequest(token="plx_enroll_1", public_key="C" * 43 + "=", hostname="web-01",
                          metadata={"k": "v"}, capabilities={"binary": {"version": "0.1.0", "checksum": "ab"},
                                                             "builtin_actions": None, "hooks": None})
    resp = await cp.register(req, token="plx_enroll_1")
    (r,) = rec.requests
    assert (r.method, r.path) == ("POST", "/v1/register")
    assert_common(r, token="plx_enroll_1", body=True)
    assert r.body == (b'{"token":"plx_enroll_1","public_key":"' + b"C" * 43 + b'=","hostname":"web-01",'
                      b'"metadata":{"k":"v"},"capabilities":{"binary":{"version":"0.1.0","checksum":"ab"},'
                      b'"builtin_actions":null,"hooks":null}}')
    assert resp.node_id == NODE and resp.mesh_ip == "10.100.1.1" and resp.node_secret_key == SECRET
    assert resp.peers[0].id == "n_peer456"


async def test_register_omits_empty_metadata_and_capabilities(rec, cp):
    rec.route("POST", "/v1/register", Reply(200, json.dumps({
        "node_id": NODE, "mesh_ip": "10.100.1.1", "signing_public_key": "B" * 43 + "=", "node_secret_key": SECRET})))
    await cp.register(RegisterRequest(token="", public_key="k", hostname="h"))
    assert rec.requests[0].body == b'{"token":"","public_key":"k","hostname":"h"}'
    assert rec.requests[0].headers["authorization"] == f"Bearer {SECRET}"  # the client's current token


async def test_heartbeat_shape_and_response(rec, cp):
    rec.route("POST", f"/v1/nodes/{NODE}/heartbeat", Reply(200, '{"reconcile":true,"rotate_keys":false}'))
    hb = HeartbeatRequest(node_id=NODE, timestamp=T, status="healthy", uptime="72h15m", binary_checksum="ab12",
                          mesh=MeshInfo("plexd0", 12, 51820), nat=NatInfo("203.0.113.10:51820", "full_cone"))
    resp = await cp.heartbeat(NODE, hb)
    (r,) = rec.requests
    assert (r.method, r.path) == ("POST", f"/v1/nodes/{NODE}/heartbeat")
    assert_common(r, body=True)
    assert r.body == (b'{"node_id":"n_abc123","timestamp":"2025-01-15T10:30:00.123456Z","status":"healthy",'
                      b'"uptime":"72h15m","binary_checksum":"ab12",'
                      b'"mesh":{"interface":"plexd0","peer_count":12,"listen_port":51820},'
                      b'"nat":{"public_endpoint":"203.0.113.10:51820","type":"full_cone"}}')
    assert resp.reconcile is True and resp.rotate_keys is False


async def test_deregister_has_no_body(rec, cp):
    await cp.deregister(NODE)
    (r,) = rec.requests
    assert (r.method, r.path) == ("POST", f"/v1/nodes/{NODE}/deregister")
    assert_common(r, body=False)
    assert "content-encoding" not in r.headers


async def test_rotate_keys(rec, cp):
    rec.route("POST", "/v1/keys/rotate", Reply(200, json.dumps({"updated_peers": [PEER]})))
    peers = await cp.rotate_keys(NODE, "D" * 43 + "=")
    r = rec.requests[0]
    assert (r.method, r.path) == ("POST", "/v1/keys/rotate")
    assert_common(r, body=True)
    assert r.body == b'{"node_id":"n_abc123","new_public_key":"' + b"D" * 43 + b'="}'
    assert [p.id for p in peers] == ["n_peer456"]


async def test_capabilities(rec, cp):
    caps = {"binary": {"version": "1.4.2", "checksum": "ab"}, "builtin_actions": None,
            "hooks": [{"name": "backup", "description": "d", "source": "local", "checksum": "cd",
                       "parameters": None, "timeout": "30s", "sandbox": "none"}]}
    await cp.put_capabilities(NODE, caps)
    r = rec.requests[0]
    assert (r.method, r.path) == ("PUT", f"/v1/nodes/{NODE}/capabilities")
    assert_common(r, body=True)
    assert r.body == go_marshal(caps).encode()


async def test_endpoint_report(rec, cp):
    rec.route("PUT", f"/v1/nodes/{NODE}/endpoint",
              Reply(200, '{"peer_endpoints":[{"peer_id":"n_peer456","endpoint":"198.51.100.5:51820"}]}'))
    eps = await cp.report_endpoint(NODE, "203.0.113.10:51820", "full_cone")
    r = rec.requests[0]
    assert (r.method, r.path) == ("PUT", f"/v1/nodes/{NODE}/endpoint")
    assert_common(r, body=True)
    assert r.body == b'{"public_endpoint":"203.0.113.10:51820","nat_type":"full_cone"}'
    assert eps[0].peer_id == "n_peer456" and eps[0].endpoint == "198.51.100.5:51820"


async def test_state(rec, cp):
    state = {"peers": [PEER], "policies": [{"id": "p1", "rules": [{"src": "*", "dst": "*", "port": 0,
                                                                   "protocol": "", "action": "allow"}]}],
             "signing_keys": {"current": "B" * 43 + "="}, "metadata": {"a": "b"}, "data": [], "secret_refs": []}
    rec.route("GET", f"/v1/nodes/{NODE}/state", Reply(200, json.dumps(state)))
    got = await cp.fetch_state(NODE)
    r = rec.requests[0]
    assert (r.method, r.path) == ("GET", f"/v1/nodes/{NODE}/state")
    assert_common(r, body=False)
    assert got.peers[0].mesh_ip == "10.100.1.2" and got.policies[0].id == "p1" and got.metadata == {"a": "b"}


async def test_drift(rec, cp):
    report = {"timestamp": "2025-01-15T10:31:00.123456789+01:00",
              "corrections": [{"type": "peer_added", "detail": "peer n_peer789"}]}
    await cp.report_drift(NODE, report)
    r = rec.requests[0]
    assert (r.method, r.path) == ("POST", f"/v1/nodes/{NODE}/drift")
    assert_common(r, body=True)
    assert r.body == go_marshal(report).encode()


async def test_secret_with_escaped_key(rec, cp):
    rec.route("GET", f"/v1/nodes/{NODE}/secrets/tls%2Fcert",
              Reply(200, '{"key":"tls/cert","ciphertext":"Y3Q=","nonce":"bm9uY2U=","version":2}'))
    s = await cp.fetch_secret(NODE, "tls/cert")
    r = rec.requests[0]
    assert (r.method, r.path) == ("GET", f"/v1/nodes/{NODE}/secrets/tls%2Fcert")
    assert_common(r, body=False)
    assert (s.key, s.ciphertext, s.nonce, s.version) == ("tls/cert", "Y3Q=", "bm9uY2U=", 2)


async def test_report_sync_nulls_when_empty(rec, cp):
    await cp.sync_reports(NODE, [], [])
    await cp.sync_reports(NODE, [{"key": "app", "content_type": "application/json", "payload": {"s": 1},
                                  "version": 12, "updated_at": "2025-01-15T10:30:00Z"}], ["old"])
    a, b = rec.requests
    assert (a.method, a.path) == ("POST", f"/v1/nodes/{NODE}/report")
    assert_common(a, body=True)
    assert a.body == b'{"entries":null,"deleted":null}'
    assert b.body == (b'{"entries":[{"key":"app","content_type":"application/json","payload":{"s":1},"version":12,'
                      b'"updated_at":"2025-01-15T10:30:00Z"}],"deleted":["old"]}')


async def test_execution_ack_and_result(rec, cp):
    await cp.ack_execution(NODE, "exec/1", "accepted")
    result = {"execution_id": "exec/1", "status": "success", "exit_code": 0, "stdout": "<ok>", "stderr": "",
              "duration": "1.234567ms", "finished_at": "2025-01-15T10:30:02.1234Z"}
    await cp.report_result(NODE, "exec/1", result)
    ack, res = rec.requests
    assert (ack.method, ack.path) == ("POST", f"/v1/nodes/{NODE}/executions/exec%2F1/ack")
    assert ack.body == b'{"execution_id":"exec/1","status":"accepted","reason":""}'
    assert (res.method, res.path) == ("POST", f"/v1/nodes/{NODE}/executions/exec%2F1/result")
    assert b'"stdout":"\\u003cok\\u003e"' in res.body  # Go escapes < > & in marshalled strings
    for r in (ack, res):
        assert_common(r, body=True)


@pytest.mark.parametrize("method,name", [("send_metrics", "metrics"), ("send_logs", "logs"),
                                         ("send_audit", "audit")])
async def test_observability_batches_are_arrays(rec, cp, method, name):
    batch = [{"timestamp": "2025-01-15T10:30:00Z", "group": "system", "data": {"cpu_usage_percent": 1.5}}]
    await getattr(cp, method)(NODE, batch)
    r = rec.requests[0]
    assert (r.method, r.path) == ("POST", f"/v1/nodes/{NODE}/{name}")
    assert_common(r, body=True)
    assert r.json == batch and r.body.startswith(b"[")


async def test_a_request_looks_for_no_module(rec, cp):
    """httpcore looks sniffio up on every request. Were it missing, each request would search sys.path for it four
    times (~0.2 ms of CPU, on every heartbeat and telemetry batch of an idle node): a dependency, checked here for
    the two requests an idle node sends most (plain HTTP; TLS, state pulls and the event stream are not covered)."""
    rec.route("POST", f"/v1/nodes/{NODE}/heartbeat", Reply(200, '{"reconcile":false,"rotate_keys":false}'))
    batch = [{"timestamp": "2025-01-15T10:30:00Z", "group": "system", "data": {"cpu_usage_percent": 1.5}}]
    heartbeat = HeartbeatRequest(node_id=NODE, timestamp=T, status="healthy", uptime="1s", binary_checksum="ab")
    await cp.send_metrics(NODE, batch)  # the first request of each kind may import what it uses, once
    await cp.heartbeat(NODE, heartbeat)
    looked: list[str] = []

    class Spy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            looked.append(name)

    spy = Spy()
    sys.meta_path.insert(0, spy)
    try:
        for _ in range(3):
            await cp.send_metrics(NODE, batch)
            await cp.heartbeat(NODE, heartbeat)
    finally:
        sys.meta_path.remove(spy)
    assert looked == []
    assert len(rec.requests) == 8


async def test_artifact_download_streams_raw_bytes(rec, cp):
    payload = bytes(range(256)) * 100
    rec.route("GET", "/v1/artifacts/plexd/1.2.3/linux/amd64",
              Reply(200, payload, {"Content-Type": "application/octet-stream"}))
    async with cp.open_artifact("1.2.3", "linux", "amd64") as resp:
        data = b"".join([c async for c in resp.aiter_bytes()])
    assert data == payload
    r = rec.requests[0]
    assert (r.method, r.path) == ("GET", "/v1/artifacts/plexd/1.2.3/linux/amd64")
    assert_common(r, body=False)


async def test_tunnel_reports(rec, cp):
    await cp.tunnel_ready(NODE, "sess 1", "10.100.1.5:41234", T)
    await cp.tunnel_closed(NODE, "sess 1", "revoked", "5m3.2s", T)
    ready, closed = rec.requests
    assert (ready.method, ready.path) == ("POST", f"/v1/nodes/{NODE}/tunnels/sess%201/ready")
    assert ready.body == b'{"listen_addr":"10.100.1.5:41234","timestamp":"2025-01-15T10:30:00.123456Z"}'
    assert (closed.method, closed.path) == ("POST", f"/v1/nodes/{NODE}/tunnels/sess%201/closed")
    assert closed.body == b'{"reason":"revoked","duration":"5m3.2s","timestamp":"2025-01-15T10:30:00.123456Z"}'


async def test_integrity_violation(rec, cp):
    await cp.report_integrity_violation(NODE, kind="hook", path="/etc/plexd/hooks.d/x", expected_checksum="aa",
                                        actual_checksum="bb", detail="hook checksum mismatch", timestamp=T)
    r = rec.requests[0]
    assert (r.method, r.path) == ("POST", f"/v1/nodes/{NODE}/integrity/violations")
    assert_common(r, body=True)
    assert r.body == (b'{"type":"hook","path":"/etc/plexd/hooks.d/x","expected_checksum":"aa","actual_checksum":"bb",'
                      b'"detail":"hook checksum mismatch","timestamp":"2025-01-15T10:30:00.123456Z"}')


async def test_ping(rec, cp):
    await cp.ping()
    assert (rec.requests[0].method, rec.requests[0].path) == ("GET", "/v1/ping")


async def test_node_id_is_path_escaped(rec, cp):
    await cp.deregister("a/b c?d")
    assert rec.requests[0].path == "/v1/nodes/a%2Fb%20c%3Fd/deregister"


# -- transport rules -----------------------------------------------------------------------------------------------


async def test_body_over_1024_bytes_is_gzipped_and_small_one_is_not(rec, cp):
    small = [{"message": "x" * 900}]
    large = [{"message": "x" * 1100}]
    await cp.send_logs(NODE, small)
    await cp.send_logs(NODE, large)
    s, big = rec.requests
    assert "content-encoding" not in s.headers and json.loads(s.body) == small
    assert big.headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(big.body)) == large


async def test_a_lone_surrogate_goes_as_the_replacement_character_and_the_rest_of_the_body_as_it_was(rec, cp):
    """Outside input (a journal field) can hold a lone surrogate, which UTF-8 cannot carry: Go writes U+FFFD."""
    for size in (10, 2000):  # sent as it is, and gzipped
        await cp.send_logs(NODE, [{"message": "bad \udc80 byte é" + "x" * size}])
    for r, size in zip(rec.requests, (10, 2000), strict=True):
        body = gzip.decompress(r.body) if r.headers.get("content-encoding") == "gzip" else r.body
        assert json.loads(body) == [{"message": "bad \ufffd byte é" + "x" * size}]


async def test_gzip_response_is_decoded(rec, cp):
    body = gzip.compress(b'{"reconcile":false,"rotate_keys":true}')
    rec.route("POST", f"/v1/nodes/{NODE}/heartbeat",
              Reply(200, body, {"Content-Type": "application/json", "Content-Encoding": "gzip"}))
    resp = await cp.heartbeat(NODE, {"node_id": NODE})
    assert resp.rotate_keys is True


async def test_body_labelled_gzip_that_is_not_is_a_typed_error(rec, cp):
    rec.route("GET", f"/v1/nodes/{NODE}/state",
              Reply(200, b"not gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip"}))
    with pytest.raises(BadResponseError, match="cannot be decoded"):
        await cp.fetch_state(NODE)


async def test_bearer_switching(rec, cp):
    cp.set_token("bootstrap-token")
    await cp.ping()
    cp.set_token("node-secret")
    await cp.ping()
    cp.set_token("")
    await cp.ping()
    a, b, c = rec.requests
    assert a.headers["authorization"] == "Bearer bootstrap-token"
    assert b.headers["authorization"] == "Bearer node-secret"
    assert "authorization" not in c.headers


@pytest.mark.parametrize("status,exc_type", [(401, AuthError), (403, PermanentError), (404, PermanentError),
                                             (500, TransientError), (503, TransientError), (400, TransientError),
                                             (409, TransientError), (429, RetryAfterError)])
async def test_error_classification(rec, cp, status, exc_type):
    rec.route("GET", f"/v1/nodes/{NODE}/state", Reply(status, '{"error":"nope: details"}'))
    with pytest.raises(exc_type) as info:
        await cp.fetch_state(NODE)
    err = info.value
    assert err.status == status and err.message == "nope: details"
    assert isinstance(err, ControlPlaneError)
    assert f"HTTP {status}" in str(err) and "nope: details" in str(err)


async def test_retry_after_seconds_and_http_date(rec, cp):
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=120)
    rec.route("GET", "/v1/ping", Reply(429, "{}", {"Retry-After": "7"}),
              Reply(429, "{}", {"Retry-After": format_datetime(later, usegmt=True)}), Reply(429, "{}"))
    with pytest.raises(RetryAfterError) as a:
        await cp.ping()
    with pytest.raises(RetryAfterError) as b:
        await cp.ping()
    with pytest.raises(RetryAfterError) as c:
        await cp.ping()
    assert a.value.retry_after == 7
    assert 115 <= b.value.retry_after <= 121
    assert c.value.retry_after is None


def test_parse_retry_after_edge_cases():
    now = dt.datetime(2025, 1, 15, 10, 30, tzinfo=dt.UTC)
    assert parse_retry_after("0", now) == 0
    assert parse_retry_after("Wed, 15 Jan 2025 10:31:00 GMT", now) == 60
    assert parse_retry_after("Wed, 15 Jan 2025 10:00:00 GMT", now) == 0  # in the past: go now
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after("-5", now) is None


async def test_empty_or_bad_2xx_body_on_typed_call(rec, cp):
    rec.route("GET", f"/v1/nodes/{NODE}/state", Reply(200, ""), Reply(200, "not json"),
              Reply(200, '{"peers":"nope"}'))
    with pytest.raises(BadResponseError, match="empty response body"):
        await cp.fetch_state(NODE)
    with pytest.raises(BadResponseError, match="not JSON"):
        await cp.fetch_state(NODE)
    with pytest.raises(BadResponseError, match="peers"):
        await cp.fetch_state(NODE)


async def test_untyped_call_ignores_body(rec, cp):
    # a 2xx with a body that is not JSON (or none at all) is a success for a call that expects no answer
    rec.route("POST", f"/v1/nodes/{NODE}/drift", Reply(202, ""), Reply(200, "<html>ok</html>"))
    for _ in range(2):
        assert await cp.report_drift(NODE, {"timestamp": "x", "corrections": []}) is None
    assert [r.path for r in rec.requests] == [f"/v1/nodes/{NODE}/drift"] * 2


async def test_unreachable_names_address_and_what_was_tried():
    async with ControlPlaneClient("http://127.0.0.1:9") as client:
        with pytest.raises(TransientError) as info:
            await client.register(RegisterRequest(token="t", public_key="k", hostname="h"))
    text = str(info.value)
    assert "http://127.0.0.1:9" in text and "POST /v1/register" in text and "cannot connect" in text
    assert info.value.status == 0


async def test_request_deadline_covers_a_slow_body(rec):
    rec.route("GET", f"/v1/nodes/{NODE}/state", Reply(200, chunks=[b"{", b'"peers":[]', b"}"], delay=0.4))
    async with ControlPlaneClient(rec.url, request_timeout=0.5) as client:
        with pytest.raises(TransientError, match=r"within 0.5s"):
            await client.fetch_state(NODE)


# -- the SSE stream --------------------------------------------------------------------------------------------------


async def test_event_stream_headers_and_no_total_deadline(rec):
    frames = [b": ping\n\n"] + [f"id: e{i}\ndata: {{}}\n\n".encode() for i in range(5)]
    rec.route("GET", f"/v1/nodes/{NODE}/events",
              Reply(200, headers={"Content-Type": "text/event-stream"}, chunks=frames, delay=0.15))
    # The normal-call deadline is 0.3 s; the stream runs ~0.9 s and must not be cut.
    async with (ControlPlaneClient(rec.url, token=SECRET, request_timeout=0.3) as client,
                client.open_event_stream(NODE, "evt_41") as resp):
        data = b"".join([c async for c in resp.aiter_bytes()])
    assert data == b"".join(frames)
    r = rec.requests[0]
    assert (r.method, r.path) == ("GET", f"/v1/nodes/{NODE}/events")
    assert r.headers["accept"] == "text/event-stream"
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["last-event-id"] == "evt_41"
    assert r.headers["authorization"] == f"Bearer {SECRET}"
    assert r.headers["user-agent"] == f"plexd/{__version__}"


async def test_event_stream_without_last_event_id(rec, cp):
    rec.route("GET", f"/v1/nodes/{NODE}/events", Reply(200, b": hi\n\n", {"Content-Type": "text/event-stream"}))
    async with cp.open_event_stream(NODE) as resp:
        await resp.aread()
    assert "last-event-id" not in rec.requests[0].headers


async def test_event_stream_idle_read_timeout(rec):
    rec.route("GET", f"/v1/nodes/{NODE}/events",
              Reply(200, headers={"Content-Type": "text/event-stream"}, chunks=[b": a\n\n", b": b\n\n"], delay=0.6))
    async with ControlPlaneClient(rec.url) as client:
        with pytest.raises(http_client.TransportError, match="read timed out"):
            async with client.open_event_stream(NODE, read_timeout=0.2) as resp:
                async for _ in resp.aiter_bytes():
                    pass


@pytest.mark.parametrize("status,exc_type", [(401, AuthError), (404, PermanentError), (502, TransientError),
                                             (429, RetryAfterError), (503, RetryAfterError)])
async def test_event_stream_error_status_raises_before_body(rec, cp, status, exc_type):
    rec.route("GET", f"/v1/nodes/{NODE}/events", Reply(status, '{"error":"go away"}', {"Retry-After": "3"}))
    with pytest.raises(exc_type) as info:
        async with cp.open_event_stream(NODE):
            pytest.fail("the body must not be handed out on an error status")
    assert info.value.status == status and info.value.message == "go away"
    if status in (429, 503):  # a 503 with Retry-After: a server shedding load says when to come back
        assert info.value.retry_after == 3


# -- TLS -------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return self_signed_ca(tmp_path_factory.mktemp("tls"))


@pytest.fixture
async def tls_rec(tls_files):
    async with Recorder(ssl_context=serving_tls(*tls_files)) as server:
        yield server


async def test_tls_verified_by_default(tls_rec):
    async with ControlPlaneClient(tls_rec.url) as client:
        with pytest.raises(TransientError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await client.ping()
    assert tls_rec.requests == []


async def test_tls_with_ca_file(tls_rec, tls_files):
    async with ControlPlaneClient(tls_rec.url, ca_file=str(tls_files[0])) as client:
        await client.ping()
    assert tls_rec.requests[0].path == "/v1/ping"


async def test_tls_insecure_skip_verify(tls_rec):
    async with ControlPlaneClient(tls_rec.url, insecure_skip_verify=True) as client:
        await client.ping()
    assert len(tls_rec.requests) == 1


def test_tls_bad_ca_file_is_a_config_error(tmp_path):
    from plexd.base.errors import ConfigError

    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"api.tls.ca_file.*ca.pem"):
        ControlPlaneClient("https://127.0.0.1:1", ca_file=str(bad))


async def test_timeouts_configured():
    async with ControlPlaneClient("http://127.0.0.1:1") as client:
        assert client._http.connect_timeout == 10.0
        assert client._http.read_timeout == client._http.write_timeout == client.request_timeout == 30.0


async def test_concurrent_calls_share_the_client(rec, cp):
    await asyncio.gather(*(cp.ping() for _ in range(10)))
    assert len(rec.requests) == 10


async def test_decompressed_response_is_capped_at_10_mib(rec, cp):
    bomb = gzip.compress(b" " * (10 * 1024 * 1024 + 1))  # ~10 KiB on the wire
    rec.route("GET", f"/v1/nodes/{NODE}/state",
              Reply(200, bomb, {"Content-Type": "application/json", "Content-Encoding": "gzip"}))
    with pytest.raises(BadResponseError, match="larger than 10485760 bytes"):
        await cp.fetch_state(NODE)


async def test_error_body_is_cut_to_its_start(rec, cp):
    rec.route("GET", "/v1/ping", Reply(500, "x" * 100_000, {"Content-Type": "text/plain"}))
    with pytest.raises(TransientError) as info:
        await cp.ping()
    assert len(info.value.message) <= 300 and info.value.message.startswith("xxx")


@pytest.mark.parametrize("method,path,body,call,field", [
    ("POST", f"/v1/nodes/{NODE}/heartbeat", '{"reconcile":"yes"}', lambda c: c.heartbeat(NODE, {}), "reconcile"),
    ("POST", f"/v1/nodes/{NODE}/heartbeat", "[]", lambda c: c.heartbeat(NODE, {}), "JSON object"),
    ("PUT", f"/v1/nodes/{NODE}/endpoint", '{"peer_endpoints":[5]}', lambda c: c.report_endpoint(NODE, "a", "b"),
     "peer_endpoints[0]"),
    ("GET", f"/v1/nodes/{NODE}/secrets/k", '{"key":"k","version":"2"}', lambda c: c.fetch_secret(NODE, "k"),
     "version"),
    ("POST", "/v1/keys/rotate", '{"updated_peers":{}}', lambda c: c.rotate_keys(NODE, "k"), "updated_peers"),
])
async def test_malformed_typed_responses_name_the_field(rec, cp, method, path, body, call, field):
    rec.route(method, path, Reply(200, body))
    with pytest.raises(BadResponseError) as info:
        await call(cp)
    assert field in str(info.value)


async def test_response_keys_match_case_insensitively_like_go(rec, cp):
    rec.route("POST", f"/v1/nodes/{NODE}/heartbeat", Reply(200, '{"Reconcile":true}'))
    assert (await cp.heartbeat(NODE, {})).reconcile is True
