"""The pure diff: `diff(desired, observed, now) -> list[Change]`.

No I/O here. `observed` is a snapshot of the live machine (WireGuard device + mesh link) taken just before; each
`Change` is both an instruction for the apply step (`device_update()` / `link_ops()`) and a drift-report line
(`correction_type`, `detail`). Details never contain key material beyond a public-key fingerprint.

Correction types. The peer ones are the Go agent's names (docs/protocol.md §4.4); the others are ours:

    peer_added            a desired peer was missing from the device
    peer_removed          the device had a peer that is not desired
    peer_updated          a peer's public key / endpoint / allowed IPs / preshared key / keepalive differed
    interface_created     the WireGuard interface did not exist
    userspace_restarted   the userspace WireGuard process (wireguard-go) had died
    private_key_updated   the device's private key was not the node's
    listen_port_updated   the device listened on another port
    address_added         the mesh address was missing from the interface
    address_removed       the interface had an address that is not the mesh address
    mtu_updated           the interface MTU differed from mesh.mtu
    link_up               the interface was down
    route_added           a route for a peer's allowed IPs via the interface was missing (in the mesh table)
    route_removed         the interface had a route for something no peer is allowed
    route_moved           a route via the interface sat in the main table (plexd routes only in its own table)
    route_rule_added      the rule sending lookups to the mesh table was missing for an address family

Details read `<object>: <what> <live> != <desired>`, e.g. `peer n_x: endpoint 1.2.3.4:51820 != 5.6.7.8:51820`.

Rules: a peer's endpoint is left alone while its latest handshake is younger than `ROAMING_WINDOW` seconds
(it roamed; innernet's rule), and an empty desired endpoint never clears a learned one. Default routes (`/0`) in a
peer's allowed IPs are not installed (that needs policy routing, as wg-quick does, and would cut the underlay);
routes cover exactly the union of the peers' allowed IPs with the fewest prefixes (adjacent ones merge). Routes
live in the mesh table (`plexd.machine.links`); a rule per address family that has routes sends lookups there. A
rule no longer needed stays (it costs a lookup in an empty table; taking it away and back would be churn).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from plexd.base.mesh_caches import bounded_by_mesh
from plexd.converge.change import Change
from plexd.machine.links import LinkOp, LinkState
from plexd.machine.wireguard import (
    DeviceConfig,
    DeviceUpdate,
    PeerConfig,
    PeerUpdate,
    clamp_private_key,
    key_fingerprint,
)
from plexd.state.desired import DesiredState, split_endpoint
from plexd.state.model import Peer

ROAMING_WINDOW = 180.0


# --- observed and target ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    """The live machine. `device` None: no WireGuard device. `link` None: no interface.

    `peer_names` maps public keys to peer ids so details can name peers that are no longer desired; it is a
    label table only, never something we diff against.
    """

    device: DeviceConfig | None
    link: LinkState | None
    process_gone: bool = False
    peer_names: Mapping[str, str] = field(default_factory=dict)
    # The address families whose rule to the mesh table exists, read also when the interface is gone: a rule
    # outlives the interface, and must not be reported as put back when it never went away.
    rules: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Target:
    """The desired state translated into device and link terms."""

    interface: str
    device: DeviceConfig
    peer_ids: Mapping[str, str]  # public key -> peer id
    addresses: frozenset[str]
    mtu: int
    routes: frozenset[str]

    @property
    def rule_families(self) -> frozenset[int]:
        """The address families whose lookups must reach the mesh table: those with routes in it."""
        return frozenset(4 if ":" not in r else 6 for r in self.routes)


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def normalize_endpoint(endpoint: str) -> str:
    """Render an IP endpoint the way WireGuard prints it (`1.2.3.4:5`, `[fd00::1]:5`); host names unchanged."""
    if not endpoint:
        return ""
    host, port = split_endpoint(endpoint)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return endpoint
    if ip.version == 6 and ip.ipv4_mapped is not None:  # as wireguard-go and inet_ntop print it (3.11: ::ffff:102:304)
        return f"[::ffff:{ip.ipv4_mapped}]:{port}"
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def _cidr(text: str) -> str:
    return str(ipaddress.ip_network(text, strict=False))


@functools.lru_cache(maxsize=2)
def _collapsed(routes: frozenset[str]) -> frozenset[str]:
    """The addresses `routes` cover, in their fewest prefixes (a default route kept: it is never ours)."""
    nets = [ipaddress.ip_network(r) for r in routes]
    return frozenset(str(n) for version in (4, 6)
                     for n in ipaddress.collapse_addresses(n for n in nets if n.version == version))


@functools.lru_cache(maxsize=4)
def _routes(networks: frozenset[str], exclude: frozenset[str]) -> frozenset[str]:
    """The fewest routes covering exactly the peers' allowed IPs (adjacent /32s merge into one prefix, so
    1,000 peers need a handful of routes, not 1,000). Default routes and our own addresses are left out.
    Cached: the peer set rarely changes between converges, and collapsing thousands of prefixes is not free.
    Only a few entries: each key holds every peer's prefix (64 of them held ~0.5 MiB at 1,000 peers after a
    burst of peer events), and only the current peer set repeats."""
    nets = {ipaddress.ip_network(n) for n in networks if not n.endswith("/0")} - {
        ipaddress.ip_network(a, strict=False) for a in exclude}
    out: set[str] = set()
    for version in (4, 6):
        out.update(str(n) for n in ipaddress.collapse_addresses(n for n in nets if n.version == version))
    return frozenset(out)


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 17)
def peer_config(peer: Peer, keepalive: int) -> PeerConfig:
    """One desired peer in device terms. Cached per (immutable) peer, so a converge costs per peer a hash
    lookup, not re-parsing its addresses: the cost of a converge grows with what changed, not the mesh."""
    allowed = (frozenset(_cidr(ip) for ip in peer.allowed_ips) if peer.allowed_ips
               else frozenset({_cidr(peer.mesh_ip)}))
    # No keepalive until the peer has an endpoint: wireguard-go would spend its one handshake initiation per
    # 5 s on a peer it cannot reach, and the endpoint arriving a moment later would then wait out that 5 s.
    return PeerConfig(public_key=peer.public_key, endpoint=normalize_endpoint(peer.endpoint), allowed_ips=allowed,
                      psk=peer.psk, persistent_keepalive=keepalive if peer.endpoint else 0)


def own_addresses(desired: DesiredState) -> frozenset[str]:
    """The node's own addresses on the mesh interface, as `addr/prefix`."""
    addresses = {f"{ipaddress.ip_address(desired.mesh_ip)}/{32 if ':' not in desired.mesh_ip else 128}"}
    if desired.mesh_ip6:
        addresses.add(f"{ipaddress.ip_address(desired.mesh_ip6)}/128")
    return frozenset(addresses)


