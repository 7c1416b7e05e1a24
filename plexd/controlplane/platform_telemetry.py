"""The telemetry streams in the platform contract's shapes (docs/platform-dialect.md, Call by call).

The queue holds the spec's entries (docs/protocol.md §1.14-§1.16); they are translated as they go out:

- metrics → a JSON array of samples ``{group, name, value, labels?, timestamp}``: a system point gives one
  ``node_resources`` sample per number, a tunnel point ``tunnel_health`` samples (bytes both ways, whether the
  handshake succeeded and is stale) labelled with the peer, a latency point one ``peer_latency`` sample;
- logs → NDJSON lines ``{severity, unit?, hostname?, message, timestamp}``;
- audit → NDJSON lines ``{source, action, outcome, timestamp}``: auditd's records as ``auditd``, plexd's own (access
  sessions, local actions) as well, since the platform knows only auditd and k8s as sources.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from plexd.base import boundedjson
from plexd.base.gojson import EncodedJSON

JSON = Any
GROUPS = {"system": "node_resources", "tunnel": "tunnel_health", "latency": "peer_latency"}
TUNNEL_NUMBERS = ("rx_bytes", "tx_bytes", "handshake_succeeded", "handshake_stale")


def entries_of(batch: Iterable[Mapping[str, JSON]] | EncodedJSON) -> list[Mapping[str, JSON]]:
    if isinstance(batch, EncodedJSON):
        doc = boundedjson.loads(batch.text, "telemetry batch")  # the queue's own text, bounded all the same
        return [e for e in doc if isinstance(e, dict)] if isinstance(doc, list) else []
    return list(batch)


def _number(value: JSON) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, int | float) else None


def metric_samples(batch: Iterable[Mapping[str, JSON]] | EncodedJSON) -> list[dict[str, JSON]]:
    out: list[dict[str, JSON]] = []
    for entry in entries_of(batch):
        group, stamp, data = GROUPS.get(str(entry.get("group"))), entry.get("timestamp"), entry.get("data")
        if group is None or not isinstance(stamp, str) or not isinstance(data, dict):
            continue
        peer = entry.get("peer_id")
        labels = {"peer_id": peer} if isinstance(peer, str) else None
        names = TUNNEL_NUMBERS if group == "tunnel_health" else tuple(k for k in data if k != "peer_id")
        for name in names:
            value = _number(data.get(name))
            if value is None:
                continue
            sample: dict[str, JSON] = {"group": group, "name": name, "value": value, "timestamp": stamp}
            if labels:
                sample["labels"] = labels
            out.append(sample)
    return out


def ndjson(lines: Iterable[Mapping[str, JSON]]) -> bytes:
    return "".join(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n" for line in lines).encode()


def log_lines(batch: Iterable[Mapping[str, JSON]] | EncodedJSON) -> list[dict[str, JSON]]:
    out = []
    for entry in entries_of(batch):
        line = {k: entry[k] for k in ("severity", "unit", "hostname", "message", "timestamp")
                if isinstance(entry.get(k), str) and entry[k]}
        if "severity" in line and "timestamp" in line:
            out.append(line)
    return out


def audit_events(batch: Iterable[Mapping[str, JSON]] | EncodedJSON) -> list[dict[str, JSON]]:
    out = []
    for entry in entries_of(batch):
        action, outcome, stamp = entry.get("action"), entry.get("result"), entry.get("timestamp")
        if all(isinstance(v, str) and v for v in (action, outcome, stamp)):
            out.append({"source": "k8s" if entry.get("source") == "k8s" else "auditd", "action": action,
                        "outcome": outcome, "timestamp": stamp})
    return out
