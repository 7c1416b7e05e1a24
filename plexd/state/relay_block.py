"""Relay sessions the control plane assigns: one desired set from the state block or the older events.

Shapes (docs/protocol.md §A2): `bridge.relay.sessions` (newer contract), `relay_config.sessions`
(older state) and the `relay_session_assigned` / `relay_session_revoked` event payloads. All become
`RelaySession`s in one `RelaySessionSet`, capped at 100; the 101st and duplicate ids are refused and reported,
the others untouched.

A session may also name its sides' WireGuard public keys (`peer_a_public_key`, `peer_b_public_key`, optional,
plexd's own addition): the relay checks every handshake's mac1 with them (`plexd/bridge/flows.py`). A bridge
takes a side's key from the state's peers first; these serve ends that are not its peers (and the standalone
relay, which has no peers).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from plexd.base.errors import WireFormatError
from plexd.base.gojson import parse_time
from plexd.state.fields import text

MAX_SESSIONS = 100
MAX_TTL_SECONDS = 300.0
MAX_ID_LENGTH = 128

Address = tuple[str, int]


@dataclass(frozen=True)
class RelaySession:
    session_id: str
    peer_a_id: str
    peer_a_endpoint: Address
    peer_b_id: str
    peer_b_endpoint: Address
    expires_at: datetime
    peer_a_public_key: str = ""  # base64, "" when the session names none
    peer_b_public_key: str = ""

    def ttl(self, now: datetime) -> float:
        """Seconds this assignment stays valid while the control plane is reachable: min(5 min, expires_at - now)."""
        return max(0.0, min(MAX_TTL_SECONDS, (self.expires_at - now).total_seconds()))


@dataclass(frozen=True)
class Refusal:
    """A session that was not taken, and why (reported upstream, logged once)."""

    session_id: str
    reason: str


def parse_endpoint(text: object, path: str) -> Address:
    if not isinstance(text, str) or not text:
        raise WireFormatError(path, "must be a non-empty 'ip:port' string")
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise WireFormatError(path, f"{text!r} has no port ('ip:port' or '[ipv6]:port')")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise WireFormatError(path, f"{host!r} is not an IP address") from None
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise WireFormatError(path, f"port {port_text!r} is not 1-65535")
    if ip.is_unspecified or ip.is_multicast:
        raise WireFormatError(path, f"{ip} cannot be a peer's address")
    return (str(ip), int(port_text))


def text_field(doc: Mapping[str, object], key: str, path: str, *, required: bool = True) -> str:
    """An id or a name from the bridge's blocks: printable ASCII, bounded; "" for an absent optional one."""
    return text(doc, key, path, required=required, limit=MAX_ID_LENGTH, printable_ascii=True)


def public_key_field(doc: Mapping[str, object], key: str, path: str) -> str:
    """An optional WireGuard public key: standard base64 of 32 bytes, or "" when absent."""
    value = doc.get(key)
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        try:
            if len(base64.b64decode(value, validate=True)) == 32:
                return value
        except (binascii.Error, ValueError):
            pass
    raise WireFormatError(f"{path}.{key}", "is not a WireGuard public key (standard base64 of 32 bytes)")


def parse_session(doc: object, path: str = "session") -> RelaySession:
    """One `RelaySessionAssignment` (state entry or `relay_session_assigned` payload); errors name the field."""
    if not isinstance(doc, Mapping):
        raise WireFormatError(path, "must be an object")
    session_id = text_field(doc, "session_id", path)
    peer_a_id = text_field(doc, "peer_a_id", path)
    peer_b_id = text_field(doc, "peer_b_id", path)
    if peer_a_id == peer_b_id:
        raise WireFormatError(f"{path}.peer_b_id", f"is the same node as peer_a_id ({peer_a_id!r})")
    a = parse_endpoint(doc.get("peer_a_endpoint"), f"{path}.peer_a_endpoint")
    b = parse_endpoint(doc.get("peer_b_endpoint"), f"{path}.peer_b_endpoint")
    if a == b:
        raise WireFormatError(f"{path}.peer_b_endpoint", "is the same address as peer_a_endpoint")
    expires = doc.get("expires_at")
    if not isinstance(expires, str):
        raise WireFormatError(f"{path}.expires_at", "must be an RFC 3339 time string")
    try:
        expires_at = parse_time(expires)
    except (ValueError, WireFormatError) as e:
        raise WireFormatError(f"{path}.expires_at", str(e)) from None
    return RelaySession(session_id, peer_a_id, a, peer_b_id, b, expires_at,
                        public_key_field(doc, "peer_a_public_key", path),
                        public_key_field(doc, "peer_b_public_key", path))


def parse_revoked(doc: object, path: str = "relay_session_revoked") -> str:
    if not isinstance(doc, Mapping):
        raise WireFormatError(path, "must be an object")
    return text_field(doc, "session_id", path)


def relay_block(state: Mapping[str, object]) -> object | None:
    """The sessions list of a state document: `bridge.relay.sessions` (newer) or `relay_config.sessions`."""
    bridge = state.get("bridge")
    if isinstance(bridge, Mapping):
        relay = bridge.get("relay")
        return relay.get("sessions") if isinstance(relay, Mapping) else None
    legacy = state.get("relay_config")
    return legacy.get("sessions") if isinstance(legacy, Mapping) else None


@dataclass
class RelaySessionSet:
    """The desired sessions by id, in arrival order; what was refused stays listed until the next full state."""

    sessions: dict[str, RelaySession] = field(default_factory=dict)
    refused: list[Refusal] = field(default_factory=list)

    @classmethod
    def from_state(cls, state: Mapping[str, object]) -> RelaySessionSet:
        """A full state replaces the set. A malformed entry is refused by its index; the rest applies."""
        result = cls()
        entries = relay_block(state)
        if entries is None:
            return result
        if not isinstance(entries, list):
            result.refused.append(Refusal("", "relay sessions: must be a list"))
            return result
        for i, doc in enumerate(entries):
            try:
                session = parse_session(doc, f"relay.sessions[{i}]")
            except WireFormatError as e:
                sid = doc.get("session_id") if isinstance(doc, Mapping) else None
                result.refused.append(Refusal(sid if isinstance(sid, str) else "", str(e)))
                continue
            result.add(session)
        return result

    def add(self, session: RelaySession) -> Refusal | None:
        """Take one session; None when taken, else the refusal (also kept in `refused`)."""
        refusal = None
        if session.session_id in self.sessions:
            refusal = Refusal(session.session_id, f"relay session {session.session_id!r}: duplicate session_id")
        elif len(self.sessions) >= MAX_SESSIONS:
            refusal = Refusal(session.session_id,
                              f"relay session {session.session_id!r}: limit of {MAX_SESSIONS} sessions reached")
        if refusal is not None:
            self.refused.append(refusal)
            return refusal
        self.sessions[session.session_id] = session
        return None

    def assigned(self, payload: object) -> Refusal | None:
        """A `relay_session_assigned` event: a newer assignment of a known id replaces it (events set values)."""
        session = parse_session(payload, "relay_session_assigned")
        if session.session_id in self.sessions:
            self.sessions[session.session_id] = session
            return None
        return self.add(session)

    def revoked(self, payload: object) -> bool:
        return self.sessions.pop(parse_revoked(payload), None) is not None

    def __iter__(self) -> Iterable[RelaySession]:  # type: ignore[override]
        return iter(list(self.sessions.values()))

    def __len__(self) -> int:
        return len(self.sessions)