def target(desired: DesiredState) -> Target:
    cached = desired.__dict__.get("_plan_target")  # DesiredState is immutable: compute once per value
    if cached is not None:
        return cached
    peers: dict[str, PeerConfig] = {}
    ids: dict[str, str] = {}
    routes: set[str] = set()
    keepalive = desired.persistent_keepalive
    for pid, p in desired.shown_peers.items():  # peers no policy allows stay off the device (§9.2)
        pc = peer_config(p, keepalive)
        peers[p.public_key] = pc
        ids[p.public_key] = pid
        routes.update(pc.allowed_ips)
    addresses = own_addresses(desired)
    t = Target(interface=desired.interface,
               device=DeviceConfig(private_key=clamp_private_key(desired.private_key),
                                   listen_port=desired.listen_port, peers=peers),
               peer_ids=ids, addresses=addresses, mtu=desired.mtu,
               routes=_routes(frozenset(routes), addresses))
    desired.__dict__["_plan_target"] = t
    return t


# --- changes ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceChange(Change):
    """A change applied through the WireGuard backend."""


@dataclass(frozen=True)
class PeerChange(DeviceChange):
    peer_id: str
    public_key: str

    def peer_update(self) -> Sequence[PeerUpdate]:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class LinkChange(Change):
    interface: str

    def link_op(self) -> LinkOp:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class InterfaceMissing(DeviceChange):
    correction_type: ClassVar[str] = "interface_created"
    interface: str

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: missing, created"


