"""One WireGuard interface a bridge serves besides the mesh (user access, a site-to-site tunnel): observed, diffed
and converged like the mesh device, by the domain that owns it.

Its desired shape is an `InterfaceSpec`: the kept private key, the listen port, the peers, the routes its peers'
prefixes need (in the mesh routing table, whose policy rule the mesh domain keeps: never a main-table route) and
the interfaces whose forwarding must be on, each with where what arrives on it may go (`forwarding.Forward`: its
limit). The diff is pure and names every difference as a `Change` that is also its drift line; `apply` performs
them, per peer (a peer whose prefixes change keeps its session).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from plexd.base.errors import PlexdError
from plexd.bridge.forwarding import Forward, ForwardingLedger
from plexd.converge.change import Change
from plexd.machine.links import LinkOp, Links, LinkState
from plexd.machine.wireguard import (
    DeviceConfig,
    DeviceUpdate,
    PeerConfig,
    PeerUpdate,
    WireGuardBackend,
    WireGuardError,
    clamp_private_key,
    key_fingerprint,
)


@dataclass(frozen=True)
class InterfaceSpec:
    part: str  # "user access", "site-to-site s2s_1": the drift lines and errors name it
    name: str
    private_key: str = field(repr=False)
    listen_port: int
    peers: Mapping[str, PeerConfig]
    routes: frozenset[str]
    forwarding: tuple[Forward, ...]  # interfaces whose (IPv4) forwarding must be on: this one and those it serves


@dataclass(frozen=True)
class InterfaceSeen:
    device: DeviceConfig | None
    link: LinkState | None
    forwarding_off: frozenset[str] = frozenset()
    limits_drift: Mapping[str, str] = field(default_factory=dict)  # interface -> "missing" or "differs"


@dataclass(frozen=True)
class _Step(Change):
    part: str
    interface: str


@dataclass(frozen=True)
class InterfaceCreated(_Step):
    correction_type: ClassVar[str] = "bridge_interface_created"
    first: bool = True

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: " + ("created" if self.first else "missing; created again")


@dataclass(frozen=True)
class InterfaceRemoved(_Step):
    correction_type: ClassVar[str] = "bridge_interface_removed"

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: no longer wanted; removed"


@dataclass(frozen=True)
class DeviceSettingsSynced(_Step):
    correction_type: ClassVar[str] = "bridge_interface_updated"
    what: str = ""

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: {self.what}"


@dataclass(frozen=True)
class PeerSynced(_Step):
    correction_type: ClassVar[str] = "bridge_peer_updated"
    public_key: str = ""
    what: str = ""  # "missing", "not wanted", "allowed IPs differ", ...

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: peer {key_fingerprint(self.public_key)}: {self.what}"


@dataclass(frozen=True)
class RouteSynced(_Step):
    correction_type: ClassVar[str] = "bridge_route_updated"
    cidr: str = ""
    add: bool = True

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: route {self.cidr} " + ("missing; added" if self.add else
                                                                     "not wanted; removed")


@dataclass(frozen=True)
class RoutingRuleAdded(_Step):
    correction_type: ClassVar[str] = "bridge_route_updated"
    family: int = 4

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: the IPv{self.family} rule to the mesh routing table is missing; added"


@dataclass(frozen=True)
class LinkUp(_Step):
    correction_type: ClassVar[str] = "bridge_interface_updated"

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: link down; set up"


@dataclass(frozen=True)
class ForwardingEnabled(_Step):
    correction_type: ClassVar[str] = "bridge_forwarding_enabled"
    on: str = ""

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: net.ipv4.conf.{self.on}.forwarding was off; on"


@dataclass(frozen=True)
class ForwardingLimited(_Step):
    correction_type: ClassVar[str] = "bridge_forwarding_limited"
    on: str = ""
    what: str = "missing"  # or "differs": another limit is there

    @property
    def detail(self) -> str:
        return f"{self.part} {self.interface}: forwarding limit for {self.on} {self.what}; " + (
            "put back" if self.what == "missing" else "updated")


class WgInterface:
    """The live side of one spec: its backend (kernel or wireguard-go) and its link."""

    def __init__(self, backend: WireGuardBackend, links: Links, ledger: ForwardingLedger) -> None:
        self.backend = backend
        self.links = links
        self.ledger = ledger
        self.created = False

    @property
    def name(self) -> str:
        return self.backend.interface

    async def observe(self, spec: InterfaceSpec) -> InterfaceSeen:
        device = None if self.backend.process_gone() else await self.backend.observe()
        link = await self.links.observe() if device is not None else None
        off = frozenset(f.interface for f in spec.forwarding if not self.ledger.is_on(f.interface))
        drift = {f.interface: d for f in spec.forwarding if f.interface not in off
                 and (d := self.ledger.limit_drift(f.interface))}
        return InterfaceSeen(device, link, off, drift)

    def plan(self, spec: InterfaceSpec, seen: InterfaceSeen) -> list[Change]:
        part, name = spec.part, spec.name
        if seen.device is None or seen.link is None:
            changes: list[Change] = [InterfaceCreated(part, name, first=not self.created)]
            return changes + _forwarding(spec, seen, but=name)  # not its own: the device is new
        changes = []
        device = seen.device
        if clamp_private_key(device.private_key) != clamp_private_key(spec.private_key):
            changes.append(DeviceSettingsSynced(part, name, what="private key is not the kept one; restored"))
        if device.listen_port != spec.listen_port:
            changes.append(DeviceSettingsSynced(part, name, what=f"listen port {device.listen_port}; "
                                                f"set to {spec.listen_port}"))
        for key, want in spec.peers.items():
            have = device.peers.get(key)
            if have is None:
                changes.append(PeerSynced(part, name, public_key=key, what="missing; added"))
            elif have.allowed_ips != want.allowed_ips or have.psk != want.psk or (
                    want.endpoint and have.endpoint != want.endpoint):
                changes.append(PeerSynced(part, name, public_key=key, what="differs; updated"))
        changes += [PeerSynced(part, name, public_key=key, what="not wanted; removed")
                    for key in device.peers if key not in spec.peers]
        if not seen.link.up:
            changes.append(LinkUp(part, name))
        changes += [RoutingRuleAdded(part, name, family=f) for f in _families(spec.routes) - seen.link.rules]
        changes += [RouteSynced(part, name, cidr=c) for c in sorted(spec.routes - seen.link.routes)]
        changes += [RouteSynced(part, name, cidr=c, add=False) for c in sorted(seen.link.routes - spec.routes)]
        return changes + _forwarding(spec, seen)

    async def apply(self, spec: InterfaceSpec, changes: Sequence[Change]) -> list[str]:
        """Perform `changes` (this interface's plan); the errors, one line each naming the object."""
        errors: list[str] = []
        ops: list[LinkOp] = []
        peers: list[PeerUpdate] = []
        settings = DeviceUpdate()
        for change in changes:
            if isinstance(change, InterfaceCreated):
                try:
                    await self.backend.ensure_device()
                except WireGuardError as e:
                    return [f"{spec.part} {spec.name}: cannot create the interface: {e}"]
                self.created = True
                settings = DeviceUpdate(private_key=spec.private_key, listen_port=spec.listen_port,
                                        replace_peers=True)
                peers = [_full(p) for p in spec.peers.values()]
                ops = [LinkOp("up"), *(LinkOp("rule_add", f) for f in sorted(_families(spec.routes))),
                       *(LinkOp("route_add", c) for c in sorted(spec.routes))]
            elif isinstance(change, DeviceSettingsSynced):
                settings = DeviceUpdate(private_key=spec.private_key, listen_port=spec.listen_port)
            elif isinstance(change, PeerSynced):
                want = spec.peers.get(change.public_key)
                peers.append(_full(want) if want is not None else PeerUpdate(change.public_key, remove=True))
            elif isinstance(change, RoutingRuleAdded):
                ops.append(LinkOp("rule_add", change.family))
            elif isinstance(change, LinkUp):
                ops.append(LinkOp("up"))
            elif isinstance(change, RouteSynced):
                ops.append(LinkOp("route_add" if change.add else "route_del", change.cidr))
        update = replace(settings, peers=tuple(peers))
        if not update.is_empty():
            try:
                await self.backend.apply(update)
            except WireGuardError as e:
                errors.append(f"{spec.part} {spec.name}: configuring the device: {e}")
        for op, error in await self.links.apply(ops):
            errors.append(f"{spec.part} {spec.name}: {op.action} {op.value or ''}: {error}".replace("  ", " "))
        for forward in spec.forwarding:
            try:
                self.ledger.enable(forward, spec.name)
            except (OSError, ValueError) as e:
                errors.append(f"{spec.part}: cannot turn on forwarding for {forward.interface}: {e}")
        return errors

    async def remove(self) -> list[str]:
        """Delete the device and put back the forwarding it held. When the device cannot be deleted, it stays
        `created` (and its knobs held): the next converge tries again."""
        try:
            if await self.backend.observe() is not None:
                await self.backend.ensure_device()  # a device an earlier plexd left: adopted, so it can be stopped
            await self.backend.delete_device()
            await self.links.delete_link()
        except (PlexdError, OSError) as e:
            return [f"removing {self.name}: {e}; tried again at the next converge"]
        self.created = False
        return self.ledger.release(self.name)


def _forwarding(spec: InterfaceSpec, seen: InterfaceSeen, but: str = "") -> list[Change]:
    """A knob off or a limit not as wanted, on each interface `spec` needs forwarding on (`but` aside)."""
    changes: list[Change] = []
    for interface in (f.interface for f in spec.forwarding if f.interface != but):
        if interface in seen.forwarding_off:
            changes.append(ForwardingEnabled(spec.part, spec.name, on=interface))
        elif interface in seen.limits_drift:
            changes.append(ForwardingLimited(spec.part, spec.name, on=interface, what=seen.limits_drift[interface]))
    return changes


def _families(routes: frozenset[str]) -> set[int]:
    """The address families of `routes` (each needs the rule that sends lookups to the mesh table)."""
    return {6 if ":" in r else 4 for r in routes}


def _full(peer: PeerConfig) -> PeerUpdate:
    return PeerUpdate(public_key=peer.public_key, endpoint=peer.endpoint or None, allowed_ips=peer.allowed_ips,
                      psk=peer.psk, persistent_keepalive=peer.persistent_keepalive or None)
