"""The desired model: one immutable value holding everything plexd should make true on this machine.

Events and state pulls produce new `DesiredState` values (`with_*` methods, never mutation); the converge engine
diffs one against the live machine. Peers are validated one by one as they enter: an invalid peer is kept out of
`peers` and listed in `rejected` with the reason, so one bad peer never blocks the rest.

The JSON mirror (`to_json`/`from_json`, written to data_dir/state for an offline start) never contains the
private key; the caller passes it back in from the identity when loading.
"""

from __future__ import annotations

import base64
import binascii
import functools
import ipaddress
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from plexd.base import wgkeys
from plexd.base.hostname import is_hostname, is_ip
from plexd.base.mesh_caches import bounded_by_mesh
from plexd.state import policy, route_limits
from plexd.state.bridge_blocks import Ingress, SiteToSite, UserAccess
from plexd.state.model import DataEntry, Peer, Policy, SecretRef, SigningKeys, State, is_valid_key
from plexd.state.relay_block import RelaySessionSet
from plexd.state.route_limits import RouteLimits
from plexd.state.sessions_block import Session, Sessions

DEFAULT_KEEPALIVE = 25  # seconds; keeps NAT mappings open and makes a new tunnel handshake without traffic

# An IPv6 scope is an interface name or index. Python accepts any text after '%' (even a newline, which would
# inject lines into the UAPI request), so only what an interface name can hold is let through.
_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_PEER_ID = re.compile(r"[\x21-\x7e]{1,128}")
MAX_ALLOWED_IPS = 1024


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
        if not is_ip(host, 4) and not is_hostname(host, trailing_dot=True):
            raise ValueError(f"endpoint {endpoint!r}: {host!r} is not an IPv4 address or host name")
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"endpoint {endpoint!r}: port {port_s!r} is not 1-65535")
    return host, int(port_s)


@functools.lru_cache(maxsize=4)  # a new DesiredState per event: the same key must not cost a scalar mult each time
def public_key_of(private_key: str) -> str:
    """The base64 public key of a base64 private key (the identity's derivation, in base64 at both ends)."""
    return wgkeys.b64(wgkeys.public_key_of(base64.b64decode(private_key)))


def canonical_key(key: str) -> str:
    """The one base64 spelling of a 32-byte key. Base64 has spare bits in its last character, so the same key
    can arrive written several ways; WireGuard reports it one way, and comparing spellings would correct the
    same peer forever. A string that is not a key is returned unchanged (validation names it)."""
    try:
        raw = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        return key
    return base64.b64encode(raw).decode() if len(raw) == 32 else key


def validate_peer(peer: Peer, own_public_key: str = "") -> str | None:
    """The reason `peer` cannot be configured, or None when it is valid."""
    if not peer.id:
        return "peer has no id"
    if not _PEER_ID.fullmatch(peer.id):
        return f"peer id {peer.id[:40]!r} is not 1-128 printable ASCII characters"
    if len(peer.allowed_ips) > MAX_ALLOWED_IPS:
        return f"{len(peer.allowed_ips)} allowed IPs (at most {MAX_ALLOWED_IPS})"
    if not is_valid_key(peer.public_key):
        return f"public key {peer.public_key[:60]!r} is not base64 of 32 bytes"
    if own_public_key and peer.public_key == own_public_key:
        return "public key is this node's own key"
    if peer.psk and not is_valid_key(peer.psk):
        return "preshared key is not base64 of 32 bytes"
    # A scoped address ('%' and free text after it, which Python accepts) is no use as a mesh IP or a route.
    if peer.mesh_ip and ("%" in peer.mesh_ip or route_limits.address(peer.mesh_ip) is None):
        return f"mesh IP {peer.mesh_ip[:60]!r} is not an IP address"
    for ip in peer.allowed_ips:
        if "%" in ip or route_limits.network(ip) is None:
            return f"allowed IP {ip[:60]!r} is not a CIDR"
    if not peer.allowed_ips and not peer.mesh_ip:
        return "peer has neither allowed IPs nor a mesh IP"
    for name, endpoint in (("endpoint", peer.endpoint), ("fallback endpoint", peer.fallback_endpoint)):
        if len(endpoint) > 300:
            return f"{name} longer than 300 characters"
        if endpoint:
            try:
                split_endpoint(endpoint)
            except ValueError as e:
                return f"{name}: {e}" if name != "endpoint" else str(e)
    if peer.fallback_endpoint and endpoint_ip(peer.fallback_endpoint) is None:
        # The relay's address, `ip:port` in the protocol. A name would be resolved on the device, and path
        # selection, which compares the device's endpoint with it, would take every relayed packet for the other
        # side coming through directly: back to a dead direct path every few minutes.
        return f"fallback endpoint {peer.fallback_endpoint[:60]!r} is not an IP address and port (the relay's)"
    return None


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def endpoint_ip(endpoint: str) -> route_limits.IPAddress | None:
    """The address of an `ip:port` endpoint (a scope dropped), None when it has none or is not one."""
    if not endpoint:
        return None
    try:
        host = split_endpoint(endpoint)[0]
    except ValueError:
        return None
    return route_limits.address(host.partition("%")[0])


