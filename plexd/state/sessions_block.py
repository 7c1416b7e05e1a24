"""The desired `sessions` block (docs/protocol.md §A1.1): what access the control plane grants on this node.

The block is desired state, not a queue: a session is live while it is listed and before its `expires_at`; its
disappearance is the teardown signal. `[]` means no sessions (tear every one down); `null` or an absent key means
"not populated" and touches nothing (`parse_sessions` returns None). Each entry is validated on its own: a bad one
is left out and listed with its reason, the others stand (fail closed for that session only).

The older per-event shapes (`ssh_session_setup`, `session_revoked`) are deltas on the same tuple of sessions
(`with_setup`, `without`).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from plexd.base import gojson
from plexd.base.errors import WireFormatError
from plexd.base.hostname import is_hostname, is_ip
from plexd.state.fields import text

KINDS = ("ssh", "tcp", "k8s")
MAX_SESSIONS = 10  # per node, ssh and tcp and k8s together (the Go agent's tunnel.max_sessions)
MAX_PER_USER = 5  # per login user (ssh) or impersonated user (k8s): one account cannot take every slot
MAX_COMMAND_BYTES = 1024
MAX_COMMANDS = 64
MAX_GROUPS = 32
_SESSION_ID = re.compile(r"[\x21-\x7e]{1,128}")
# A login name as useradd accepts it: no '/', no '..', no NUL, nothing a path or a shell could misread.
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}\$?")


@dataclass(frozen=True)
class SshTarget:
    user: str
    allowed_commands: tuple[str, ...] = ()  # empty: a shell or any command

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"user": self.user}
        if self.allowed_commands:
            out["allowed_commands"] = list(self.allowed_commands)
        return out


@dataclass(frozen=True)
class TcpTarget:
    host: str
    port: int

    def to_wire(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}


@dataclass(frozen=True)
class K8sTarget:
    user: str
    impersonate_groups: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"user": self.user, "impersonate_groups": list(self.impersonate_groups)}


Target = SshTarget | TcpTarget | K8sTarget


@dataclass(frozen=True)
class Session:
    session_id: str
    kind: str
    target: Target
    expires_at: float  # unix seconds
    idle_timeout: float = 0.0  # seconds; 0: no idle window

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def to_wire(self) -> dict[str, Any]:
        """The block's shape (the mirror persists sessions in it, so an offline restart refuses revoked tokens)."""
        out: dict[str, Any] = {"session_id": self.session_id, "jti": self.session_id, "kind": self.kind,
                               "target": {self.kind: self.target.to_wire()},
                               "expires_at": gojson.format_unix(self.expires_at)}
        if self.idle_timeout:
            out["idle_timeout_seconds"] = int(self.idle_timeout)
        return out


@dataclass(frozen=True)
class Sessions:
    """The parsed block: the usable sessions by id, and the entries refused with their reason."""

    by_id: dict[str, Session]
    rejected: tuple[tuple[str, str], ...] = ()  # (session id or "[index]", reason)

    def without(self, session_id: str) -> Sessions:
        """`session_revoked`: the session leaves the block."""
        if session_id not in self.by_id:
            return self
        return replace(self, by_id={k: v for k, v in self.by_id.items() if k != session_id})

    def with_session(self, session: Session, now: float | None = None) -> Sessions:
        """`ssh_session_setup` (and any delta that adds one): refused past MAX_SESSIONS like the block's. Entries
        that expired since the last state pull are dropped here (never served; each would keep a firewall gate
        until the next pull)."""
        now = time.time() if now is None else now
        kept = {sid: s for sid, s in self.by_id.items() if not s.expired(now)}
        if session.session_id not in kept and len(kept) >= MAX_SESSIONS:
            return replace(self, by_id=kept, rejected=(*self.rejected, (session.session_id, _over_capacity())))
        if session.expired(now):
            return replace(self, by_id=kept)
        return replace(self, by_id={**kept, session.session_id: session})

    def to_wire(self) -> list[dict[str, Any]]:
        return [s.to_wire() for s in self.by_id.values()]


def _unexpired(sessions: Iterable[Session], now: float | None, user: str | None = None) -> int:
    """How many of `sessions` (of `user`, if given) still count against the limits: an entry past its
    `expires_at` is never served (the control plane may not have dropped it yet), so it holds no slot."""
    now = time.time() if now is None else now
    return sum(1 for s in sessions if not s.expired(now) and (user is None or getattr(s.target, "user", None) == user))


def _over_capacity() -> str:
    return f"more than {MAX_SESSIONS} sessions on this node"


