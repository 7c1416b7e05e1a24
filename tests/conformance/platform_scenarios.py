"""The platform dialect's scenarios: every call the client makes in the platform's shape, driven the way the daemon
drives it (the same arguments as in the spec dialect: the client translates), and the spec-only calls, which must
send nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from scenarios import BINARY_CHECKSUM, NEW_NODE_KEY, NODE_KEY, Scenario, first_event, sha256_hex, signed_by
from spec_scenarios import AUDIT, K8S, LOG, METRICS, SSH, TCP_END, TCP_START, outcome, session
from wire_documents import load

from plexd.actions.dispatcher import result_body
from plexd.actions.request import ActionRequest
from plexd.controlplane import platform_envelope
from plexd.controlplane.client import ControlPlaneClient, HeartbeatRequest, MeshInfo, NatInfo, RegisterRequest
from plexd.trust.integrity import Hook, capabilities_document

REGISTER_ANSWER = load("platform")["register"].answer["json"]
PROJECT_ID = "0190a8b8-a0c0-7a0a-8a0a-a0a0a0a0a0a0"
BOOTSTRAP_TOKEN = "psb_prod_agikrofayb5avcqkucqkbifaua_node_abcdefghijklmnopqrstuvwxyz"
NOW = datetime(2026, 7, 19, 19, 32, 35, tzinfo=UTC)


def hooks(count: int) -> list[Hook]:
    return [Hook(name=f"hook-{i:02d}", path=f"/etc/plexd/hooks.d/hook-{i:02d}", checksum=sha256_hex(str(i)))
            for i in range(count)]


def registration() -> RegisterRequest:
    return RegisterRequest(token=BOOTSTRAP_TOKEN, public_key=NODE_KEY, hostname="edge-router-01",
                           metadata={"rack": "r1"}, node_secret_kdf="hkdf-sha256", project_id=PROJECT_ID,
                           resource_handle="edge-router-01")


async def register(cp: ControlPlaneClient, node: str) -> Any:
    return await cp.register(registration(), token=BOOTSTRAP_TOKEN)


async def event(cp: ControlPlaneClient, node: str, cursor: str = "") -> dict[str, Any]:
    env = platform_envelope.parse_envelope((await first_event(cp, node, cursor)).data)
    return {"event_id": env.event_id, "event_type": env.event_type, "scope": env.scope, "key_id": env.key_id,
            "issued_at": env.issued_at, "payload": env.payload(), "signed_by_registered_key": signed_by(
                REGISTER_ANSWER["signing_public_key"], env.canonical_bytes(), env.signature)}


async def heartbeat(cp: ControlPlaneClient, node: str, nat: NatInfo | None, **extra: Any) -> Any:
    return await cp.heartbeat(node, HeartbeatRequest(
        node_id=node, timestamp=NOW, status="healthy", uptime="1h0m0s", binary_checksum=BINARY_CHECKSUM,
        mesh=MeshInfo("plexd0", 3, 51820), nat=nat, extra=extra))


async def capabilities(cp: ControlPlaneClient, node: str, count: int) -> Any:
    await cp.put_capabilities(node, capabilities_document("0.2.0", BINARY_CHECKSUM, hooks(count)))


async def report(cp: ControlPlaneClient, node: str, payload: Any) -> Any:
    await cp.sync_reports(node, [{"key": "app-health", "content_type": "application/json", "payload": payload,
                                  "version": 1, "updated_at": "2026-07-19T19:32:35Z"}], [])


async def integrity(cp: ControlPlaneClient, node: str, kind: str, expected: str) -> Any:
    await cp.report_integrity_violation(node, kind=kind, path="/usr/local/bin/plexd", expected_checksum=expected,
                                        actual_checksum=sha256_hex("tampered"), detail="checksum mismatch",
                                        timestamp=NOW)


async def execution(cp: ControlPlaneClient, node: str) -> Any:
    exec_id = "0190a8b8-a0c0-7a0a-8a0a-a0a0a0a0a0d1"
    await cp.ack_execution(node, exec_id, "accepted")
    await cp.report_result(node, exec_id, result_body(ActionRequest(exec_id, "system.info"), outcome()))


async def spec_only_calls(cp: ControlPlaneClient, node: str) -> Any:
    await cp.report_drift(node, {"timestamp": "2026-07-19T19:32:35Z", "corrections": []})
    await cp.deregister(node)
    await cp.tunnel_ready(node, "ses_1", "10.100.1.5:41234", NOW)
    await cp.tunnel_closed(node, "ses_1", "revoked", "5s", NOW)


SCENARIOS = [
    Scenario("register", "first registration", register, result=True, registered=False),
    Scenario("events", "first connect", event, result=True),
    Scenario("events", "with a cursor", lambda cp, node: event(cp, node, "17"), result=True),
    Scenario("heartbeat", "before NAT discovery", lambda cp, node: heartbeat(cp, node, None), result=True),
    Scenario("heartbeat", "after NAT discovery, a bridge",
             lambda cp, node: heartbeat(cp, node, NatInfo("203.0.113.7:51820", "none"),
                                        bridge={"enabled": True, "relay_enabled": False}), result=True),
    Scenario("state", "pull", lambda cp, node: cp.fetch_state(node), result=True),
    Scenario("execution_callback", "ack, started, then the result", execution),
    Scenario("execution_callback", "refused", lambda cp, node: cp.ack_execution(
        node, "0190a8b8-a0c0-7a0a-8a0a-a0a0a0a0a0d2", "rejected", "unknown_action")),
    Scenario("capabilities", "two hooks", lambda cp, node: capabilities(cp, node, 2)),
    Scenario("capabilities", "no hooks", lambda cp, node: capabilities(cp, node, 0)),
    Scenario("capabilities", "sixteen hooks (over 1 KiB)", lambda cp, node: capabilities(cp, node, 16)),
    Scenario("integrity_violations", "the binary changed",
             lambda cp, node: integrity(cp, node, "binary", BINARY_CHECKSUM)),
    Scenario("integrity_violations", "a hook with no expected digest",
             lambda cp, node: integrity(cp, node, "hook", "")),
    Scenario("report_put", "a workload's report", lambda cp, node: report(cp, node, {"status": "healthy"})),
    Scenario("report_put", "a report of 2 KiB", lambda cp, node: report(cp, node, "x" * 2048)),
    Scenario("report_delete", "a deleted report", lambda cp, node: cp.sync_reports(node, [], ["app-health"])),
    Scenario("endpoint", "report", lambda cp, node: cp.report_endpoint(node, "203.0.113.7:51820", "symmetric"),
             result=True),
    Scenario("secrets", "a secret", lambda cp, node: cp.fetch_secret(node, "db-password"), result=True),
    Scenario("keys_rotate", "rotation", lambda cp, node: cp.rotate_keys(node, NEW_NODE_KEY), result=True),
    Scenario("session_activity", "ssh command", lambda cp, node: session(cp, node, SSH)),
    Scenario("session_activity", "k8s request", lambda cp, node: session(cp, node, K8S)),
    Scenario("session_activity", "tcp started", lambda cp, node: session(cp, node, TCP_START)),
    Scenario("session_activity", "tcp ended", lambda cp, node: session(cp, node, TCP_END)),
    Scenario("health", "reachability", lambda cp, node: cp.ping()),
    Scenario("metrics", "samples", lambda cp, node: cp.send_metrics(node, METRICS)),
    Scenario("logs", "a line", lambda cp, node: cp.send_logs(node, [LOG])),
    Scenario("audit", "a record", lambda cp, node: cp.send_audit(node, [AUDIT])),
    Scenario(None, "drift, deregister and tunnel reports", spec_only_calls),
]