@dataclass(frozen=True)
class UserspaceProcessGone(DeviceChange):
    correction_type: ClassVar[str] = "userspace_restarted"
    interface: str

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: userspace WireGuard process was not running, restarted"


@dataclass(frozen=True)
class PrivateKeyWrong(DeviceChange):
    correction_type: ClassVar[str] = "private_key_updated"
    interface: str
    private_key: str = field(repr=False)

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: private key was not the node's"


@dataclass(frozen=True)
class ListenPortWrong(DeviceChange):
    correction_type: ClassVar[str] = "listen_port_updated"
    interface: str
    want: int
    have: int

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: listen port {self.have} != {self.want}"


def _full(peer: PeerConfig, keepalive: int | None = None) -> PeerUpdate:
    return PeerUpdate(public_key=peer.public_key, endpoint=peer.endpoint or None, allowed_ips=peer.allowed_ips,
                      psk=peer.psk or None,
                      persistent_keepalive=peer.persistent_keepalive if keepalive is None else keepalive)


@dataclass(frozen=True)
class PeerAdded(PeerChange):
    correction_type: ClassVar[str] = "peer_added"
    peer: PeerConfig

    @property
    def detail(self) -> str:
        return f"peer {self.peer_id}: missing from the device"

    def peer_update(self) -> Sequence[PeerUpdate]:
        return (_full(self.peer),)


@dataclass(frozen=True)
class PeerRemoved(PeerChange):
    correction_type: ClassVar[str] = "peer_removed"

    @property
    def detail(self) -> str:
        return f"peer {self.peer_id}: on the device but not desired"

    def peer_update(self) -> Sequence[PeerUpdate]:
        return (PeerUpdate(public_key=self.public_key, remove=True),)


@dataclass(frozen=True)
class PeerKeyChanged(PeerChange):
    """The peer's public key changed: WireGuard cannot rename a peer, so remove the old one and add the new."""

    correction_type: ClassVar[str] = "peer_updated"
    old_key: str
    peer: PeerConfig

    @property
    def detail(self) -> str:
        return f"peer {self.peer_id}: public key {key_fingerprint(self.old_key)} != {key_fingerprint(self.public_key)}"

    def peer_update(self) -> Sequence[PeerUpdate]:
        return (PeerUpdate(public_key=self.old_key, remove=True), _full(self.peer))


@dataclass(frozen=True)
class PeerEndpointChanged(PeerChange):
    """A new endpoint. With a persistent keepalive, the keepalive is switched off and on again in the same
    transaction: wireguard-go sends a keepalive (and so a handshake) only when keepalive goes from 0 to on, and
    otherwise a peer whose endpoint arrives late waits for the other side's 5 s retry before the tunnel is up."""

    correction_type: ClassVar[str] = "peer_updated"
    want: str
    have: str
    keepalive: int = 0

    @property
    def detail(self) -> str:
        return f"peer {self.peer_id}: endpoint {self.have or '(none)'} != {self.want}"

    def peer_update(self) -> Sequence[PeerUpdate]:
        update = PeerUpdate(public_key=self.public_key, update_only=True, endpoint=self.want,
                            persistent_keepalive=self.keepalive or None)
        if not self.keepalive:
            return (update,)
        return (PeerUpdate(public_key=self.public_key, update_only=True, persistent_keepalive=0), update)