def login_user(name: str, path: str) -> str:
    if "\0" in name or "/" in name or ".." in name or not _USER.fullmatch(name):
        raise WireFormatError(path, f"{name[:40]!r} is not a login name")
    return name


def _ssh_target(obj: Any, path: str) -> SshTarget:
    if not isinstance(obj, dict):
        raise WireFormatError(path, "must be an object")
    user = login_user(text(obj, "user", path, required=True, limit=32), f"{path}.user")
    commands = obj.get("allowed_commands")
    if commands is None:
        return SshTarget(user)
    # Fail closed: a list we cannot read must never widen into "any command".
    if not isinstance(commands, list) or not all(isinstance(c, str) and c for c in commands):
        raise WireFormatError(f"{path}.allowed_commands", "must be an array of non-empty strings")
    if len(commands) > MAX_COMMANDS:
        raise WireFormatError(f"{path}.allowed_commands", f"more than {MAX_COMMANDS} commands")
    for i, c in enumerate(commands):
        if len(c.encode()) > MAX_COMMAND_BYTES or "\0" in c:
            raise WireFormatError(f"{path}.allowed_commands[{i}]", f"longer than {MAX_COMMAND_BYTES} bytes or NUL")
    return SshTarget(user, tuple(commands))


def _tcp_target(obj: Any, path: str) -> TcpTarget:
    if not isinstance(obj, dict):
        raise WireFormatError(path, "must be an object")
    host = text(obj, "host", path, required=True, limit=253)
    if not is_ip(host) and not is_hostname(host):
        raise WireFormatError(f"{path}.host", f"{host[:60]!r} is not an IP address or host name")
    port = obj.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise WireFormatError(f"{path}.port", "must be 1-65535")
    return TcpTarget(host, port)


def impersonation_problem(what: str, value: str) -> str | None:
    """Why `value` cannot be sent as an `Impersonate-User`/`-Group` header exactly as it is, or None. `what` is
    "user" or "group". A CR or LF would add headers of the caller's choosing (`system:masters`); leading or
    trailing white space would be stripped by the API server, so another identity than the one granted; UTF-8
    beyond ASCII is fine (client-go sends names as UTF-8 too)."""
    shown = f"impersonation {what} {value[:80]!r}"
    if any(c < " " or "\x7f" <= c <= "\x9f" for c in value):
        return f"{shown} has a control character"
    if not value.isprintable():
        return f"{shown} has a character that is not printable"
    if value != value.strip():
        return f"{shown} starts or ends with white space"
    return None


def _k8s_target(obj: Any, path: str) -> K8sTarget:
    if not isinstance(obj, dict):
        raise WireFormatError(path, "must be an object")
    user = text(obj, "user", path, required=True, limit=256)
    groups = obj.get("impersonate_groups") or []
    if not isinstance(groups, list) or not all(isinstance(g, str) and g and len(g) <= 256 for g in groups):
        raise WireFormatError(f"{path}.impersonate_groups", "must be an array of non-empty strings")
    if len(groups) > MAX_GROUPS:
        raise WireFormatError(f"{path}.impersonate_groups", f"more than {MAX_GROUPS} groups")
    for field, what, value in [("user", "user", user), *(("impersonate_groups", "group", g) for g in groups)]:
        if problem := impersonation_problem(what, value):
            raise WireFormatError(f"{path}.{field}", problem)
    return K8sTarget(user, tuple(groups))


_TARGETS = {"ssh": _ssh_target, "tcp": _tcp_target, "k8s": _k8s_target}


def parse_session(obj: Any, path: str) -> Session:
    """One entry of the block. WireFormatError names the field."""
    if not isinstance(obj, dict):
        raise WireFormatError(path, "must be an object")
    sid = text(obj, "session_id", path, required=True, limit=128)
    if not _SESSION_ID.fullmatch(sid):
        raise WireFormatError(f"{path}.session_id", "is not 1-128 printable ASCII characters")
    jti = obj.get("jti")
    if jti is not None and jti != sid:
        raise WireFormatError(f"{path}.jti", "is not the session id")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise WireFormatError(f"{path}.kind", f"must be one of {', '.join(KINDS)}")
    target = obj.get("target")
    if not isinstance(target, dict) or set(target) != {kind}:
        raise WireFormatError(f"{path}.target", f"must hold exactly the {kind!r} member")
    try:
        expires = gojson.parse_time(text(obj, "expires_at", path, required=True, limit=64)).timestamp()
    except ValueError as exc:
        raise WireFormatError(f"{path}.expires_at", str(exc)) from None
    idle = obj.get("idle_timeout_seconds") or 0
    if isinstance(idle, bool) or not isinstance(idle, int) or not 0 <= idle <= 7 * 86400:
        raise WireFormatError(f"{path}.idle_timeout_seconds", "must be 0-604800")
    return Session(sid, kind, _TARGETS[kind](target[kind], f"{path}.target.{kind}"), expires, float(idle))


