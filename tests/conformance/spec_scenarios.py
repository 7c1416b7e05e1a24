"""The spec dialect's scenarios (docs/protocol.md §1.2): every endpoint the client has a call for, each driven the
way the daemon drives it, with the daemon's own body builders where the client takes a ready body."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from scenarios import BINARY_CHECKSUM, NEW_NODE_KEY, NODE_KEY, Scenario, first_event, sha256_hex, signed_by
from wire_documents import load

from plexd.actions.builtins import builtin_capabilities
from plexd.actions.dispatcher import result_body
from plexd.actions.request import ActionRequest
from plexd.actions.runner import Outcome
from plexd.base.gojson import format_time
from plexd.controlplane import envelope
from plexd.controlplane.client import ControlPlaneClient, HeartbeatRequest, MeshInfo, NatInfo, RegisterRequest
from plexd.converge.change import Correction
from plexd.trust.integrity import Hook, capabilities_document

REGISTER_ANSWER = load("spec")["register"].answer["json"]
BOOTSTRAP_TOKEN = "plx_enroll_a8f3c7d2e1"
NOW = datetime(2026, 11, 24, 10, 30, tzinfo=UTC)
HOOK = Hook(name="backup", path="/etc/plexd/hooks.d/backup", checksum=sha256_hex("backup"), description="nightly",
            parameters=({"name": "target", "type": "string", "required": True, "description": "where"},),
            timeout="30s", sandbox="none")


def registration(**fields: Any) -> RegisterRequest:
    return RegisterRequest(token=BOOTSTRAP_TOKEN, public_key=NODE_KEY, hostname="web-01", **fields)


async def register_fully(cp: ControlPlaneClient, node: str) -> Any:
    caps = capabilities_document("0.2.0", BINARY_CHECKSUM, [HOOK], builtin_capabilities())
    return await cp.register(registration(metadata={"rack": "r1"}, capabilities=caps,
                                          node_secret_kdf="hkdf-sha256"), token=BOOTSTRAP_TOKEN)


async def register_bare(cp: ControlPlaneClient, node: str) -> Any:
    return await cp.register(registration(), token=BOOTSTRAP_TOKEN)


async def reregister(cp: ControlPlaneClient, node: str) -> Any:
    request = RegisterRequest(token="", public_key=NODE_KEY, hostname="web-01", node_secret_kdf="hkdf-sha256")
    return await cp.register(request, token=REGISTER_ANSWER["node_secret_key"])


async def event(cp: ControlPlaneClient, node: str, cursor: str = "") -> dict[str, Any]:
    env = envelope.parse_envelope((await first_event(cp, node, cursor)).data)
    return {"event_type": env.event_type, "event_id": env.event_id, "nonce": env.nonce, "issued_at": env.issued_at,
            "payload": env.payload(), "signed_by_registered_key": signed_by(
                REGISTER_ANSWER["signing_public_key"], env.canonical_bytes(), env.signature)}


async def heartbeat_full(cp: ControlPlaneClient, node: str) -> Any:
    return await cp.heartbeat(node, HeartbeatRequest(
        node_id=node, timestamp=NOW, status="degraded", uptime="72h15m0s", binary_checksum=BINARY_CHECKSUM,
        mesh=MeshInfo("plexd0", 12, 51820), nat=NatInfo("203.0.113.10:51820", "full_cone"),
        extra={"bridge": {"enabled": True, "relay_enabled": True}, "paths": {"relayed": 1}},
        status_reason="the firewall cannot be enforced"))


async def heartbeat_bare(cp: ControlPlaneClient, node: str) -> Any:
    return await cp.heartbeat(node, HeartbeatRequest(node_id=node, timestamp=NOW, status="healthy", uptime="1.5s",
                                                     binary_checksum=BINARY_CHECKSUM))


async def capabilities_with_hooks(cp: ControlPlaneClient, node: str) -> Any:
    await cp.put_capabilities(node, capabilities_document("0.2.0", BINARY_CHECKSUM, [HOOK], builtin_capabilities()))


async def capabilities_empty(cp: ControlPlaneClient, node: str) -> Any:
    await cp.put_capabilities(node, capabilities_document("0.2.0", BINARY_CHECKSUM, []))


async def state_twice(cp: ControlPlaneClient, node: str) -> Any:
    first = await cp.fetch_state(node)
    await cp.fetch_state(node)  # conditional: If-None-Match with the first answer's ETag
    return first


async def drift(cp: ControlPlaneClient, node: str) -> Any:
    local = NOW.astimezone(timezone(timedelta(hours=1)))  # [C] prints the drift report's time in the local zone
    corrections = [Correction("peer_updated", "peer n_x: endpoint 1.2.3.4:51820 != 5.6.7.8:51820"),
                   Correction("route_added", "route 10.100.1.2/32: missing from table 51820")]
    await cp.report_drift(node, {"timestamp": format_time(local), "corrections": [c.to_wire() for c in corrections]})


async def reports(cp: ControlPlaneClient, node: str) -> Any:
    entry = {"key": "app-health", "content_type": "application/json", "payload": {"status": "healthy"},
             "version": 12, "updated_at": "2026-11-24T10:30:00.123456789+01:00"}
    await cp.sync_reports(node, [entry], ["old-key"])


async def reports_empty(cp: ControlPlaneClient, node: str) -> Any:
    await cp.sync_reports(node, [], [])


def outcome() -> Outcome:
    return Outcome(status="success", exit_code=0, stdout="<ok>", stderr="", duration=0.001234567)


async def result_triggered(cp: ControlPlaneClient, node: str) -> Any:
    request = ActionRequest("exec_1", "system.info", triggered_by={"type": "control_plane", "session_id": "",
                                                                   "user_id": "", "email": ""})
    await cp.report_result(node, "exec_1", result_body(request, outcome()))


async def result_plain(cp: ControlPlaneClient, node: str) -> Any:
    await cp.report_result(node, "exec/2", result_body(ActionRequest("exec/2", "health.check"), outcome()))


METRICS = [
    {"timestamp": "2026-11-24T10:30:00Z", "group": "system",
     "data": {"cpu_usage_percent": 1.5, "memory_used_bytes": 1, "memory_total_bytes": 2, "disk_used_bytes": 3,
              "disk_total_bytes": 4, "network_rx_bytes": 5, "network_tx_bytes": 6}},
    {"timestamp": "2026-11-24T10:30:00Z", "group": "tunnel", "peer_id": "n_p",
     "data": {"peer_id": "n_p", "last_handshake_time": "2026-11-24T10:29:00Z", "rx_bytes": 1, "tx_bytes": 2,
              "handshake_succeeded": True, "handshake_stale": False}},
    {"timestamp": "2026-11-24T10:30:00Z", "group": "latency", "peer_id": "n_p",
     "data": {"peer_id": "n_p", "rtt_nano": 812000}},
]
LOG = {"timestamp": "2026-11-24T10:30:00Z", "source": "journald", "unit": "sshd", "message": "accepted key",
       "severity": "info", "hostname": "web-01"}
AUDIT = {"timestamp": "2026-11-24T10:30:00Z", "source": "auditd", "event_type": "SYSCALL",
         "subject": {"uid": 0, "gid": 0, "pid": 1}, "object": '"/etc/shadow"', "action": "open", "result": "failure",
         "hostname": "web-01", "raw": "type=SYSCALL msg=audit(1.0:1): syscall=2"}


async def artifact(cp: ControlPlaneClient, node: str, arch: str = "amd64") -> dict[str, str]:
    async with cp.open_artifact("0.2.0", "linux", arch) as response:
        return {"body": (await response.aread()).decode()}


async def session(cp: ControlPlaneClient, node: str, activity: dict[str, Any]) -> Any:
    await cp.report_session_activity(node, "ses_1", activity)


SSH = {"ssh": {"command": "systemctl status nginx", "exit_code": 0, "started_at": "2026-11-24T12:01:02Z",
               "completed_at": "2026-11-24T12:01:03Z"}}
K8S = {"k8s": {"verb": "create", "resource_kind": "pods/exec", "namespace": "web", "name": "web-0",
               "status_code": 101, "duration_ms": 5321}}
TCP_START = {"tcp": {"phase": "session_started", "target_host": "127.0.0.1", "target_port": 5432,
                     "listener_endpoint": "10.100.0.7:40511"}}
TCP_END = {"tcp": {"phase": "session_ended", "bytes_in": 1024, "bytes_out": 52311, "terminated_by": "idle_timeout"}}


SCENARIOS = [
    Scenario("register", "first registration", register_fully, result=True, registered=False),
    Scenario("register", "without metadata or capabilities", register_bare, result=True, registered=False),
    Scenario("register", "re-registration with the node's bearer", reregister, result=True),
    Scenario("events", "first connect", event, result=True),
    Scenario("events", "with a cursor", lambda cp, node: event(cp, node, "evt_d4e5f6"), result=True),
    Scenario("heartbeat", "every block", heartbeat_full, result=True),
    Scenario("heartbeat", "nothing to say", heartbeat_bare, result=True),
    Scenario("deregister", "leave", lambda cp, node: cp.deregister(node)),
    Scenario("deregister", "purge", lambda cp, node: cp.deregister(node, purge=True)),
    Scenario("keys_rotate", "rotation", lambda cp, node: cp.rotate_keys(node, NEW_NODE_KEY), result=True),
    Scenario("capabilities", "hooks and built-ins (gzipped)", capabilities_with_hooks),
    Scenario("capabilities", "nothing to announce", capabilities_empty),
    Scenario("endpoint", "report", lambda cp, node: cp.report_endpoint(node, "203.0.113.10:51820", "full_cone"),
             result=True),
    Scenario("state", "pull and conditional pull", state_twice, result=True),
    Scenario("drift", "corrections", drift),
    Scenario("secrets", "escaped key", lambda cp, node: cp.fetch_secret(node, "tls/cert"), result=True),
    Scenario("report", "an entry and a deletion", reports),
    Scenario("report", "nothing", reports_empty),
    Scenario("execution_ack", "accepted", lambda cp, node: cp.ack_execution(node, "exec_1", "accepted")),
    Scenario("execution_ack", "rejected", lambda cp, node: cp.ack_execution(node, "exec_1", "rejected",
                                                                            "unknown_action")),
    Scenario("execution_result", "triggered by the control plane", result_triggered),
    Scenario("execution_result", "without trigger", result_plain),
    Scenario("metrics", "one of each group", lambda cp, node: cp.send_metrics(node, METRICS)),
    Scenario("metrics", "a large batch (gzipped)", lambda cp, node: cp.send_metrics(node, METRICS * 20)),
    Scenario("logs", "a line", lambda cp, node: cp.send_logs(node, [LOG])),
    Scenario("audit", "a record", lambda cp, node: cp.send_audit(node, [AUDIT])),
    Scenario("artifacts", "release", artifact, result=True),
    Scenario("artifacts", "signature", lambda cp, node: artifact(cp, node, "amd64.sig"), result=True),
    Scenario("tunnel_ready", "ready", lambda cp, node: cp.tunnel_ready(node, "ses_1", "10.100.1.5:41234", NOW)),
    Scenario("tunnel_closed", "closed", lambda cp, node: cp.tunnel_closed(node, "ses_1", "revoked", "5m3.2s", NOW)),
    Scenario("integrity_violations", "a hook changed", lambda cp, node: cp.report_integrity_violation(
        node, kind="hook", path="/etc/plexd/hooks.d/backup", expected_checksum=sha256_hex("a"),
        actual_checksum=sha256_hex("b"), detail="hook checksum mismatch", timestamp=NOW)),
    Scenario("ping", "reachability", lambda cp, node: cp.ping()),
    Scenario("session_activity", "ssh command", lambda cp, node: session(cp, node, SSH)),
    Scenario("session_activity", "k8s request", lambda cp, node: session(cp, node, K8S)),
    Scenario("session_activity", "tcp started", lambda cp, node: session(cp, node, TCP_START)),
    Scenario("session_activity", "tcp ended", lambda cp, node: session(cp, node, TCP_END)),
]
