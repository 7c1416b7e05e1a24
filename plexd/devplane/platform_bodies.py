"""The platform dialect's request bodies, checked as its reference control plane checks them: strictly (an unknown
member is a decoding error), with the contract's codes, in the order the checks run there.

Each function takes the parsed JSON and returns what the handler keeps, or raises a Problem.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import datetime
from typing import Any

from plexd.base import gojson
from plexd.devplane.platform_wire import Problem, is_digest32, is_wireguard_key, strict_object

MAX_SKEW = 60.0
NAT_TYPES = ("full_cone", "restricted", "port_restricted", "symmetric", "unknown")
_FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]+={0,2}$")


def _time(value: Any, what: str, code: str) -> datetime:
    try:
        return gojson.parse_time(value)
    except ValueError:
        raise Problem(400, code, f"{what}: must be an RFC 3339 time") from None


def _skewed(moment: datetime, now: datetime) -> float | None:
    skew = (moment - now).total_seconds()
    return skew if abs(skew) > MAX_SKEW else None


def endpoint_address(text: Any) -> tuple[str, int] | None:
    """`ip:port` or `[v6]:port` naming a routable address: the only endpoints the platform stores."""
    if not isinstance(text, str):
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
        return None
    return str(ip), int(port)


def _strings(body: dict[str, Any], keys: tuple[str, ...], code: str) -> None:
    for key in keys:
        if body.get(key) is not None and not isinstance(body[key], str):
            raise Problem(400, code, f"{key}: must be a string")


# -- heartbeat (§6) ----------------------------------------------------------------------------------------------

HEARTBEAT = "malformed_heartbeat_request"


def heartbeat(body: Any, now: datetime) -> str:
    """Check a heartbeat; returns the NAT type it reports ("" before discovery)."""
    body = strict_object(body, ("client_now", "binary_checksum", "binary_version", "nat_summary"), HEARTBEAT)
    _strings(body, ("client_now", "binary_checksum", "binary_version"), HEARTBEAT)
    nat = body.get("nat_summary")
    if not isinstance(nat, dict):
        raise Problem(400, HEARTBEAT, "nat_summary: must be an object ({} before NAT discovery)")
    nat = strict_object(nat, ("endpoint", "nat_type"), HEARTBEAT, "nat_summary")
    if nat and (endpoint_address(nat.get("endpoint")) is None or nat.get("nat_type") not in NAT_TYPES):
        raise Problem(400, HEARTBEAT, f"nat_summary: must be {{}} or {{endpoint HOST:PORT, nat_type one of "
                                      f"{', '.join(NAT_TYPES)}}}")
    client_now = body.get("client_now")
    if client_now is None:  # Go decodes it as the zero time, which is as skewed as a time gets
        raise Problem(400, "clock_skew", "client_now: missing")
    skew = _skewed(_time(client_now, "client_now", HEARTBEAT), now)
    if skew is not None:
        raise Problem(400, "clock_skew", f"client_now is {skew:+.0f}s from the server's clock (at most "
                                         f"{MAX_SKEW:.0f}s); sync NTP")
    if not is_digest32(body.get("binary_checksum")):
        raise Problem(400, "binary_checksum_empty", "binary_checksum: must be the SHA-256 in standard base64")
    if not (body.get("binary_version") or "").strip():
        raise Problem(400, "binary_version_empty", "binary_version: must not be empty")
    return nat.get("nat_type") or ""


# -- capabilities (§9) -------------------------------------------------------------------------------------------

CAPABILITIES = "malformed_capabilities_request"
MAX_HOOKS = 128


def capabilities(body: Any) -> dict[str, Any]:
    body = strict_object(body, ("binary_version", "binary_checksum", "ssh_host_key_fingerprint", "declared_hooks"),
                         CAPABILITIES)
    _strings(body, ("binary_version", "binary_checksum", "ssh_host_key_fingerprint"), CAPABILITIES)
    hooks = body.get("declared_hooks")
    if hooks is not None and not isinstance(hooks, list):
        raise Problem(400, CAPABILITIES, "declared_hooks: must be an array")
    if not (body.get("binary_version") or "").strip():
        raise Problem(400, "binary_version_empty", "binary_version: must not be empty")
    if not is_digest32(body.get("binary_checksum")):
        raise Problem(400, "binary_checksum_invalid", "binary_checksum: must be the SHA-256 in standard base64")
    fingerprint = body.get("ssh_host_key_fingerprint")
    if fingerprint and not _FINGERPRINT.match(fingerprint):
        raise Problem(400, "ssh_host_key_fingerprint_invalid", "ssh_host_key_fingerprint: must be SHA256:<base64>")
    if len(hooks or ()) > MAX_HOOKS:
        raise Problem(400, "declared_hooks_too_many", f"declared_hooks: at most {MAX_HOOKS}")
    names: set[str] = set()
    for i, hook in enumerate(hooks or ()):
        hook = strict_object(hook, ("name", "checksum"), CAPABILITIES, f"declared_hooks[{i}]")
        if not isinstance(hook.get("name"), str) or not hook["name"] or not is_digest32(hook.get("checksum")):
            raise Problem(400, "declared_hook_invalid", f"declared_hooks[{i}]: needs a name and a SHA-256 checksum "
                                                        "in standard base64")
        if hook["name"] in names:
            raise Problem(400, "declared_hook_duplicate", f"declared_hooks[{i}]: {hook['name']!r} is declared twice")
        names.add(hook["name"])
    return body


MANIFEST_FIELDS = ("binary_checksum", "binary_version", "declared_hooks", "ssh_host_key_fingerprint")


def capability_changes(previous: Any, body: dict[str, Any]) -> list[str]:
    """The manifest fields that differ from the node's last manifest, sorted (the platform's `fields_changed`; all
    the sent ones on a first manifest)."""
    before = previous if isinstance(previous, dict) else {}
    return [name for name in MANIFEST_FIELDS if before.get(name) != body.get(name)]


# -- integrity violations (§11) ----------------------------------------------------------------------------------

INTEGRITY = "malformed_integrity_violations_request"
MAX_VIOLATIONS = 128
KINDS = ("binary_checksum", "hook_checksum", "ssh_host_key")
DETECTED_BY = ("startup_scan", "inotify", "pre_dispatch")
_VIOLATION = ("kind", "detected_by", "artifact_id", "observed_checksum", "expected_checksum", "observed_fingerprint",
              "expected_fingerprint")


def integrity(body: Any) -> list[dict[str, Any]]:
    body = strict_object(body, ("violations",), INTEGRITY)
    violations = body.get("violations")
    if violations is not None and not isinstance(violations, list):
        raise Problem(400, INTEGRITY, "violations: must be an array")
    if not violations:
        raise Problem(400, "integrity_violations_empty", "violations: at least one")
    if len(violations) > MAX_VIOLATIONS:
        raise Problem(400, "integrity_violations_too_many", f"violations: at most {MAX_VIOLATIONS}")
    for i, v in enumerate(violations):
        where = f"violations[{i}]"
        v = strict_object(v, _VIOLATION, INTEGRITY, where)
        _strings(v, _VIOLATION, INTEGRITY)
        if v.get("kind") not in KINDS:
            raise Problem(400, "integrity_violation_kind_invalid", f"{where}.kind: one of {', '.join(KINDS)}")
        if v.get("detected_by") not in DETECTED_BY:
            raise Problem(400, "integrity_violation_detected_by_invalid",
                          f"{where}.detected_by: one of {', '.join(DETECTED_BY)}")
        artifact = v.get("artifact_id") or ""
        if not artifact or len(artifact) > 4096:
            raise Problem(400, "integrity_violation_artifact_id_empty", f"{where}.artifact_id: 1-4096 characters")
        host_key = v["kind"] == "ssh_host_key"
        foreign = ("observed_checksum", "expected_checksum") if host_key else ("observed_fingerprint",
                                                                              "expected_fingerprint")
        if any(k in v for k in foreign):
            raise Problem(400, "integrity_violation_kind_mismatch", f"{where}: a {v['kind']} violation has no "
                                                                    f"{' or '.join(foreign)}")
        if host_key:
            if not all(_FINGERPRINT.match(v[k]) for k in ("observed_fingerprint", "expected_fingerprint")
                       if k in v) or "observed_fingerprint" not in v:
                raise Problem(400, "integrity_violation_host_key_fingerprint_invalid",
                              f"{where}: observed_fingerprint (and expected_fingerprint) must be SHA256:<base64>")
        elif not all(is_digest32(v[k]) for k in ("observed_checksum", "expected_checksum") if k in v) \
                or "observed_checksum" not in v:
            raise Problem(400, "integrity_violation_checksum_invalid",
                          f"{where}: observed_checksum (and expected_checksum) must be SHA-256 in standard base64")
    return violations


# -- endpoint (§13) ----------------------------------------------------------------------------------------------

ENDPOINT = "malformed_endpoint_request"


def endpoint(body: Any, now: datetime) -> tuple[str, str]:
    """(endpoint, nat_type) of an endpoint report."""
    body = strict_object(body, ("endpoint", "nat_type", "reported_at"), ENDPOINT)
    _strings(body, ("endpoint", "nat_type", "reported_at"), ENDPOINT)
    if not body.get("endpoint") or body.get("nat_type") not in NAT_TYPES or not body.get("reported_at"):
        raise Problem(400, ENDPOINT, f"endpoint, nat_type (one of {', '.join(NAT_TYPES)}) and reported_at are "
                                     "required")
    skew = _skewed(_time(body["reported_at"], "reported_at", ENDPOINT), now)
    if skew is not None:
        raise Problem(400, "endpoint_clock_skew", f"reported_at is {skew:+.0f}s from the server's clock")
    address = endpoint_address(body["endpoint"])
    if address is None:
        raise Problem(400, "endpoint_unparseable", "endpoint: must be IP:PORT of a routable address")
    ip, port = address
    return (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"), body["nat_type"]


# -- node-authored reports (§12) ---------------------------------------------------------------------------------

REPORT_KEY = re.compile(r"^[a-z][a-z0-9._-]{0,127}$")
MAX_REPORT_VALUE = 4096


def report(key: str, body: Any) -> dict[str, Any]:
    """The entry a `PUT .../state/reports/{key}` stores: `{key, value[, workload_tag]}`."""
    if not REPORT_KEY.match(key):
        raise Problem(400, "invalid_report", f"key {key[:140]!r}: must match {REPORT_KEY.pattern}")
    body = strict_object(body, ("value", "workload_tag"), "invalid_report")
    value, tag = body.get("value"), body.get("workload_tag")
    if not isinstance(value, str) or len(value.encode()) > MAX_REPORT_VALUE:
        raise Problem(400, "invalid_report", f"value: a string of at most {MAX_REPORT_VALUE} bytes")
    if tag is not None and not isinstance(tag, str):
        raise Problem(400, "invalid_report", "workload_tag: must be a string")
    return {"key": key, "value": value, **({"workload_tag": tag} if tag else {})}


# -- key rotation (§10) ------------------------------------------------------------------------------------------

def new_public_key(body: Any) -> str:
    body = strict_object(body, ("new_public_key",), "malformed_keys_rotate_request")
    _strings(body, ("new_public_key",), "malformed_keys_rotate_request")
    key = body.get("new_public_key")
    if not is_wireguard_key(key):
        raise Problem(422, "keys_rotate_public_key_invalid", "new_public_key: must be 32 bytes in standard base64, "
                                                             "not all zero")
    return key


# -- observability ingest (§13) ----------------------------------------------------------------------------------

INGEST = "ingest_batch_malformed"
METRIC_GROUPS = ("node_resources", "tunnel_health", "peer_latency", "agent_stats")


def _entry(item: Any, fields: tuple[str, ...], required: tuple[str, ...], where: str) -> dict[str, Any]:
    item = strict_object(item, fields, INGEST, where)
    missing = [k for k in required if item.get(k) in (None, "")]
    if missing:
        raise Problem(400, INGEST, f"{where}.{missing[0]}: required")
    _time(item["timestamp"], f"{where}.timestamp", INGEST)
    return item


def metrics(batch: Any) -> list[dict[str, Any]]:
    if not isinstance(batch, list) or not batch:
        raise Problem(400, INGEST, "body: must be a non-empty JSON array of metric samples")
    for i, item in enumerate(batch):
        where = f"[{i}]"
        item = _entry(item, ("group", "name", "value", "labels", "timestamp"), ("group", "name", "timestamp"), where)
        if item["group"] not in METRIC_GROUPS or not isinstance(item["name"], str):
            raise Problem(400, INGEST, f"{where}.group: one of {', '.join(METRIC_GROUPS)}")
        if not isinstance(item.get("value"), int | float) or isinstance(item.get("value"), bool):
            raise Problem(400, INGEST, f"{where}.value: must be a number")
        labels = item.get("labels")
        if labels is not None and not (isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())):
            raise Problem(400, INGEST, f"{where}.labels: must be an object of strings")
    return batch


def log_lines(items: list[Any]) -> list[dict[str, Any]]:
    for i, item in enumerate(items):
        item = _entry(item, ("severity", "unit", "hostname", "message", "timestamp"), ("severity", "timestamp"),
                      f"line {i + 1}")
        _strings(item, ("severity", "unit", "hostname", "message"), INGEST)
    return items


def audit_events(items: list[Any]) -> list[dict[str, Any]]:
    for i, item in enumerate(items):
        where = f"line {i + 1}"
        item = _entry(item, ("source", "action", "outcome", "timestamp"), ("source", "action", "outcome", "timestamp"),
                      where)
        if item["source"] not in ("auditd", "k8s"):
            raise Problem(400, INGEST, f"{where}.source: auditd or k8s")
        _strings(item, ("action", "outcome"), INGEST)
    return items