@dataclass(frozen=True)
class PeerAllowedIpsChanged(PeerChange):
    correction_type: ClassVar[str] = "peer_updated"
    want: frozenset[str]
    have: frozenset[str]

    @property
    def detail(self) -> str:
        return (f"peer {self.peer_id}: allowed IPs {','.join(sorted(self.have)) or '(none)'} != "
                f"{','.join(sorted(self.want)) or '(none)'}")

    def peer_update(self) -> Sequence[PeerUpdate]:
        return (PeerUpdate(public_key=self.public_key, update_only=True, allowed_ips=self.want),)


@dataclass(frozen=True)
class PeerPskChanged(PeerChange):
    correction_type: ClassVar[str] = "peer_updated"
    want: str = field(repr=False)

    @property
    def detail(self) -> str:
        return f"peer {self.peer_id}: preshared key differs"

    def peer_update(self) -> Sequence[PeerUpdate]:
        return (PeerUpdate(public_key=self.public_key, update_only=True, psk=self.want),)


@dataclass(frozen=True)
class PeerKeepaliveChanged(PeerChange):
    correction_type: ClassVar[str] = "peer_updated"
    want: int
    have: int
    kicks: bool = False  # on from 0, the endpoint already on the device: WireGuard sends (a handshake) at once

    @property
    def detail(self) -> str:
        return f"peer {self.peer_id}: persistent keepalive {self.have} != {self.want}"

    def peer_update(self) -> Sequence[PeerUpdate]:
        return (PeerUpdate(public_key=self.public_key, update_only=True, persistent_keepalive=self.want),)


@dataclass(frozen=True)
class AddressMissing(LinkChange):
    correction_type: ClassVar[str] = "address_added"
    address: str

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: address {self.address} missing"

    def link_op(self) -> LinkOp:
        return LinkOp("addr_add", self.address)


@dataclass(frozen=True)
class AddressExtra(LinkChange):
    correction_type: ClassVar[str] = "address_removed"
    address: str

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: unexpected address {self.address}"

    def link_op(self) -> LinkOp:
        return LinkOp("addr_del", self.address)


@dataclass(frozen=True)
class MtuWrong(LinkChange):
    correction_type: ClassVar[str] = "mtu_updated"
    want: int
    have: int

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: mtu {self.have} != {self.want}"

    def link_op(self) -> LinkOp:
        return LinkOp("mtu", self.want)


@dataclass(frozen=True)
class LinkDown(LinkChange):
    correction_type: ClassVar[str] = "link_up"

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: link was down"

    def link_op(self) -> LinkOp:
        return LinkOp("up")


@dataclass(frozen=True)
class RouteMissing(LinkChange):
    correction_type: ClassVar[str] = "route_added"
    destination: str

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: route {self.destination} missing"

    def link_op(self) -> LinkOp:
        return LinkOp("route_add", self.destination)


@dataclass(frozen=True)
class RouteExtra(LinkChange):
    correction_type: ClassVar[str] = "route_removed"
    destination: str

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: unexpected route {self.destination}"

    def link_op(self) -> LinkOp:
        return LinkOp("route_del", self.destination)


@dataclass(frozen=True)
class RouteInMainTable(LinkChange):
    correction_type: ClassVar[str] = "route_moved"
    destination: str

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: route {self.destination} in the main table (mesh routes have their own)"

    def link_op(self) -> LinkOp:
        return LinkOp("main_route_del", self.destination)


@dataclass(frozen=True)
class RouteRuleMissing(LinkChange):
    correction_type: ClassVar[str] = "route_rule_added"
    version: int

    @property
    def detail(self) -> str:
        return f"interface {self.interface}: IPv{self.version} rule to the mesh routing table missing"

    def link_op(self) -> LinkOp:
        return LinkOp("rule_add", self.version)