def parse_sessions(raw: Any, path: str = "sessions", now: float | None = None) -> Sessions | None:
    """The block, or None when it is null/absent ("not populated": touch nothing). A block that is not an array
    raises WireFormatError; a bad entry, a duplicate id or one past MAX_SESSIONS is refused alone."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise WireFormatError(path, "must be an array or null")
    by_id: dict[str, Session] = {}
    rejected: list[tuple[str, str]] = []
    now = time.time() if now is None else now
    for i, entry in enumerate(raw):
        label = entry.get("session_id") if isinstance(entry, dict) else None
        label = label if isinstance(label, str) and _SESSION_ID.fullmatch(label) else f"{path}[{i}]"
        try:
            session = parse_session(entry, f"{path}[{i}]")
        except WireFormatError as exc:
            rejected.append((label, str(exc)))
            continue
        if session.session_id in by_id:
            rejected.append((label, "duplicate session id"))
            continue
        if session.expired(now):
            if len(by_id) - _unexpired(by_id.values(), now) >= MAX_SESSIONS:  # bounded too (each has a gate)
                rejected.append((label, "expired, and more than enough expired entries are listed already"))
                continue
        else:
            if _unexpired(by_id.values(), now) >= MAX_SESSIONS:
                rejected.append((label, _over_capacity()))
                continue
            user = getattr(session.target, "user", None)
            if user is not None and _unexpired(by_id.values(), now, user) >= MAX_PER_USER:
                rejected.append((label, f"more than {MAX_PER_USER} sessions for user {user}"))
                continue
        by_id[session.session_id] = session
    return Sessions(by_id, tuple(rejected))


def setup_event_session(payload: Any, path: str = "payload") -> Session:
    """The older `ssh_session_setup` event: a TCP forward from a listener on the mesh IP to `target_host:
    target_port` (an sshd there does the authentication: `authorized_key` is for it, not for us)."""
    if not isinstance(payload, dict):
        raise WireFormatError(path, "must be an object")
    entry = {"session_id": payload.get("session_id"), "kind": "tcp", "expires_at": payload.get("expires_at"),
             "target": {"tcp": {"host": payload.get("target_host"), "port": payload.get("target_port", 22)}}}
    return parse_session(entry, path)


def revoked_session_id(payload: Any, path: str = "payload") -> str:
    """The older `session_revoked` event's session id."""
    if not isinstance(payload, dict):
        raise WireFormatError(path, "must be an object")
    return text(payload, "session_id", path, required=True, limit=128)


# The socket mark of a session's listener, which the firewall's session rules match (the port is the kernel's
# choice, known only once bound). The high half says "plexd session"; it is not a routing mark plexd uses, and
# replies carry it, so a policy-routing rule on this exact mark would steer them (none is set by plexd).
MARK_BASE = 0x706C0000
SERVICE_PORTS = {"ssh": 22, "k8s": 6443}  # the service a session stands for, for the policy's say on who may


def service_port(session: Session) -> int:
    """The port whose policy rules decide who may reach `session`'s listener: 22 for SSH, 6443 for Kubernetes,
    the target's own port for TCP."""
    return session.target.port if isinstance(session.target, TcpTarget) else SERVICE_PORTS[session.kind]


def socket_marks(session_ids: Iterable[str]) -> dict[str, int]:
    """One distinct mark per session, from the ids alone (the firewall and the sessions domain agree without
    talking): a hash of the id in the low 16 bits, the next free value on a collision, in id order."""
    marks: dict[str, int] = {}
    taken: set[int] = set()
    for sid in sorted(session_ids):
        low = int.from_bytes(hashlib.sha256(sid.encode()).digest()[:2], "big")
        while MARK_BASE | low in taken:
            low = (low + 1) & 0xFFFF
        marks[sid] = MARK_BASE | low
        taken.add(marks[sid])
    return marks


def live(sessions: Sessions | None, now: float) -> Iterable[Session]:
    """The sessions that admit connections now: listed and not past `expires_at`."""
    if sessions is None:
        return ()
    return (s for s in sessions.by_id.values() if not s.expired(now))
