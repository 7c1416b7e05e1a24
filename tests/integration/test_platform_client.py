"""The client in the platform dialect against the real devplane serving it (`--dialect platform`, real HTTP): the
calls whose translation is not already shown by the platform lab (tests/e2e/test_platform_lab.py): telemetry in
the platform's shapes, reports per key, status blocks published only when they change, capabilities never
gzipped, and the calls the platform does not have making no request at all."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from datetime import UTC, datetime

import pytest

from plexd.base.gojson import EncodedJSON, now_text
from plexd.base.wgkeys import b64, generate_private_key, public_key_of
from plexd.controlplane.client import ControlPlaneClient, RegisterRequest
from plexd.controlplane.client_errors import AuthError, TransientError
from plexd.controlplane.platform_calls import split_bodies
from plexd.controlplane.platform_telemetry import metric_samples
from plexd.devplane.harness import Devplane
from plexd.state.model import RegisterResponse

KEY_B64 = base64.b64encode(bytes(range(32))).decode()


@pytest.fixture
def platform_dp(tmp_path):
    with Devplane(tmp_path / "dp", dialect="platform") as plane:
        yield plane


def registered(dp: Devplane) -> tuple[ControlPlaneClient, str]:
    client = ControlPlaneClient(dp.url, dialect="auto")  # the token's form chooses
    token = dp.admin.create_token()
    request = RegisterRequest(token=token, public_key=b64(public_key_of(generate_private_key())), hostname="px-c",
                              project_id=dp.admin.project_id(), resource_handle="px-c")
    answer = asyncio.run(client.register(request))
    assert client.dialect == "platform"
    from plexd.controlplane.platform_envelope import bearer

    client.set_token(bearer(answer.node_id, answer.node_secret_key))
    return client, answer.node_id


def test_telemetry_goes_out_in_the_platform_shapes(platform_dp):
    client, node = registered(platform_dp)
    stamp = now_text()
    points = EncodedJSON(json.dumps([
        {"timestamp": stamp, "group": "system", "data": {"cpu_percent": 3.5, "memory_bytes": 1024}},
        {"timestamp": stamp, "group": "tunnel", "peer_id": "p1",
         "data": {"peer_id": "p1", "rx_bytes": 10, "tx_bytes": 20, "handshake_succeeded": True,
                  "handshake_stale": False, "last_handshake_time": stamp}},
        {"timestamp": stamp, "group": "latency", "peer_id": "p1", "data": {"peer_id": "p1", "rtt_nano": 1500}}]))
    logs = [{"timestamp": stamp, "source": "plexd", "unit": "plexd", "severity": "warning", "message": "m",
             "hostname": "px-c"}]
    audit = [{"timestamp": stamp, "source": "plexd-actions", "event_type": "local_action", "action": "finished",
              "result": "success", "hostname": "px-c", "raw": "{}"}]

    async def send() -> None:
        await client.send_metrics(node, points)
        await client.send_logs(node, logs)
        await client.send_audit(node, audit)
        await client.aclose()

    asyncio.run(send())
    samples = platform_dp.admin.metrics(node)
    by_name = {(s["group"], s["name"]): s for s in samples}
    assert by_name[("node_resources", "cpu_percent")]["value"] == 3.5
    assert by_name[("tunnel_health", "handshake_succeeded")] == {
        "group": "tunnel_health", "name": "handshake_succeeded", "value": 1, "labels": {"peer_id": "p1"},
        "timestamp": stamp}
    assert by_name[("peer_latency", "rtt_nano")]["value"] == 1500
    assert platform_dp.admin.logs(node) == [{"severity": "warning", "unit": "plexd", "hostname": "px-c",
                                              "message": "m", "timestamp": stamp}]
    assert platform_dp.admin.audit(node) == [{"source": "auditd", "action": "finished", "outcome": "success",
                                               "timestamp": stamp}]


def test_reports_status_blocks_capabilities_and_the_calls_the_platform_lacks(platform_dp):
    client, node = registered(platform_dp)
    hooks = [{"name": f"hook-{i:03d}", "checksum": "ab" * 32} for i in range(40)]  # ~3 KiB: gzip in spec
    beat = {"node_id": node, "timestamp": now_text(), "status": "healthy", "uptime": "1s",
            "binary_checksum": "cd" * 32, "mesh": {"interface": "plexd0", "peer_count": 2, "listen_port": 51820}}

    async def calls() -> None:
        await client.sync_reports(node, [{"key": "app.health", "payload": {"ok": True}},
                                         {"key": "app.version", "payload": "1.2"}], [])
        await client.sync_reports(node, [], ["app.version", "never.sent"])  # a missing key is removed already
        await client.heartbeat(node, beat)
        await client.heartbeat(node, beat)  # the same status: not published again
        await client.heartbeat(node, {**beat, "mesh": {**beat["mesh"], "peer_count": 3}})
        await client.put_capabilities(node, {"binary": {"version": "1", "checksum": "ef" * 32}, "hooks": hooks})
        await client.report_drift(node, {"timestamp": now_text(), "corrections": []})  # no such call: nothing sent
        await client.tunnel_ready(node, "s1", "127.0.0.1:1", datetime.now(UTC))
        await client.aclose()

    asyncio.run(calls())
    entries = {e["key"]: e["value"] for e in platform_dp.admin.report_entries(node)}
    assert entries["app.health"] == '{"ok":true}' and "app.version" not in entries
    assert json.loads(entries["status.mesh"])["peer_count"] == 3
    puts = [r for r in platform_dp.admin.reports(node) if "status.mesh" in json.dumps(r)]
    assert len(puts) == 2  # published on the first beat and on the change, not on the repeat
    [manifest] = platform_dp.admin.capabilities(node)
    assert len(manifest["declared_hooks"]) == 40 and set(manifest) == {"binary_version", "binary_checksum",
                                                                     "declared_hooks"}
    assert len(platform_dp.admin.heartbeats(node)) == 3
    assert platform_dp.admin.drift(node) == [] and platform_dp.admin.tunnels(node) == []


async def test_a_5xx_confirms_no_guess_and_a_refusal_after_it_still_switches():
    """The registrar retries a 503; the retry must still be free to take the refusal's word for the dialect."""
    from agentcore_recorder import Recorder, Reply

    spec_refusal = Reply(401, b'{"error":"unknown token"}')
    async with Recorder() as cp:
        cp.route("POST", "/v1/register", Reply(503, b"busy", {"Content-Type": "text/plain"}), spec_refusal)
        client = ControlPlaneClient(cp.url, dialect="auto")
        request = RegisterRequest(token="psb_dev_aebagbafaydqqbrhibbsa3kqaq_node_" + "a" * 26, public_key=KEY_B64,
                                  hostname="h", project_id=str(uuid.uuid4()), resource_handle="h")
        with pytest.raises(TransientError):
            await client.register(request)
        with pytest.raises(AuthError):  # refused in the spec contract: asked again in it, refused as such
            await client.register(request)
        await client.aclose()
    bodies = [r.json for r in cp.requests]
    assert ["bootstrap_token" in b for b in bodies] == [True, True, False]  # platform, platform again, spec
    assert bodies[0]["nonce"] == bodies[1]["nonce"] and bodies[2]["token"] == request.token
    assert client.dialect == "spec"