def rules_for(interface: str, routes: Iterable[str], link: LinkState) -> list[Change]:
    """The rules the mesh table needs once `routes` are in it, and which `link` lacks."""
    versions = {4 if ":" not in r else 6 for r in routes}
    return [RouteRuleMissing(interface, v) for v in sorted(versions - link.rules)]


# --- the diff -----------------------------------------------------------------------------------------------

_EMPTY_LINK = LinkState(index=0, kind="", mtu=0, up=False)


def diff(desired: DesiredState, observed: Observed, now: float,
         applied_endpoints: Mapping[str, str] | None = None) -> list[Change]:
    """Everything that must change for the live machine to match `desired`, in apply order.

    `now` is Unix seconds (for the roaming window). `applied_endpoints`: public key -> the model's endpoint when
    it was last applied; one that differs now is news (an event, a path switch, the NAT exchange this diff got
    to first) and wins over WireGuard's roaming, as it does on the event path.
    """
    t = target(desired)
    changes: list[Change] = []
    dev = observed.device
    link = observed.link
    if dev is None:
        # A fresh device starts empty and its TUN link starts bare: plan everything from scratch.
        changes.append(UserspaceProcessGone(t.interface) if observed.process_gone else InterfaceMissing(t.interface))
        dev = DeviceConfig()
        link = None
    changes.extend(_device_fields(t, dev))
    changes.extend(_peers(t, dev, observed.peer_names, now, applied_endpoints or {}))
    changes.extend(_link(t, link or replace(_EMPTY_LINK, rules=observed.rules)))
    return changes


def _device_fields(t: Target, dev: DeviceConfig) -> Iterable[Change]:
    if t.device.private_key and dev.private_key != t.device.private_key:
        yield PrivateKeyWrong(t.interface, t.device.private_key)
    if t.device.listen_port and dev.listen_port != t.device.listen_port:
        yield ListenPortWrong(t.interface, t.device.listen_port, dev.listen_port)


def _peers(t: Target, dev: DeviceConfig, names: Mapping[str, str], now: float,
           applied_endpoints: Mapping[str, str]) -> Iterable[Change]:
    want, live = t.device.peers, dev.peers
    extra = [k for k in live if k not in want]
    missing = {k for k in want if k not in live}
    key_by_id = {pid: key for key, pid in t.peer_ids.items()}
    renamed: dict[str, str] = {}  # new key -> old key
    for old in extra:
        new = key_by_id.get(names.get(old, ""))
        if new in missing and new not in renamed:
            renamed[new] = old
    renamed_old = set(renamed.values())

    def name(key: str) -> str:
        return t.peer_ids.get(key) or names.get(key) or key_fingerprint(key)

    removed = sorted((k for k in extra if k not in renamed_old), key=name)
    yield from (PeerRemoved(name(k), k) for k in removed)
    for key in sorted(renamed, key=name):
        yield PeerKeyChanged(name(key), key, renamed[key], want[key])
    for key in sorted((k for k in want if k in live and _differs(want[k], live[k])), key=name):
        moved = applied_endpoints.get(key, want[key].endpoint) != want[key].endpoint
        yield from peer_fields(name(key), want[key], live[key], now, moved=moved)
    for key in sorted((k for k in missing if k not in renamed), key=name):
        yield PeerAdded(name(key), key, want[key])


def _differs(w: PeerConfig, h: PeerConfig) -> bool:
    """Whether `peer_fields` can find anything: the fields it compares, not the observed counters and handshake
    (a live peer never equals its desired one on those, so comparing whole peers sent every peer through it)."""
    return (w.endpoint != h.endpoint or w.allowed_ips != h.allowed_ips or w.psk != h.psk
            or w.persistent_keepalive != h.persistent_keepalive)


