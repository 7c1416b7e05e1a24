"""Access sessions in the reference control plane (docs/protocol.md §A1): minting, the `sessions` block of
a node's state, revocation, and the activity nodes report.

A session is desired state of its node: it is in the block from `create` until it is revoked or its
`expires_at` passes (the block then simply no longer lists it: that is the node's teardown signal). An ended
session is kept an hour more, so the node's `session_ended` report about it is still taken. The token is
a compact EdDSA JWS signed with the deployment's current event-signing key (`plexd.access.token`), so a node
checks it with the keys it already trusts. Sessions are kept in the node's document (they survive a restart of
the devplane); the token is returned once and never stored.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any

from plexd.access.token import sign_session_token
from plexd.base import gojson
from plexd.base.hostname import is_hostname, is_ip
from plexd.devplane import wire
from plexd.devplane.store import Node
from plexd.devplane.wire import DevplaneAPIError
from plexd.state.sessions_block import impersonation_problem

KINDS = ("ssh", "tcp", "k8s")
MAX_PER_NODE = 10  # the Go agent's tunnel.max_sessions: a node would refuse the eleventh
MAX_COMMAND = 1024
TERMINATED_BY = ("ttl_expired", "idle_timeout", "plexd_close", "operator_revoke")
RETAIN = timedelta(hours=1)  # an ended session is kept this long for the node's last reports about it
_WIRE = ("session_id", "jti", "kind", "target", "expires_at", "idle_timeout_seconds")


def target_of(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """The session's `target.<kind>` object from an admin request, checked."""
    if kind == "ssh":
        user = _user(body)
        commands = body.get("allowed_commands")
        if commands is not None and (not isinstance(commands, list)
                                     or not all(isinstance(c, str) and c for c in commands)):
            raise DevplaneAPIError(400, "allowed_commands: must be an array of non-empty strings")
        return {"user": user, **({"allowed_commands": commands} if commands else {})}
    if kind == "tcp":
        host, port = body.get("host", "127.0.0.1"), body.get("port")
        if not isinstance(host, str) or not host:
            raise DevplaneAPIError(400, "host: must be a non-empty string")
        if not is_ip(host) and not is_hostname(host):  # what the node accepts (plexd.state.sessions_block)
            raise DevplaneAPIError(400, f"host: {host[:60]!r} is not an IP address or host name")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise DevplaneAPIError(400, f"port: must be an integer 1-65535, got {port!r}")
        return {"host": host, "port": port}
    groups = body.get("groups") or []
    if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
        raise DevplaneAPIError(400, "groups: must be an array of non-empty strings")
    user = _user(body)
    # Refused here, not only by the node: they go into the API server's request head as they are.
    for field, what, value in [("user", "user", user), *(("groups", "group", g) for g in groups)]:
        if problem := impersonation_problem(what, value):
            raise DevplaneAPIError(400, f"{field}: {problem}")
    return {"user": user, **({"impersonate_groups": groups} if groups else {})}


def _user(body: dict[str, Any]) -> str:
    user = body.get("user")
    if not isinstance(user, str) or not user or any(c in user for c in "/\0") or user in (".", ".."):
        raise DevplaneAPIError(400, "user: must be a user name (no '/', NUL, '.' or '..')")
    return user


