"""Wire types of the control-plane protocol (docs/protocol.md §1, §4), parsed with precise errors.

Parsing follows Go's lenient decoding where the protocol relies on it (unknown keys ignored, key match
case-insensitive, ``null`` for a list means empty) but refuses a value of the wrong type, naming the field.
Semantic checks (is this a valid WireGuard key? a valid CIDR?) are not done here: the desired-state builder
checks each peer on its own so one bad peer never blocks the rest.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any

from plexd.base.errors import WireFormatError
from plexd.base.gojson import GO_ZERO_TIME
from plexd.base.hostname import is_ip
from plexd.state.action_request import ActionRequest
from plexd.state.bridge_blocks import (
    Ingress,
    SiteToSite,
    UserAccess,
    has_block,
    parse_ingress,
    parse_site_to_site,
    parse_user_access,
)
from plexd.state.fields import join, kind, text
from plexd.state.fields import object_fields as _fields  # where the model's readers import it from
from plexd.state.relay_block import RelaySessionSet
from plexd.state.sessions_block import Sessions, parse_sessions

KEY_LEN = 32  # WireGuard keys (Curve25519) and the control plane's Ed25519 keys


def is_valid_key(key: str) -> bool:
    """True when `key` is standard base64 of exactly 32 bytes."""
    try:
        return len(base64.b64decode(key, validate=True)) == KEY_LEN
    except (binascii.Error, ValueError):
        return False

JSON = Any


def _int(f: dict[str, JSON], key: str, path: str, default: int = 0) -> int:
    value = f.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or (isinstance(value, float) and not math.isfinite(value)) or int(value) != value):
        raise WireFormatError(join(path, key), f"must be an integer, got {kind(value)} {str(value)[:40]}")
    if not -(2**63) <= value < 2**63:  # Go's int64
        raise WireFormatError(join(path, key), f"{str(value)[:40]} is out of range")
    return int(value)


def _list(f: dict[str, JSON], key: str, path: str) -> list[JSON]:
    value = f.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise WireFormatError(join(path, key), f"must be an array, got {kind(value)}")
    return value


def _str_map(f: dict[str, JSON], key: str, path: str) -> dict[str, str] | None:
    value = f.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise WireFormatError(join(path, key), f"must be an object, got {kind(value)}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise WireFormatError(f"{join(path, key)}.{k}", f"must be a string, got {kind(v)}")
    return dict(value)


@dataclass(frozen=True)
class Peer:
    id: str
    public_key: str
    mesh_ip: str
    endpoint: str = ""
    allowed_ips: tuple[str, ...] = ()
    psk: str = field(default="", repr=False)  # a secret: never in a repr
    fallback_endpoint: str = ""  # a bridge's relay, for when the direct path shows no handshake (§A2.4)

    @classmethod
    def from_wire(cls, obj: JSON, path: str = "peer") -> Peer:
        f = _fields(obj, path)
        ips = _list(f, "allowed_ips", path)
        for i, ip in enumerate(ips):
            if not isinstance(ip, str):
                raise WireFormatError(f"{path}.allowed_ips[{i}]", f"must be a string, got {kind(ip)}")
        return cls(
            id=text(f, "id", path),
            public_key=text(f, "public_key", path),
            mesh_ip=text(f, "mesh_ip", path),
            endpoint=text(f, "endpoint", path),
            allowed_ips=tuple(ips),
            psk=text(f, "psk", path),
            fallback_endpoint=text(f, "fallback_endpoint", path),
        )

    def to_wire(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {
            "id": self.id,
            "public_key": self.public_key,
            "mesh_ip": self.mesh_ip,
            "endpoint": self.endpoint,
            "allowed_ips": list(self.allowed_ips),
            "psk": self.psk,
        }
        if self.fallback_endpoint:
            out["fallback_endpoint"] = self.fallback_endpoint
        return out


@dataclass(frozen=True)
class PolicyRule:
    """One rule as sent. A rule of the wrong shape is kept with `problem` set (and its JSON in `raw`) instead of
    failing the whole state document: the policy engine skips it, naming the policy and the rule (§9)."""

    src: str
    dst: str
    port: int = 0
    protocol: str = ""
    action: str = "allow"
    problem: str = ""
    raw: JSON = field(default=None, compare=False, repr=False)

    @classmethod
    def from_wire(cls, obj: JSON, path: str) -> PolicyRule:
        if type(obj) is dict and len(obj) == 5:  # the usual rule, every field present and well typed, in one go
            src, dst, port = obj.get("src"), obj.get("dst"), obj.get("port")
            protocol, action = obj.get("protocol"), obj.get("action")
            if (type(src) is str and type(dst) is str and type(port) is int and type(protocol) is str
                    and type(action) is str and 0 <= port < 2**63):
                return cls(src, dst, port, protocol, action)
        try:
            f = _fields(obj, path)
            return cls(
                src=text(f, "src", path),
                dst=text(f, "dst", path),
                port=_int(f, "port", path),
                protocol=text(f, "protocol", path),
                action=text(f, "action", path),
            )
        except WireFormatError as e:
            return cls(src="", dst="", problem=str(e), raw=obj)

    def to_wire(self) -> JSON:
        if self.problem:
            return self.raw
        return {"src": self.src, "dst": self.dst, "port": self.port, "protocol": self.protocol,
                "action": self.action}


@dataclass(frozen=True)
class Policy:
    id: str
    rules: tuple[PolicyRule, ...] = ()
    problem: str = ""  # the policy itself is of the wrong shape (skipped whole, with this reason)
    raw: JSON = field(default=None, compare=False, repr=False)

    @classmethod
    def from_wire(cls, obj: JSON, path: str) -> Policy:
        try:
            f = _fields(obj, path)
            pid = text(f, "id", path)
            rules = tuple(
                PolicyRule.from_wire(r, f"{path}.rules[{i}]") for i, r in enumerate(_list(f, "rules", path))
            )
        except WireFormatError as e:
            ident = obj.get("id") if isinstance(obj, dict) else None
            return cls(id=ident if isinstance(ident, str) else "", problem=str(e), raw=obj)
        return cls(id=pid, rules=rules)

    def to_wire(self) -> JSON:
        if self.problem:
            return self.raw
        return {"id": self.id, "rules": [r.to_wire() for r in self.rules]}


@dataclass(frozen=True)
class SigningKeys:
    current: str
    previous: str = ""
    transition_expires: str = ""  # RFC 3339, "" when absent

    @classmethod
    def from_wire(cls, obj: JSON, path: str = "signing_keys") -> SigningKeys:
        f = _fields(obj, path)
        return cls(
            current=text(f, "current", path),
            previous=text(f, "previous", path),
            transition_expires=text(f, "transition_expires", path),
        )

    def to_wire(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {"current": self.current}
        if self.previous:
            out["previous"] = self.previous
        if self.transition_expires:
            out["transition_expires"] = self.transition_expires
        return out


@dataclass(frozen=True)
class DataEntry:
    key: str
    content_type: str
    payload: JSON
    version: int
    updated_at: str

    @classmethod
    def from_wire(cls, obj: JSON, path: str) -> DataEntry:
        f = _fields(obj, path)
        return cls(
            key=text(f, "key", path),
            content_type=text(f, "content_type", path),
            payload=f.get("payload"),
            version=_int(f, "version", path),
            updated_at=text(f, "updated_at", path, GO_ZERO_TIME),
        )

    def to_wire(self) -> dict[str, JSON]:
        return {"key": self.key, "content_type": self.content_type, "payload": self.payload,
                "version": self.version, "updated_at": self.updated_at}


@dataclass(frozen=True)
class SecretRef:
    key: str
    version: int

    @classmethod
    def from_wire(cls, obj: JSON, path: str) -> SecretRef:
        f = _fields(obj, path)
        return cls(key=text(f, "key", path), version=_int(f, "version", path))

    def to_wire(self) -> dict[str, JSON]:
        return {"key": self.key, "version": self.version}


@dataclass(frozen=True)
class State:
    """``GET /v1/nodes/{id}/state`` (§4.1). Bridge/relay/access/ingress/site-to-site configs are kept raw."""

    peers: tuple[Peer, ...] = ()
    policies: tuple[Policy, ...] = ()
    signing_keys: SigningKeys | None = None
    metadata: dict[str, str] | None = None
    data: tuple[DataEntry, ...] = ()
    secret_refs: tuple[SecretRef, ...] = ()
    sessions: Sessions | None = None  # None: the block was null or absent ("not populated": touch nothing)
    relay: RelaySessionSet | None = None  # a bridge's relay sessions; None: no relay block in this state
    user_access: UserAccess | None = None  # a bridge's access interface; None: no block in this state
    site_to_site: SiteToSite | None = None  # a bridge's tunnels; None: no block in this state
    ingress: Ingress | None = None  # a bridge's ingress rules; None: no block in this state
    # Whether the policies decide which peers go on the device (§9.2). The platform contract's snapshot lists
    # exactly the peers a node may see: its translation says so, and the policies then only filter traffic.
    peers_by_policy: bool = True
    # Actions the state asks for (the platform contract's executions block; the spec's come as events): offered to
    # the action dispatcher on every pull, never part of the desired model.
    action_requests: tuple[ActionRequest, ...] = ()
    extra: dict[str, JSON] = field(default_factory=dict)

    _EXTRA_KEYS = ("bridge", "bridge_config", "relay_config", "user_access_config", "ingress_config",
                   "site_to_site_config")

    @classmethod
    def from_wire(cls, obj: JSON, path: str = "") -> State:
        f = _fields(obj, path or "state")
        keys = f.get("signing_keys")
        return cls(
            peers=tuple(Peer.from_wire(p, join(path, f"peers[{i}]")) for i, p in enumerate(_list(f, "peers", path))),
            policies=tuple(
                Policy.from_wire(p, join(path, f"policies[{i}]")) for i, p in enumerate(_list(f, "policies", path))
            ),
            signing_keys=None if keys is None else SigningKeys.from_wire(keys, join(path, "signing_keys")),
            metadata=_str_map(f, "metadata", path),
            data=tuple(DataEntry.from_wire(d, join(path, f"data[{i}]")) for i, d in enumerate(_list(f, "data", path))),
            secret_refs=tuple(
                SecretRef.from_wire(s, join(path, f"secret_refs[{i}]"))
                for i, s in enumerate(_list(f, "secret_refs", path))
            ),
            sessions=parse_sessions(f.get("sessions"), join(path, "sessions")),
            # A bridge or relay_config block, even null, says what is desired (null: no relay sessions); a state
            # without either (a node, an older control plane) changes nothing.
            relay=RelaySessionSet.from_state(f) if "bridge" in f or "relay_config" in f else None,
            user_access=parse_user_access(f) if has_block(f, "user_access_config") else None,
            site_to_site=parse_site_to_site(f) if has_block(f, "site_to_site_config") else None,
            ingress=parse_ingress(f) if has_block(f, "ingress_config") else None,
            peers_by_policy=f.get(PEER_VISIBILITY) != "all",
            extra={k: f[k] for k in cls._EXTRA_KEYS if k in f},  # a null block too: it says "none desired"
        )

    def to_wire(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {
            "peers": [p.to_wire() for p in self.peers],
            "policies": [p.to_wire() for p in self.policies],
            "data": [d.to_wire() for d in self.data],
            "secret_refs": [s.to_wire() for s in self.secret_refs],
        }
        if self.signing_keys is not None:
            out["signing_keys"] = self.signing_keys.to_wire()
        if self.metadata is not None:
            out["metadata"] = self.metadata
        if self.sessions is not None:
            out["sessions"] = self.sessions.to_wire()
        if not self.peers_by_policy:
            out[PEER_VISIBILITY] = "all"
        out.update(self.extra)
        return out


# Set by the wire layer's platform translation and kept in the mirror; a name no control plane sends.
PEER_VISIBILITY = "plexd:peer_visibility"



@dataclass(frozen=True)
class RegisterResponse:
    node_id: str
    mesh_ip: str
    signing_public_key: str
    node_secret_key: str = field(repr=False)  # a secret: never in a repr
    peers: tuple[Peer, ...] = ()
    # Not in the Go control plane's answer: "hkdf-sha256" when the control plane took the derivation the node
    # offered (plexd.identity.node_secret); checked by the registrar before anything is saved.
    node_secret_kdf: str = ""
    # The platform contract's answer also names the signing key and the mesh's whole range.
    signing_key_id: str = ""
    domain_mesh_cidr: str = ""

    @classmethod
    def from_wire(cls, obj: JSON) -> RegisterResponse:
        f = _fields(obj, "register response")
        resp = cls(
            node_id=text(f, "node_id", ""),
            mesh_ip=text(f, "mesh_ip", ""),
            signing_public_key=text(f, "signing_public_key", ""),
            node_secret_key=text(f, "node_secret_key", ""),
            peers=tuple(Peer.from_wire(p, f"peers[{i}]") for i, p in enumerate(_list(f, "peers", ""))),
            node_secret_kdf=text(f, "node_secret_kdf", ""),
        )
        for name in ("node_id", "mesh_ip", "signing_public_key", "node_secret_key"):
            if not getattr(resp, name):
                raise WireFormatError(name, "missing from the register response")
        if not is_ip(resp.mesh_ip):  # assigned as <mesh_ip>/32: anything else failed every converge afterwards
            raise WireFormatError("mesh_ip", f"{resp.mesh_ip[:60]!r} is not an IP address")
        secret = resp.node_secret_key
        if not (secret.isascii() and secret.isprintable()) or secret != secret.strip():
            # It becomes a bearer header on every request: one that cannot be sent is refused before it is saved
            # (and the reason never quotes it).
            raise WireFormatError("node_secret_key",
                                  "has characters a bearer cannot carry (not printable ASCII, or blanks around it)")
        return resp