def peer_fields(pid: str, w: PeerConfig, h: PeerConfig, now: float, *, moved: bool = False) -> Iterable[PeerChange]:
    """`moved`: the model's endpoint itself changed (an event, the NAT endpoint exchange): news that wins over
    roaming — a peer whose NAT mapping changed cannot reach us from its new address until we send to it."""
    roaming = h.last_handshake > 0 and now - h.last_handshake < ROAMING_WINDOW
    endpoint_changed = bool(w.endpoint) and w.endpoint != h.endpoint and (moved or not roaming)
    if endpoint_changed:
        yield PeerEndpointChanged(pid, w.public_key, w.endpoint, h.endpoint, w.persistent_keepalive)
    if w.allowed_ips != h.allowed_ips:
        yield PeerAllowedIpsChanged(pid, w.public_key, w.allowed_ips, h.allowed_ips)
    if w.psk != h.psk:
        yield PeerPskChanged(pid, w.public_key, w.psk)
    if w.persistent_keepalive != h.persistent_keepalive:
        kicks = (not endpoint_changed and bool(w.endpoint) and h.persistent_keepalive == 0
                 and w.persistent_keepalive > 0)
        yield PeerKeepaliveChanged(pid, w.public_key, w.persistent_keepalive, h.persistent_keepalive, kicks)


def _link(t: Target, link: LinkState) -> Iterable[Change]:
    if t.mtu and link.mtu != t.mtu:
        yield MtuWrong(t.interface, t.mtu, link.mtu)
    if not link.up:
        yield LinkDown(t.interface)
    for a in sorted(link.addresses - t.addresses):
        yield AddressExtra(t.interface, a)
    for a in sorted(t.addresses - link.addresses):
        yield AddressMissing(t.interface, a)
    yield from rules_for(t.interface, t.routes, link)
    for r in sorted(link.main_routes):
        yield RouteInMainTable(t.interface, r)
    if link.routes == t.routes or _collapsed(link.routes) == t.routes:
        return  # the same addresses routed, in another form (event deltas add and split routes one at a time)
    for r in sorted(link.routes - t.routes):
        yield RouteExtra(t.interface, r)
    for r in sorted(t.routes - link.routes):
        yield RouteMissing(t.interface, r)


# --- turning changes into operations -----------------------------------------------------------------------


def first_contacts(changes: Iterable[Change]) -> dict[str, int]:
    """The first contacts in these changes that WireGuard would make at once (public key -> persistent
    keepalive): it sends a keepalive, and so a handshake initiation, when a peer's keepalive goes from off to on
    with an endpoint set: a new peer with both, a new endpoint (`PeerEndpointChanged`'s toggle), and a keepalive
    turned on for a peer whose endpoint the device has already (the mesh's keepalive setting turned on, or a model
    endpoint that left and came back unchanged).

    A peer's new key (`PeerKeyChanged`) is not one: the peer rotated, its device already holds the new key and
    its own first initiation went out before we knew the key (`rekey_kicks`; WireGuard tries again only 5 s
    later), so ours, at once, does not cross it (`plexd.node.key_rotation`)."""
    kicked: dict[str, int] = {}
    for c in changes:
        if isinstance(c, PeerAdded) and c.peer.endpoint and c.peer.persistent_keepalive:
            kicked[c.public_key] = c.peer.persistent_keepalive
        elif isinstance(c, PeerEndpointChanged) and c.keepalive:
            kicked[c.public_key] = c.keepalive
        elif isinstance(c, PeerKeepaliveChanged) and c.kicks:
            kicked.setdefault(c.public_key, c.want)
    return kicked


