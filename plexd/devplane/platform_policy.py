"""The deployment's policies as the platform's `policy` block: one flat list of CIDR rules.

A spec rule (docs/protocol.md §9, plexd/state/policy.py) names its ends as a node id, `*` or a CIDR; `protocol`
tcp, udp, icmp or "" (any); `port` 0 for any port, and a port with "" means tcp and udp on that port. The
platform rule has `source_cidr`/`destination_cidr`, protocol tcp|udp|icmp|any and `ports {from, to}` exactly for
tcp and udp. So: a node becomes its mesh address /32, `*` the whole address family, a port-less tcp/udp rule
ports 1-65535, and "" with a port two rules (tcp, then udp). Order is kept: rules apply first match first.

A rule naming a node that is not registered matches nothing, so it is left out (it comes back when the node
does); so is a rule the devplane's own engine would not use (an unchecked policy document). The fingerprint is
the base64 SHA-256 of the rule list's canonical JSON, and the revision id a UUID derived from it, so both change
exactly when the rules do.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import uuid
from collections.abc import Callable
from typing import Any

ANY_V4, ANY_V6 = "0.0.0.0/0", "::/0"
ALL_PORTS = {"from": 1, "to": 65535}
_REVISION_NAMESPACE = uuid.UUID("0b6d1c52-5c5e-4b8e-9d7a-2f1e0c3b4a59")


def _end(side: Any, mesh_ip: Callable[[str], str | None]) -> str | None:
    """A rule end as a CIDR ("*" stays "*" until the other end picks the family), or None when unusable."""
    if not isinstance(side, str) or not side:
        return None
    if side == "*":
        return side
    if "/" in side:
        try:
            return str(ipaddress.ip_network(side, strict=False))
        except ValueError:
            return None
    ip = mesh_ip(side)
    return f"{ip}/32" if ip else None


def translate_rule(rule: Any, mesh_ip: Callable[[str], str | None]) -> list[dict[str, Any]]:
    """One spec rule as platform rules ([] when it cannot match anything)."""
    if not isinstance(rule, dict) or rule.get("action", "allow") not in ("allow", "deny"):
        return []
    src, dst = _end(rule.get("src"), mesh_ip), _end(rule.get("dst"), mesh_ip)
    port, protocol = rule.get("port", 0) or 0, rule.get("protocol", "") or ""
    if src is None or dst is None or protocol not in ("", "tcp", "udp", "icmp") or isinstance(port, bool) \
            or not isinstance(port, int) or not 0 <= port <= 65535 or (protocol == "icmp" and port):
        return []
    families = {ipaddress.ip_network(x).version for x in (src, dst) if x != "*"}
    if len(families) > 1:
        return []  # a v4 end and a v6 end: no packet has both
    everywhere = ANY_V6 if families == {6} else ANY_V4
    action = rule.get("action", "allow")
    ends = {"source_cidr": everywhere if src == "*" else src, "destination_cidr": everywhere if dst == "*" else dst}
    if protocol == "icmp" or (protocol == "" and not port):
        return [{"action": action, "protocol": protocol or "any", **ends}]
    ports = {"from": port, "to": port} if port else ALL_PORTS
    return [{"action": action, "protocol": p, **ends, "ports": dict(ports)}
            for p in ([protocol] if protocol else ["tcp", "udp"])]


def policy_block(policies: list[Any], mesh_ip: Callable[[str], str | None]) -> dict[str, Any] | None:
    """`{revision_id, fingerprint, rules}`, or None when the deployment has no policy at all."""
    if not policies:
        return None
    rules = [out for pol in policies if isinstance(pol, dict) and isinstance(pol.get("rules"), list)
             for rule in pol["rules"] for out in translate_rule(rule, mesh_ip)]
    digest = hashlib.sha256(json.dumps(rules, sort_keys=True, separators=(",", ":")).encode()).digest()
    fingerprint = base64.b64encode(digest).decode()
    return {"revision_id": str(uuid.uuid5(_REVISION_NAMESPACE, fingerprint)), "fingerprint": fingerprint,
            "rules": rules}
