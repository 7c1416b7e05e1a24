"""The desired model: one immutable value holding everything plexd should make true on this machine.

Events and state pulls produce new `DesiredState` values (`with_*` methods, never mutation); the converge engine
diffs one against the live machine. Peers are validated one by one as they enter: an invalid peer is kept out of
`peers` and listed in `rejected` with the reason, so one bad peer never blocks the rest.

The JSON mirror (`to_json`/`from_json`, written to data_dir/state for an offline start) never contains the
private key; the caller passes it back in from the identity when loading.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from plexd import identity
from plexd.mesh.wireguard import is_valid_key
from plexd.model import DataEntry, Peer, Policy, SecretRef, SigningKeys, State

DEFAULT_KEEPALIVE = 25  # seconds; keeps NAT mappings open and makes a new tunnel handshake without traffic

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?$")
# An IPv6 scope is an interface name or index. Python accepts any text after '%' (even a newline, which would
# inject lines into the UAPI request), so only what an interface name can hold is let through.
_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,15}")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → (host, port). Raises ValueError naming what is wrong."""
    if endpoint.startswith("["):
        host, sep, port_s = endpoint[1:].partition("]:")
        if not sep:
            raise ValueError(f"endpoint {endpoint!r} is not [ipv6]:port")
        try:
            scope = host.partition("%")[2]
            if ipaddress.ip_address(host).version != 6 or ("%" in host and not _SCOPE.fullmatch(scope)):
                raise ValueError
        except ValueError:
            raise ValueError(f"endpoint {endpoint!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_s = endpoint.rpartition(":")
        if not sep or not host:
            raise ValueError(f"endpoint {endpoint!r} is not host:port")
        if ":" in host:
            raise ValueError(f"endpoint {endpoint!r}: an IPv6 endpoint must be written [address]:port")
        if not _is_ipv4(host) and not _HOSTNAME.fullmatch(host):
            raise ValueError(f"endpoint {endpoint!r}: {host!r} is not an IPv4 address or host name")
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"endpoint {endpoint!r}: port {port_s!r} is not 1-65535")
    return host, int(port_s)