def rekey_kicks(changes: Sequence[Change], desired: DesiredState) -> dict[str, int]:
    """With a new private key (`PrivateKeyWrong`): the peers already on the device that WireGuard keeps alive
    (public key -> keepalive), to kick in the same transaction.

    The key drops every session, and each kick sends a handshake initiation under the new key at once. In a key
    rotation the peers do not know that key yet (the control plane is told only after the device has it), so
    they drop it; and WireGuard sends no other initiation to that peer for 5 s (its retry, every 5 s while
    unanswered, is the next). Without it, our first data packet after the swap would start one: if that came just
    after a peer had learnt the new key and initiated itself, the two initiations crossed and both were dropped
    (a lab under load lost 37 of 40 pings, 4 s). A peer that learns the key later than 5 s meets our retries,
    each a crossing window of about one round trip, as before.

    A peer still held from an earlier transaction is kicked here too: its initiation under the new key, which the
    peer cannot take yet, and the held kick later is then rate-limited by WireGuard; harmless."""
    if not any(isinstance(c, PrivateKeyWrong) for c in changes):
        return {}  # before `target`: an event's delta never builds the whole mesh's target (2 ms at 5,000 peers)
    created_or_removed = {c.public_key for c in changes if isinstance(c, PeerAdded | PeerKeyChanged | PeerRemoved)}
    return {key: pc.persistent_keepalive for key, pc in target(desired).device.peers.items()
            if pc.endpoint and pc.persistent_keepalive and key not in created_or_removed}


def device_update(changes: Iterable[Change], held: Collection[str] = (),
                  rekeyed: Mapping[str, int] | None = None) -> DeviceUpdate:
    """One UAPI/netlink transaction for every device change: only changed peers appear, removals first.

    Field updates of one peer are merged into one `update_only` peer block. `held`: public keys whose first
    handshake this node leaves to the peer for now (`plexd.mesh.first_contact`): their keepalive is not turned
    on here, so WireGuard sends nothing to them yet. `rekeyed` (`rekey_kicks`): peers whose keepalive is
    switched off and on again after the private key, so WireGuard initiates under the new key now.
    """
    private_key: str | None = None
    listen_port: int | None = None
    removals: list[PeerUpdate] = []
    kicks: list[PeerUpdate] = []  # keepalive off before the merged update turns it on (PeerEndpointChanged)
    merged: dict[str, PeerUpdate] = {}
    for c in changes:
        if type(c) is PeerAdded and c.public_key not in merged:  # a full apply's thousand: nothing to merge
            merged[c.public_key] = _full(c.peer, 0 if c.public_key in held else None)
        elif isinstance(c, PrivateKeyWrong):
            private_key = c.private_key
        elif isinstance(c, ListenPortWrong):
            listen_port = c.want
        elif isinstance(c, PeerChange):
            updates = list(c.peer_update())
            if isinstance(c, PeerEndpointChanged) and len(updates) == 2:
                kick = updates.pop(0)
                if c.public_key not in held:
                    kicks.append(kick)
            for u in updates:
                if u.remove:
                    removals.append(u)
                elif u.public_key in merged:
                    merged[u.public_key] = _merge(merged[u.public_key], u)
                else:
                    merged[u.public_key] = u
    # A held peer's keepalive ends this transaction off, whatever set it: a peer added before its endpoint has
    # keepalive 0 on the device, and its endpoint's change (with `PeerKeepaliveChanged` to 25) would otherwise turn
    # it on here, from 0, which is a kick (the lab's events path: both nodes initiated, and the first handshakes
    # crossed). The held kick turns it on.
    for key in held:
        if (u := merged.get(key)) is not None and u.persistent_keepalive != 0:  # (an added peer's is 0 already)
            merged[key] = replace(u, persistent_keepalive=0)
    kicked = {k.public_key for k in kicks}
    for key, keepalive in (rekeyed or {}).items():
        if key in held or key in kicked:
            continue
        kicks.append(PeerUpdate(public_key=key, update_only=True, persistent_keepalive=0))
        on = PeerUpdate(public_key=key, update_only=True, persistent_keepalive=keepalive)
        merged[key] = _merge(merged[key], on) if key in merged else on
    return DeviceUpdate(private_key=private_key, listen_port=listen_port,
                        peers=(*removals, *kicks, *merged.values()))