def create(node: Node, signing_key: Any, now: datetime, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A new session of `node` from an admin request {kind, ttl_seconds, idle_timeout_seconds, user | host/port
    | groups, allowed_commands}; returns (the session as the node's state lists it, its token)."""
    kind = body.get("kind")
    if kind not in KINDS:
        raise DevplaneAPIError(400, f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    ttl = body.get("ttl_seconds")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= 7 * 86400:
        raise DevplaneAPIError(400, f"ttl_seconds: must be a number of seconds in (0, 604800], got {ttl!r}")
    idle = body.get("idle_timeout_seconds", 0)
    if isinstance(idle, bool) or not isinstance(idle, int) or idle < 0:
        raise DevplaneAPIError(400, f"idle_timeout_seconds: must be a whole number >= 0, got {idle!r}")
    live = [s for s in node.sessions.values() if not ended(s, now)]
    if len(live) >= MAX_PER_NODE:
        raise DevplaneAPIError(409, f"node {node.id} already has {len(live)} live sessions (at most {MAX_PER_NODE})")
    target = target_of(kind, body)
    sid = "ses_" + secrets.token_hex(8)
    expires = now + timedelta(seconds=float(ttl))
    session = {"session_id": sid, "jti": sid, "kind": kind, "target": {kind: target},
               "expires_at": gojson.format_time(expires), "idle_timeout_seconds": idle,
               "created_at": gojson.format_time(now), "listener_endpoint": ""}
    claims = {"jti": sid, "kind": kind, "target": {"kind": kind, **target},
              "nbf": int(now.timestamp()), "exp": int(expires.timestamp())}
    node.sessions[sid] = session
    return session, sign_session_token(signing_key, claims)


def expired(session: dict[str, Any], now: datetime) -> bool:
    return gojson.parse_time(session["expires_at"]) <= now


def ended(session: dict[str, Any], now: datetime) -> bool:
    """Revoked or expired: out of the block, but still known, so its node can report how it ended."""
    return bool(session.get("revoked_at")) or expired(session, now)


def revoke(node: Node, session_id: str, now: datetime) -> None:
    session = node.sessions.get(session_id)
    if session is None or session.get("revoked_at"):  # an expired one may still be revoked: its record says so
        raise DevplaneAPIError(404, f"node {node.id} has no session {session_id!r} to revoke")
    session["revoked_at"] = gojson.format_time(now)


def prune(node: Node, now: datetime) -> bool:
    """Forget the sessions that ended more than RETAIN ago; True when there were any."""
    def gone(s: dict[str, Any]) -> bool:
        end = min(gojson.parse_time(s["expires_at"]), gojson.parse_time(s.get("revoked_at") or s["expires_at"]))
        return end + RETAIN <= now

    old = [sid for sid, s in node.sessions.items() if gone(s)]
    for sid in old:
        del node.sessions[sid]
    return bool(old)


def block(node: Node, now: datetime) -> list[dict[str, Any]]:
    """The `sessions` block of the node's state: every live session, in the wire shape (always a list: `[]`
    tells the node to close everything, where an absent block would touch nothing)."""
    return [{k: s[k] for k in _WIRE} for s in sorted(node.sessions.values(), key=lambda s: s["created_at"])
            if not ended(s, now)]


def summary(node: Node, session: dict[str, Any], now: datetime) -> dict[str, Any]:
    """A session as the admin API lists it."""
    return {**session, "node_id": node.id, "mesh_ip": node.mesh_ip, "live": not ended(session, now)}


def record_activity(node: Node, session_id: str, body: Any) -> dict[str, Any]:
    """Check a `POST /v1/nodes/{id}/sessions/{sid}` body (§A1.4: exactly one of ssh, k8s, tcp) and note what it
    says about the session (its listener); returns the body to record."""
    session = node.sessions.get(session_id)
    if session is None:
        raise DevplaneAPIError(404, f"node {node.id} has no session {session_id!r}")
    if not isinstance(body, dict):
        raise DevplaneAPIError(400, f"body: must be a JSON object, got {wire.kind(body)}")
    members = [k for k in KINDS if body.get(k) is not None]
    if len(members) != 1 or set(body) - set(KINDS):
        raise DevplaneAPIError(400, "body: exactly one of \"ssh\", \"k8s\", \"tcp\" must be set")
    activity = body[members[0]]
    if not isinstance(activity, dict):
        raise DevplaneAPIError(400, f"{members[0]}: must be a JSON object, got {wire.kind(activity)}")
    command = activity.get("command")
    if command is not None and (not isinstance(command, str) or len(command.encode()) > MAX_COMMAND):
        raise DevplaneAPIError(400, f"{members[0]}.command: must be a string of at most {MAX_COMMAND} bytes")
    ended_by = activity.get("terminated_by")
    if ended_by is not None and ended_by not in TERMINATED_BY:
        raise DevplaneAPIError(400, f"{members[0]}.terminated_by: must be one of {', '.join(TERMINATED_BY)}")
    listener = activity.get("listener_endpoint")
    if listener is not None:
        if not isinstance(listener, str) or not wire.is_host_port(listener):
            raise DevplaneAPIError(400, f"{members[0]}.listener_endpoint: must be HOST:PORT, got {listener!r}")
        session["listener_endpoint"] = listener
    return {"session_id": session_id, **body}
