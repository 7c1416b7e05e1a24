"""A bridge's state in the heartbeat's `bridge`, `user_access` and `site_to_site` objects (older contract;
docs/protocol.md §1.4), from its domains' own status. Unlike the Go agent's, they carry the access interface's and each
tunnel's public key (docs/decisions.md, Go defect D4: without them the other end can never be configured)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def heartbeat_blocks(relay: Mapping[str, Any] | None, access: Mapping[str, Any] | None,
                     tunnels: Mapping[str, Any] | None, ingress: Mapping[str, Any] | None) -> dict[str, Any]:
    relay = relay or {}
    rules = list((ingress or {}).get("rules") or [])
    access = access or {}
    listed = list((tunnels or {}).get("tunnels") or [])
    out: dict[str, Any] = {
        "bridge": {"enabled": True, "access_interface": access.get("interface", ""),
                   "active_routes": int(access.get("peer_count", 0)) + len(listed),
                   "relay_enabled": bool(relay.get("listening")),
                   "active_relay_sessions": len(relay.get("sessions", [])),
                   "ingress_enabled": bool(rules), "active_ingress_rules": len(rules),
                   "site_to_site_enabled": bool(listed), "active_site_to_site_tunnels": len(listed)},
        "user_access": {"enabled": bool(access.get("interface")), "interface_name": access.get("interface", ""),
                        "peer_count": int(access.get("peer_count", 0)), "listen_port": access.get("listen_port", 0),
                        "public_key": access.get("public_key", "")},
        "ingress": {"enabled": bool(rules), "rule_count": len(rules),
                    "connection_count": int((ingress or {}).get("connections", 0)), "acme_enabled": False},
        "site_to_site": {"enabled": bool(listed), "tunnel_count": len(listed),
                         "tunnels": [{k: t.get(k) for k in ("tunnel_id", "interface", "public_key", "listen_port")}
                                     for t in listed]},
    }
    return out


def status_reports(blocks: Mapping[str, Any]) -> dict[str, Any]:
    """The newer contract's report keys for the same objects: status.bridge, status.user-access, ..."""
    return {"status." + name.replace("_", "-"): value for name, value in blocks.items()}