def _route_texts(peer: Peer) -> tuple[str, ...]:
    """The prefixes a peer is routed, as WireGuard's allowed IPs: its mesh IP when it lists none."""
    return peer.allowed_ips or ((peer.mesh_ip,) if peer.mesh_ip else ())


def _routes(peer: Peer) -> list[route_limits.IPNetwork]:
    nets = (route_limits.network(t) for t in _route_texts(peer))
    return [n for n in nets if n is not None]


def _endpoint_ips(peer: Peer) -> tuple[route_limits.IPAddress, ...]:
    """The addresses the peer's tunnel packets go to: its endpoint and its relay (fallback) endpoint."""
    return _addresses_of(peer.endpoint, peer.fallback_endpoint)


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def _addresses_of(endpoint: str, fallback: str) -> tuple[route_limits.IPAddress, ...]:
    ips = (endpoint_ip(endpoint), endpoint_ip(fallback))
    return tuple(dict.fromkeys(ip for ip in ips if ip is not None))


class _EndpointOwners(Mapping[route_limits.IPAddress, str]):
    """Endpoint address -> a peer whose tunnel goes there. Every owner is counted: two peers behind one NAT share
    an address, and the one leaving must not unprotect it for the other. (Owners in immutable tuples: an event's
    copy of the index is one flat dict copy.)"""

    def __init__(self, owners: dict[route_limits.IPAddress, tuple[str, ...]] | None = None) -> None:
        self._owners = owners if owners is not None else {}

    def copy(self) -> _EndpointOwners:
        return _EndpointOwners(dict(self._owners))

    def add(self, ip: route_limits.IPAddress, peer_id: str) -> None:
        ids = self._owners.get(ip, ())
        if peer_id not in ids:
            self._owners[ip] = (*ids, peer_id)

    def discard(self, ip: route_limits.IPAddress, peer_id: str) -> None:
        ids = self._owners.get(ip)
        if ids is not None and peer_id in ids:
            rest = tuple(i for i in ids if i != peer_id)
            if rest:
                self._owners[ip] = rest
            else:
                del self._owners[ip]

    def __getitem__(self, ip: route_limits.IPAddress) -> str:
        return self._owners[ip][0]

    def items(self) -> Iterator[tuple[route_limits.IPAddress, str]]:  # type: ignore[override]
        # route_limits scans every endpoint for each wider prefix: Mapping's own items() goes through
        # __getitem__ for each, which made a full state build 1.7 times slower
        return ((ip, ids[0]) for ip, ids in self._owners.items())

    def __iter__(self) -> Iterator[route_limits.IPAddress]:
        return iter(self._owners)

    def __len__(self) -> int:
        return len(self._owners)