def test_a_registered_platform_node_is_confirmed_by_its_own_state_and_a_status_report_failure_spares_the_beat(
        platform_dp):
    client, node = registered(platform_dp)
    answer = RegisterResponse(node_id=node, mesh_ip="10.100.0.9", signing_public_key=KEY_B64,
                              node_secret_key="x", signing_key_id="k", domain_mesh_cidr="10.100.0.0/16")
    request = RegisterRequest(token="", public_key=KEY_B64, hostname="px-c", confirms=answer)
    platform_dp.admin.set_faults(reports_not_provisioned=True)

    async def calls():
        confirmed = await client.register(request, token=client.token)
        beat = await client.heartbeat(node, {"node_id": node, "timestamp": now_text(), "binary_checksum": "cd" * 32,
                                             "mesh": {"interface": "plexd0", "peer_count": 1, "listen_port": 1}})
        await client.aclose()
        return confirmed, beat

    confirmed, beat = asyncio.run(calls())
    assert confirmed is answer and beat.reconcile is False
    assert len(platform_dp.admin.heartbeats(node)) == 1


def test_a_metrics_batch_past_the_platforms_body_limit_goes_out_split_and_whole(platform_dp):
    """A 1 MiB batch of tunnel points (what the queue sends at most) is ~2 MiB of platform samples: one body would
    be refused (413) and the batch dropped. It goes as several bodies under 1 MiB, every sample in one of them."""
    client, node = registered(platform_dp)
    stamp = now_text()
    peers = [str(uuid.uuid4()) for _ in range(1000)]
    points = [{"timestamp": stamp, "group": "tunnel", "peer_id": p,
               "data": {"peer_id": p, "rx_bytes": 10 + i, "tx_bytes": 20, "handshake_succeeded": True,
                        "handshake_stale": False, "last_handshake_time": stamp}}
              for _ in range(3) for i, p in enumerate(peers)]
    batch = EncodedJSON(json.dumps(points, separators=(",", ":")))
    assert len(batch.text) < 1 << 20 < len(json.dumps(metric_samples(batch), separators=(",", ":")))
    before = platform_dp.admin.requests().get(node, {}).get("POST /v1/nodes/{node_id}/metrics", 0)

    async def send() -> None:
        await client.send_metrics(node, batch)
        await client.aclose()

    asyncio.run(send())
    samples = platform_dp.admin.metrics(node)
    assert len(samples) == len(metric_samples(batch)) == 4 * 3000  # 4 numbers per tunnel point
    assert sorted(s["value"] for s in samples if s["name"] == "rx_bytes") == sorted(10 + i for _ in range(3)
                                                                                   for i in range(1000))
    assert platform_dp.admin.requests()[node]["POST /v1/nodes/{node_id}/metrics"] - before >= 2


def test_bodies_are_split_at_the_limit_and_an_oversize_item_goes_alone():
    items = [b"a" * 4, b"b" * 4, b"c" * 20, b"d" * 4]
    assert split_bodies(items, b"[", b",", b"]", limit=12) == [b"[aaaa,bbbb]", b"[" + b"c" * 20 + b"]", b"[dddd]"]
    assert split_bodies([], b"[", b",", b"]") == []
    assert b"".join(split_bodies([b"x\n"] * 10, b"", b"", b"", limit=4)) == b"x\n" * 10