def _is_ipv4(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False


def public_key_of(private_key: str) -> str:
    """The base64 public key of a base64 private key (the identity's derivation, in base64 at both ends)."""
    return identity.b64(identity.public_key_of(base64.b64decode(private_key)))


def validate_peer(peer: Peer, own_public_key: str = "") -> str | None:
    """The reason `peer` cannot be configured, or None when it is valid."""
    if not peer.id:
        return "peer has no id"
    if not is_valid_key(peer.public_key):
        return f"public key {peer.public_key[:60]!r} is not base64 of 32 bytes"
    if own_public_key and peer.public_key == own_public_key:
        return "public key is this node's own key"
    if peer.psk and not is_valid_key(peer.psk):
        return "preshared key is not base64 of 32 bytes"
    if peer.mesh_ip:
        try:
            ipaddress.ip_address(peer.mesh_ip)
            if "%" in peer.mesh_ip:  # a scoped address: no use as a mesh IP, and the scope is free text
                raise ValueError
        except ValueError:
            return f"mesh IP {peer.mesh_ip[:60]!r} is not an IP address"
    for ip in peer.allowed_ips:
        try:
            ipaddress.ip_network(ip, strict=False)
            if "%" in ip:  # Python takes a scoped prefix (any text after '%'); WireGuard does not
                raise ValueError
        except ValueError:
            return f"allowed IP {ip[:60]!r} is not a CIDR"
    if not peer.allowed_ips and not peer.mesh_ip:
        return "peer has neither allowed IPs nor a mesh IP"
    if peer.endpoint:
        try:
            split_endpoint(peer.endpoint)
        except ValueError as e:
            return str(e)
    return None


@dataclass(frozen=True)
class DesiredState:
    interface: str
    listen_port: int
    mtu: int
    private_key: str = field(repr=False)  # b64; never logged, never mirrored to disk
    mesh_ip: str
    mesh_ip6: str | None = None
    peers: Mapping[str, Peer] = field(default_factory=dict)
    rejected: tuple[tuple[str, str], ...] = ()
    policies: tuple[Policy, ...] = ()
    signing_keys: SigningKeys | None = None
    metadata: dict[str, str] | None = None
    data: tuple[DataEntry, ...] = ()
    secret_refs: tuple[SecretRef, ...] = ()
    persistent_keepalive: int = DEFAULT_KEEPALIVE

    @classmethod
    def initial(cls, *, interface: str, listen_port: int, mtu: int, private_key: str, mesh_ip: str,
                mesh_ip6: str | None = None, persistent_keepalive: int = DEFAULT_KEEPALIVE) -> DesiredState:
        return cls(interface=interface, listen_port=listen_port, mtu=mtu, private_key=private_key,
                   mesh_ip=mesh_ip, mesh_ip6=mesh_ip6, persistent_keepalive=persistent_keepalive)

    @cached_property
    def public_key(self) -> str:
        try:
            return public_key_of(self.private_key) if self.private_key else ""
        except Exception:  # a broken key is reported by the converge, not here
            return ""

    def peer_by_key(self, public_key: str) -> Peer | None:
        for p in self.peers.values():
            if p.public_key == public_key:
                return p
        return None

    # -- building -------------------------------------------------------------------------------------------

    def _with_peers(self, candidates: Iterable[Peer], base: Mapping[str, Peer],
                    base_rejected: Iterable[tuple[str, str]]) -> DesiredState:
        peers = dict(base)
        rejected = dict(base_rejected)
        owner_of = {p.public_key: pid for pid, p in peers.items()}
        for peer in candidates:
            reason = validate_peer(peer, self.public_key)
            owner = owner_of.get(peer.public_key)
            if reason is None and owner is not None and owner != peer.id:
                reason = f"public key is already used by peer {owner}"
            old = peers.pop(peer.id, None)
            if old is not None and owner_of.get(old.public_key) == peer.id:
                del owner_of[old.public_key]
            if reason is None:
                peers[peer.id] = peer
                owner_of[peer.public_key] = peer.id
                rejected.pop(peer.id, None)
            else:
                rejected[peer.id or "(no id)"] = reason
        return replace(self, peers=peers, rejected=tuple(sorted(rejected.items())))

    def with_state(self, state: State) -> DesiredState:
        """Full replace from `GET /state`: peers, policies, signing keys and node state."""
        new = replace(self, policies=tuple(state.policies), signing_keys=state.signing_keys,
                      metadata=None if state.metadata is None else dict(state.metadata), data=tuple(state.data),
                      secret_refs=tuple(state.secret_refs))
        return new._with_peers(state.peers, {}, ())

    def with_peers(self, peers: Iterable[Peer]) -> DesiredState:
        """Replace only the peer set (e.g. from the register response)."""
        return self._with_peers(peers, {}, ())

    def with_peer(self, peer: Peer) -> DesiredState:
        return self._with_peers([peer], self.peers, self.rejected)

    def without_peer(self, peer_id: str) -> DesiredState:
        peers = {k: v for k, v in self.peers.items() if k != peer_id}
        return replace(self, peers=peers, rejected=tuple(r for r in self.rejected if r[0] != peer_id))

    def with_peer_endpoint(self, peer_id: str, endpoint: str) -> DesiredState:
        peer = self.peers.get(peer_id)
        if peer is None:
            return self
        return self.with_peer(replace(peer, endpoint=endpoint))

    def with_signing_keys(self, keys: SigningKeys) -> DesiredState:
        return replace(self, signing_keys=keys)

    def with_policies(self, policies: Iterable[Policy]) -> DesiredState:
        return replace(self, policies=tuple(policies))

    def with_node_state(self, metadata: dict[str, str] | None, data: Iterable[DataEntry]) -> DesiredState:
        return replace(self, metadata=None if metadata is None else dict(metadata), data=tuple(data))

    def with_secret_refs(self, refs: Iterable[SecretRef]) -> DesiredState:
        return replace(self, secret_refs=tuple(refs))

    # -- mirror -----------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Everything but the private key, for data_dir/state. Rejected peers are not kept (re-validated on load)."""
        return {
            "interface": self.interface,
            "listen_port": self.listen_port,
            "mtu": self.mtu,
            "mesh_ip": self.mesh_ip,
            "mesh_ip6": self.mesh_ip6,
            "persistent_keepalive": self.persistent_keepalive,
            "state": State(peers=tuple(self.peers.values()), policies=self.policies, signing_keys=self.signing_keys,
                           metadata=self.metadata, data=self.data, secret_refs=self.secret_refs).to_wire(),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, private_key: str = "") -> DesiredState:
        """Load a mirror. The private key is not in it: pass it from the identity."""
        base = cls.initial(interface=d["interface"], listen_port=int(d["listen_port"]), mtu=int(d["mtu"]),
                           private_key=private_key, mesh_ip=d["mesh_ip"], mesh_ip6=d.get("mesh_ip6"),
                           persistent_keepalive=int(d.get("persistent_keepalive", DEFAULT_KEEPALIVE)))
        return base.with_state(State.from_wire(d.get("state") or {}))