def _merge(a: PeerUpdate, b: PeerUpdate) -> PeerUpdate:
    return replace(
        a,
        update_only=a.update_only and b.update_only,
        endpoint=b.endpoint if b.endpoint is not None else a.endpoint,
        allowed_ips=b.allowed_ips if b.allowed_ips is not None else a.allowed_ips,
        psk=b.psk if b.psk is not None else a.psk,
        persistent_keepalive=b.persistent_keepalive if b.persistent_keepalive is not None else a.persistent_keepalive,
    )


def link_ops(changes: Iterable[Change]) -> list[LinkOp]:
    """Link operations in a safe order: MTU, up, addresses, rules, then routes (routes need an up link). New
    routes go in before old ones leave (a main-table route moved to the mesh table included), so replacing a
    route by its parts (or parts by their union) never lets a packet for a peer fall through to the default
    route in between."""
    order = {"mtu": 0, "up": 1, "addr_del": 2, "addr_add": 3, "rule_add": 4, "route_add": 5, "main_route_del": 6,
             "route_del": 7}
    ops = [c.link_op() for c in changes if isinstance(c, LinkChange)]
    return sorted(ops, key=lambda op: order[op.action])


# --- simulation (for tests and dry runs): what the machine looks like after the changes --------------------


_NO_PEER = PeerConfig(public_key="")  # a peer new to the device: every field at its default


def simulate(observed: Observed, changes: Iterable[Change]) -> Observed:
    """Apply `changes` to a snapshot the way the device and the kernel would. Pure."""
    changes = list(changes)
    dev = observed.device
    link = observed.link
    if any(isinstance(c, InterfaceMissing | UserspaceProcessGone) for c in changes):
        dev, link = DeviceConfig(), _EMPTY_LINK
    assert dev is not None
    link = link or _EMPTY_LINK
    update = device_update(changes)
    peers = dict(dev.peers)
    for u in update.peers:
        if u.remove:
            peers.pop(u.public_key, None)
            continue
        cur = peers.get(u.public_key)
        if cur is None:
            if u.update_only:
                continue
            cur = _NO_PEER
        # Built whole, not `replace`d (four times dearer, and a full apply's baseline builds 1,000 of them).
        peers[u.public_key] = PeerConfig(
            u.public_key,
            u.endpoint if u.endpoint is not None else cur.endpoint,
            u.allowed_ips if u.allowed_ips is not None else cur.allowed_ips,
            u.psk if u.psk is not None else cur.psk,
            u.persistent_keepalive if u.persistent_keepalive is not None else cur.persistent_keepalive,
            cur.last_handshake, cur.rx, cur.tx,
        )
    dev = replace(dev, peers=peers,
                  private_key=update.private_key if update.private_key is not None else dev.private_key,
                  listen_port=update.listen_port if update.listen_port is not None else dev.listen_port)
    addresses, routes, mtu, up = set(link.addresses), set(link.routes), link.mtu, link.up
    main_routes, rules = set(link.main_routes), set(link.rules)
    for op in link_ops(changes):
        if op.action == "mtu":
            mtu = int(op.value or 0)
        elif op.action == "up":
            up = True
        elif op.action == "addr_add":
            addresses.add(str(op.value))
        elif op.action == "addr_del":
            addresses.discard(str(op.value))
        elif op.action == "route_add":
            routes.add(str(op.value))
        elif op.action == "route_del":
            routes.discard(str(op.value))
        elif op.action == "main_route_del":
            main_routes.discard(str(op.value))
        elif op.action == "rule_add":
            rules.add(int(op.value or 4))
    link = replace(link, mtu=mtu, up=up, addresses=frozenset(addresses), routes=frozenset(routes),
                   main_routes=frozenset(main_routes), rules=frozenset(rules), kind=link.kind or "tun")
    return replace(observed, device=dev, link=link, process_gone=False)