class _RouteIndex:
    """The accepted peers' endpoints, mesh addresses and routed prefixes, kept up to date as peers enter and leave
    one `_with_peers` call, so that a full state of n peers is checked in O(n log n), not O(n²)."""

    def __init__(self, peers: Mapping[str, Peer]) -> None:
        self.keys: dict[str, str] = {}  # public key -> peer id
        self.mesh_strings: dict[str, str] = {}  # mesh IP as written -> peer id
        self.endpoints = _EndpointOwners()
        self.routed: dict[route_limits.IPNetwork, str] = {}  # every prefix routed to a peer -> that peer
        self.lengths: dict[tuple[int, int], int] = {}  # (IP version, prefix length) -> how many routed prefixes
        self.space = route_limits.RoutedSpace(self.routed)  # what `routed` covers (the share limit)
        for peer in peers.values():
            self.add(peer)

    def copy(self) -> _RouteIndex:
        new = _RouteIndex({})
        new.keys, new.mesh_strings = dict(self.keys), dict(self.mesh_strings)
        new.endpoints, new.routed, new.lengths = self.endpoints.copy(), dict(self.routed), dict(self.lengths)
        new.space = self.space.rebound(new.routed)
        return new

    def claim(self, net: route_limits.IPNetwork, peer_id: str) -> None:
        if net not in self.routed:
            self.routed[net] = peer_id
            self.space.add(net)
            length = (net.version, net.prefixlen)
            self.lengths[length] = self.lengths.get(length, 0) + 1

    def covering(self, ip: route_limits.IPAddress) -> Iterator[tuple[route_limits.IPNetwork, str]]:
        """The routed prefixes that contain `ip`: one look-up per prefix length in use, not a scan."""
        for version, length in self.lengths:
            if version == ip.version:
                net = ipaddress.ip_network((ip, length), strict=False)
                owner = self.routed.get(net)
                if owner is not None:
                    yield net, owner

    def add(self, peer: Peer) -> None:
        self.keys[peer.public_key] = peer.id
        if peer.mesh_ip:
            self.mesh_strings[peer.mesh_ip] = peer.id
        for ip in _endpoint_ips(peer):
            self.endpoints.add(ip, peer.id)
        for net in _routes(peer):
            self.claim(net, peer.id)

    def remove(self, peer: Peer) -> None:
        if self.keys.get(peer.public_key) == peer.id:
            del self.keys[peer.public_key]
        if self.mesh_strings.get(peer.mesh_ip) == peer.id:
            del self.mesh_strings[peer.mesh_ip]
        for ip in _endpoint_ips(peer):
            self.endpoints.discard(ip, peer.id)
        for net in _routes(peer):
            if self.routed.get(net) == peer.id:
                del self.routed[net]
                self.space.remove(net)
                length = (net.version, net.prefixlen)
                self.lengths[length] -= 1
                if not self.lengths[length]:
                    del self.lengths[length]


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
    sessions: Sessions | None = None  # the access sessions granted (None: never populated, nothing to serve)
    relay: RelaySessionSet | None = None  # bridge mode: the relay sessions assigned (a new object per listing)
    user_access: UserAccess | None = None  # bridge mode: the access interface and its peers (None: never said)
    site_to_site: SiteToSite | None = None  # bridge mode: the site-to-site tunnels (None: never said)
    ingress: Ingress | None = None  # bridge mode: TCP from outside to mesh services (None: never said)
    # The bridge blocks as the control plane sent them (user access, site-to-site, ingress; not the relay's
    # leases), for the mirror: a bridge restarted while the control plane is unreachable serves them again.
    bridge_blocks: Mapping[str, Any] = field(default_factory=dict, repr=False)  # secrets (psk, key_pem) inside
    # Peers whose direct path showed no handshake, configured on their `fallback_endpoint` (the bridge's relay)
    # instead; chosen by the node (plexd.services.paths), never sent by the control plane, not mirrored.
    relayed: frozenset[str] = frozenset()
    persistent_keepalive: int = DEFAULT_KEEPALIVE
    route_limits: RouteLimits = field(default_factory=RouteLimits)  # machine facts, set by the node
    refused_routes: tuple[tuple[str, str, str], ...] = ()  # (peer id, prefix, reason) dropped by the limits
    # Policy enforcement (§9), from the config: peers no rule allows are kept out of the device and the firewall
    # filters what they send. Off here by default because a bare model has no policies; the daemon turns it on
    # unless `policy.enabled: false`.
    node_id: str = ""
    enforce_policy: bool = False
    mesh_range: tuple[str, ...] = policy.DEFAULT_MESH_RANGE
    peers_by_policy: bool = True  # False: the control plane lists exactly the visible peers (State.peers_by_policy)

    @classmethod
    def initial(cls, *, interface: str, listen_port: int, mtu: int, private_key: str, mesh_ip: str,
                mesh_ip6: str | None = None, persistent_keepalive: int = DEFAULT_KEEPALIVE, node_id: str = "",
                enforce_policy: bool = False,
                mesh_range: tuple[str, ...] = policy.DEFAULT_MESH_RANGE) -> DesiredState:
        return cls(interface=interface, listen_port=listen_port, mtu=mtu, private_key=private_key,
                   mesh_ip=mesh_ip, mesh_ip6=mesh_ip6, persistent_keepalive=persistent_keepalive, node_id=node_id,
                   enforce_policy=enforce_policy, mesh_range=mesh_range)

    # -- policy (§9) -------------------------------------------------------------------------------------------

    @cached_property
    def compiled_policy(self) -> policy.CompiledPolicy:
        own = (self.mesh_ip, self.mesh_ip6) if self.mesh_ip6 else (self.mesh_ip,)
        return policy.compiled_for(self.policies, self.node_id, own, self.mesh_range)

    def shown_peer(self, peer_id: str) -> Peer | None:
        """The peer as it goes on the device: accepted, (when enforcing) allowed by some rule, and on its
        fallback endpoint while it is relayed."""
        peer = self.peers.get(peer_id)
        if peer is None or not self.enforce_policy or not self.peers_by_policy or self.compiled_policy.sees(peer):
            return self._on_path(peer) if peer is not None and peer_id in self.relayed else peer
        return None

    @cached_property
    def shown_peers(self) -> Mapping[str, Peer]:
        """Every peer that goes on the device (peer visibility, §9.2), relayed ones on their fallback endpoint."""
        if not self.enforce_policy or not self.peers_by_policy:
            shown: Mapping[str, Peer] = self.peers
        else:
            sees = self.compiled_policy.sees
            shown = {pid: p for pid, p in self.peers.items() if sees(p)}
        relayed = [pid for pid in self.relayed if pid in shown]
        if not relayed:
            return shown
        return {**shown, **{pid: self._on_path(shown[pid]) for pid in relayed}}

    @staticmethod
    def _on_path(peer: Peer) -> Peer:
        return replace(peer, endpoint=peer.fallback_endpoint) if peer.fallback_endpoint else peer

    def with_relayed(self, relayed: frozenset[str]) -> DesiredState:
        """These peers on their fallback endpoint (the bridge's relay), the others on their direct one."""
        return self if relayed == self.relayed else replace(self, relayed=relayed)

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
        """Add `candidates` to `base`, each checked on its own: keys canonical, the peer valid, its key and mesh
        address its own, every prefix allowed by the route limits (a refused prefix is dropped, the rest kept)."""
        peers = dict(base)
        rejected = dict(base_rejected)
        candidates = [self._canonical(p) for p in candidates]
        replaced = {p.id for p in candidates}
        refused = [r for r in self.refused_routes if r[0] not in replaced and r[0] in peers]
        index = self._route_index.copy() if base is self.peers else _RouteIndex({})
        own_mesh = route_limits.address(self.mesh_ip)
        # Every candidate's endpoints are known before any prefix is checked, so whether a prefix may cover a
        # peer's endpoint never depends on which of the two came first in the list.
        invalid: dict[int, str | None] = {}  # id(candidate) -> validate_peer's answer, asked once
        for peer in candidates:
            old = peers.get(peer.id)
            for ip in _endpoint_ips(old) if old is not None else ():
                index.endpoints.discard(ip, peer.id)
            invalid[id(peer)] = validate_peer(peer, self.public_key)
            if invalid[id(peer)] is None:  # a peer refused outright protects nothing
                for ip in _endpoint_ips(peer):
                    index.endpoints.add(ip, peer.id)

        def admit(peer: Peer) -> None:
            reason = invalid[id(peer)] if id(peer) in invalid else validate_peer(peer, self.public_key)
            old = peers.pop(peer.id, None)
            if old is not None:
                index.remove(old)
            if reason is None:
                for ip in _endpoint_ips(peer):  # counted while its prefixes are checked (its own endpoint too)
                    index.endpoints.add(ip, peer.id)
                reason = self._claims(peer, index.keys, index.mesh_strings, own_mesh)
            if reason is None:
                peer, dropped = self._limit_routes(peer, index, own_mesh)
                refused.extend((peer.id, prefix, why) for prefix, why in dropped)
                if not peer.allowed_ips and dropped and not peer.mesh_ip:
                    reason = "every allowed IP was refused: " + "; ".join(f"{p}: {w}" for p, w in dropped)
            if reason is None:
                peers[peer.id] = peer
                index.add(peer)
                rejected.pop(peer.id, None)
            else:
                for ip in _endpoint_ips(peer):
                    index.endpoints.discard(ip, peer.id)
                rejected[peer.id or "(no id)"] = reason

        for peer in candidates:
            admit(peer)
        # A peer already in place whose prefix now covers a newcomer's endpoint (an event, a NAT exchange, a
        # relay): that prefix goes, as it would have if the two had arrived together.
        for peer_id in self._covering_base_peers(candidates, peers, index, replaced):
            admit(peers[peer_id])
        new = replace(self, peers=peers, rejected=tuple(sorted(rejected.items())), refused_routes=tuple(refused))
        new.__dict__["_route_index"] = index  # the next event's check starts from it (a copy), not from scratch
        return new

    @staticmethod
    def _covering_base_peers(candidates: list[Peer], peers: Mapping[str, Peer], index: _RouteIndex,
                             replaced: set[str]) -> list[str]:
        """Peers not among `candidates` routed a prefix that covers one of the accepted candidates' endpoints."""
        ips = {ip for c in candidates if c.id in peers for ip in _endpoint_ips(peers[c.id])}
        return sorted({owner for ip in ips for _, owner in index.covering(ip) if owner not in replaced})

    @cached_property
    def _route_index(self) -> _RouteIndex:
        return _RouteIndex(self.peers)

    @staticmethod
    def _canonical(peer: Peer) -> Peer:
        key, psk = canonical_key(peer.public_key), canonical_key(peer.psk) if peer.psk else ""
        return peer if key == peer.public_key and psk == peer.psk else replace(peer, public_key=key, psk=psk)

    def _claims(self, peer: Peer, owner_of: Mapping[str, str], mesh_owner: Mapping[str, str],
                own_mesh: route_limits.IPAddress | None) -> str | None:
        """A key or mesh address that is not this peer's to take."""
        owner = owner_of.get(peer.public_key)
        if owner is not None and owner != peer.id:
            return f"public key is already used by peer {owner}"
        if peer.mesh_ip:
            mesh = route_limits.address(peer.mesh_ip)
            if mesh is not None and mesh == own_mesh:
                return f"mesh IP {peer.mesh_ip} is this node's own"
            owner = mesh_owner.get(peer.mesh_ip)
            if owner is not None and owner != peer.id:
                return f"mesh IP {peer.mesh_ip} already belongs to peer {owner}"
            if mesh is not None and mesh in self.route_limits.protected:
                return f"mesh IP {peer.mesh_ip} is the control plane's or this node's own network address"
        return None

    def _limit_routes(self, peer: Peer, index: _RouteIndex,
                      own_mesh: route_limits.IPAddress | None) -> tuple[Peer, list[tuple[str, str]]]:
        """The peer without the prefixes the route limits refuse, and those prefixes with the reason."""
        prefixes = _route_texts(peer)
        endpoints = index.endpoints  # its own endpoints among them: routing them would loop
        kept: list[str] = []
        dropped: list[tuple[str, str]] = []
        claimed: set[route_limits.IPNetwork] = set()
        for prefix in prefixes:
            net = route_limits.network(prefix)
            if net is None:  # validate_peer refused such a peer already
                continue
            if net in claimed:
                why: str | None = f"{net} is listed twice"
            else:
                why = route_limits.refuse_prefix(net, self.route_limits, endpoints, index.routed, own_mesh,
                                                 index.space)
            if why is None:
                claimed.add(net)
                kept.append(prefix)
                index.claim(net, peer.id)  # the peer's next prefixes are checked with this one counted
            else:
                dropped.append((prefix, why))
        if not dropped:
            return peer, []
        if not peer.allowed_ips:  # the mesh IP was the route, and it was refused
            return replace(peer, mesh_ip=""), dropped
        return replace(peer, allowed_ips=tuple(kept)), dropped

    def with_state(self, state: State) -> DesiredState:
        """Full replace from `GET /state`: peers, policies, signing keys, node state and sessions (a null or
        absent sessions block is "not populated": the sessions are kept as they are)."""
        new = replace(self, policies=tuple(state.policies), signing_keys=state.signing_keys,
                      metadata=None if state.metadata is None else dict(state.metadata), data=tuple(state.data),
                      secret_refs=tuple(state.secret_refs),
                      sessions=self.sessions if state.sessions is None else state.sessions,
                      relay=self.relay if state.relay is None else state.relay,
                      user_access=self.user_access if state.user_access is None else state.user_access,
                      site_to_site=self.site_to_site if state.site_to_site is None else state.site_to_site,
                      ingress=self.ingress if state.ingress is None else state.ingress,
                      peers_by_policy=state.peers_by_policy,
                      bridge_blocks=_mirrored_blocks(self.bridge_blocks, state.extra))
        return new._with_peers(state.peers, {}, ())

    def with_peers(self, peers: Iterable[Peer]) -> DesiredState:
        """Replace only the peer set (e.g. from the register response)."""
        return self._with_peers(peers, {}, ())

    def with_peer(self, peer: Peer) -> DesiredState:
        return self._with_peers([peer], self.peers, self.rejected)

    def with_peers_updated(self, peers: Iterable[Peer]) -> DesiredState:
        """These peers added or replaced; the others kept (a key rotation's `updated_peers`)."""
        return self._with_peers(peers, self.peers, self.rejected)

    def with_private_key(self, private_key: str) -> DesiredState:
        return replace(self, private_key=private_key)

    def without_peer(self, peer_id: str) -> DesiredState:
        old = self.peers.get(peer_id)
        peers = dict(self.peers)
        peers.pop(peer_id, None)
        new = replace(self, peers=peers, rejected=tuple(r for r in self.rejected if r[0] != peer_id),
                      refused_routes=tuple(r for r in self.refused_routes if r[0] != peer_id))
        if old is not None:  # carry the index along (rebuilding it costs O(peers), an event should not)
            index = self._route_index.copy()
            index.remove(old)
            new.__dict__["_route_index"] = index
        return new

    def endpoint_owners(self) -> Mapping[route_limits.IPAddress, str]:
        """Every accepted peer's endpoint and relay (fallback) address -> a peer whose tunnel goes there: what no
        route may cover (the tunnel would carry its own packets)."""
        return self._route_index.endpoints

    def routed_prefixes(self) -> Mapping[route_limits.IPNetwork, str]:
        """Every prefix routed to an accepted peer (its allowed IPs, else its mesh address) -> that peer's id."""
        return self._route_index.routed

    def routed_lengths(self, version: int) -> list[int]:
        """The prefix lengths `routed_prefixes` holds for this IP version, longest first: a prefix around an
        address can only be one of these, so a look-up tries a few lengths instead of every one."""
        return sorted((length for v, length in self._route_index.lengths if v == version), reverse=True)

    def with_route_limits(self, limits: RouteLimits) -> DesiredState:
        """New limits (the control plane's address or the underlay changed): every peer is checked again."""
        if limits == self.route_limits:
            return self
        peers = list(self.peers.values())
        return replace(self, route_limits=limits, peers={}, refused_routes=())._with_peers(peers, {}, self.rejected)

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

    def with_session(self, session: Session) -> DesiredState:
        """An older `ssh_session_setup` event: one session added to the block (refused past its cap)."""
        return replace(self, sessions=(self.sessions or Sessions({})).with_session(session))

    def with_relay_event(self, change: Callable[[RelaySessionSet], object]) -> DesiredState:
        """`relay_session_assigned` / `_revoked`: `change` applied to a copy of the relay sessions (a new listing:
        the relay restarts their leases)."""
        relay = RelaySessionSet(dict(self.relay.sessions) if self.relay else {},
                                list(self.relay.refused) if self.relay else [])
        change(relay)
        return replace(self, relay=relay)

    def without_session(self, session_id: str) -> DesiredState:
        """`session_revoked`: the session leaves the block, whatever the next state pull says later."""
        if self.sessions is None:
            return self
        return replace(self, sessions=self.sessions.without(session_id))

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
                           metadata=self.metadata, data=self.data, secret_refs=self.secret_refs,
                           sessions=self.sessions, peers_by_policy=self.peers_by_policy,
                           extra=dict(self.bridge_blocks)).to_wire(),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, private_key: str = "") -> DesiredState:
        """Load a mirror. The private key is not in it: pass it from the identity."""
        base = cls.initial(interface=d["interface"], listen_port=int(d["listen_port"]), mtu=int(d["mtu"]),
                           private_key=private_key, mesh_ip=d["mesh_ip"], mesh_ip6=d.get("mesh_ip6"),
                           persistent_keepalive=int(d.get("persistent_keepalive", DEFAULT_KEEPALIVE)))
        return base.with_state(State.from_wire(d.get("state") or {}))


def _mirrored_blocks(kept: Mapping[str, Any], sent: Mapping[str, Any]) -> dict[str, Any]:
    """The raw bridge blocks to mirror once `sent` (a state's) is applied over `kept`: a block the state names
    (null included) replaces the kept one, as the parsed parts do. The relay's sessions are left out: they are
    5-minute leases the control plane renews, not something to bring back from disk."""
    out = {**kept, **sent}
    out.pop("relay_config", None)
    bridge = out.get("bridge")
    if isinstance(bridge, Mapping) and "relay" in bridge:
        out["bridge"] = {k: v for k, v in bridge.items() if k != "relay"}
    return out
