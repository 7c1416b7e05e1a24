"""A node's desired state as the platform's snapshot: eight blocks, always present, from the same Deployment.

- `peers`: the peers the spec state lists (policy visibility, offline nodes left out), `{node_id, mesh_ip,
  public_key, fallback_endpoint?}` by node id. The snapshot has one endpoint field, so `fallback_endpoint` is the
  endpoint the spec state would give: the relay carrying the pair if there is one, else the peer's known endpoint.
- `reachability`: the devplane's liveness verdict in the platform's words (`never_reported` until the first
  heartbeat, `healthy`, `stale` after 3 missed intervals, `unreachable` after 10), with when it last changed.
- `policy`: platform_policy; `bridge`: the node's bridge block with its four members (null: not a bridge);
  `sessions`: the spec block, already in the platform's shape; `executions`: platform_executions.
- `state` and `reports` (equal, as on the platform): metadata, data (the payload as compact JSON text) and the
  node's own reports, each a key-sorted list of `{key, value}`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from plexd.base import gojson
from plexd.devplane import platform_executions, session_issuer
from plexd.devplane.platform_policy import policy_block
from plexd.devplane.store import Node

_VERDICT = {"online": "healthy", "unreachable": "stale", "offline": "unreachable"}
BRIDGE_MEMBERS = ("relay", "user_access", "ingress", "site_to_site")


def peer_entry(peer: Node, endpoint: str) -> dict[str, Any]:
    entry = {"node_id": peer.id, "mesh_ip": peer.mesh_ip, "public_key": peer.public_key}
    if endpoint:
        entry["fallback_endpoint"] = endpoint
    return entry


def peers(dep: Any, node: Node) -> list[dict[str, Any]]:
    relays = dep.fallbacks(node)
    return [peer_entry(p, relays.get(p.id) or p.endpoint)
            for p in sorted(dep.visible_peers(node), key=lambda p: p.id)]


class Reachability:
    """The reachability block, with the moment each node's verdict last changed (kept in memory: a restarted
    devplane first sees its nodes' verdicts then)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}

    def block(self, node: Node, now: datetime) -> dict[str, Any]:
        if node.last_heartbeat is None:
            return {"state": "never_reported", "changed_at": node.registered_at}
        state = _VERDICT.get(node.status, "unreachable")
        known = self._seen.get(node.id)
        if known is None or known[0] != state:
            known = (state, gojson.format_time(now))
            self._seen[node.id] = known
        return {"state": state, "changed_at": known[1]}


def _entries(items: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": k, "value": items[k]} for k in sorted(items)]


def node_state_block(node: Node) -> dict[str, Any]:
    data = {k: json.dumps(e.get("payload"), separators=(",", ":"), ensure_ascii=False) for k, e in node.data.items()}
    reports = []
    for key in sorted(node.reports):
        entry = node.reports[key]
        out = {"key": key, "value": entry.get("value", "")}
        if entry.get("workload_tag"):
            out["workload_tag"] = entry["workload_tag"]
        reports.append(out)
    return {"metadata": _entries(node.metadata), "data": _entries(data), "reports": reports}


def bridge_block(block: Any) -> dict[str, Any] | None:
    if not isinstance(block, dict):
        return None
    out = {member: block.get(member) for member in BRIDGE_MEMBERS}
    if isinstance(out["relay"], dict):  # its `endpoint` is the devplane's own note for the fallbacks
        out["relay"] = {k: v for k, v in out["relay"].items() if k != "endpoint"}
    return out


def snapshot(dep: Any, node: Node, reachability: Reachability) -> dict[str, Any]:
    now = dep.clock.now()

    def mesh_ip(node_id: str) -> str | None:
        named = dep.nodes.get(node_id)
        return named.mesh_ip if named is not None and not named.removed else None

    state = node_state_block(node)
    return {
        "peers": peers(dep, node),
        "reachability": reachability.block(node, now),
        "policy": policy_block(dep.policies, mesh_ip),
        "bridge": bridge_block(node.bridge),
        "state": state,
        "reports": state,
        "executions": platform_executions.block(dep, node),
        "sessions": session_issuer.block(node, now),
    }
