"""A domain of bridge WireGuard interfaces: user access (one interface) and site-to-site (one per tunnel) are the
same engine part with a different reading of the desired model.

A `Specs` function turns the desired model and this machine's own networks into the interfaces wanted (by
name) and the refusals; this domain observes each wanted interface and each one it made that is no longer
wanted, plans their differences (`plexd.bridge.wgif`; every change is a drift line), applies them, and removes
what is no longer wanted, putting back the forwarding knobs it turned on. A refusal is an error line naming the
entry; the other entries apply.

Events do not carry these parts' changes (the state pull does): `apply_delta` costs nothing while the part of
the model this domain reads is the same object it last applied, and converges it in full otherwise.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plexd.base.atomicfile import write_atomic
from plexd.base.boundedjson import loads
from plexd.base.errors import WireFormatError
from plexd.bridge.forwarding import ForwardingLedger
from plexd.bridge.once import OnceLog
from plexd.bridge.wgif import InterfaceRemoved, InterfaceSeen, InterfaceSpec, WgInterface
from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.machine.links import Links, Underlay
from plexd.state import route_limits
from plexd.state.desired import DesiredState, endpoint_ip

log = logging.getLogger(__name__)

MAX_MADE = 1 << 14


@dataclass(frozen=True)
class Wanted:
    specs: Mapping[str, InterfaceSpec]
    refused: tuple[str, ...] = ()
    status: Mapping[str, Any] | None = None  # what `status()` adds for these specs (public keys, ...)


Specs = Callable[[DesiredState, Underlay], Wanted]


@dataclass(frozen=True)
class InterfacesSeen:
    wanted: Wanted
    interfaces: Mapping[str, InterfaceSeen]  # by name: the wanted ones and the ones made that are not


class InterfacesDomain:
    touches_machine = True
    acts_while_held = False

    def __init__(self, name: str, part: str, specs: Specs, source: Callable[[DesiredState], object],
                 make_interface: Callable[[str], WgInterface], underlay: Links, ledger: ForwardingLedger,
                 data_dir: str) -> None:
        self.name = name
        self.part = part
        self._specs = specs
        self._source = source  # the part of the model this domain reads: unchanged (same object), nothing to do
        self._make = make_interface
        self._underlay = underlay
        self.ledger = ledger
        self._interfaces: dict[str, WgInterface] = {}
        self._applied: object = None
        self._applied_once = False
        self._last: Wanted = Wanted({})
        self._said = OnceLog(log)
        # The interfaces this domain made, kept across restarts: one no longer wanted after a restart (or at
        # `plexd deregister`, another process) is still found and removed.
        self._made_file = Path(data_dir) / "bridge" / f"{name}.interfaces"
        self._made_saved = self._load_made()  # what the file holds: written again only when it changes
        for made in self._made_saved:
            self._interface(made).created = True

    def _load_made(self) -> list[str]:
        try:
            doc = loads(self._made_file.read_bytes()[:MAX_MADE], str(self._made_file))
        except FileNotFoundError:
            return []
        except (OSError, WireFormatError) as e:
            log.error("%s: cannot read %s (%s): interfaces made before this start are not looked after",
                      self.part, self._made_file, e)
            return []
        return [n for n in doc if isinstance(n, str) and 0 < len(n) <= 15] if isinstance(doc, list) else []

    def _save_made(self) -> None:
        made = sorted(n for n, iface in self._interfaces.items() if iface.created)
        if made != self._made_saved:
            self._made_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomic(self._made_file, json.dumps(made).encode(), mode=0o600)
            self._made_saved = made

    def _interface(self, name: str) -> WgInterface:
        if name not in self._interfaces:
            self._interfaces[name] = self._make(name)
        return self._interfaces[name]

    async def observe(self, desired: DesiredState) -> InterfacesSeen:
        wanted = self._specs(desired, await self._underlay.underlay())
        seen = {}
        for name, spec in wanted.specs.items():
            for forward in spec.forwarding:  # before any removal releases knobs (all domains observe first)
                self.ledger.hold(forward, name)
            seen[name] = await self._interface(name).observe(spec)
        for name, iface in self._interfaces.items():
            if name not in wanted.specs and iface.created:
                device = await iface.backend.observe()
                seen[name] = InterfaceSeen(device, None)
        return InterfacesSeen(wanted, seen)

    def plan(self, desired: DesiredState, observed: InterfacesSeen) -> DomainResult:
        changes: list[Change] = []
        for name, spec in observed.wanted.specs.items():
            changes += self._interfaces[name].plan(spec, observed.interfaces[name])
        for name in observed.interfaces:
            if name not in observed.wanted.specs:
                changes.append(InterfaceRemoved(self.part, name))
        return DomainResult(tuple(changes), observed.wanted.refused)

    async def apply(self, desired: DesiredState, planned: DomainResult, observed: Any) -> DomainResult:
        errors: list[str] = []
        wanted: Wanted = observed.wanted if isinstance(observed, InterfacesSeen) else self._last
        for name, spec in wanted.specs.items():
            mine = [c for c in planned.changes if getattr(c, "interface", None) == name]
            if mine:
                errors += await self._interfaces[name].apply(spec, mine)
        failed: set[str] = set()
        for change in planned.changes:
            if isinstance(change, InterfaceRemoved):
                iface = self._interfaces.get(change.interface)
                if iface is not None:
                    errors += await iface.remove()
                    if iface.created:  # still there: kept (and in the made-file) for the next try
                        failed.add(change.interface)
                    else:
                        del self._interfaces[change.interface]
        self._save_made()
        self._said.errors((*planned.errors, *errors))
        self._last = wanted
        self._applied = self._source(desired)
        self._applied_once = True
        applied = tuple(c for c in planned.changes
                        if not (isinstance(c, InterfaceRemoved) and c.interface in failed))
        return DomainResult(applied, tuple(errors))

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        if self._applied_once and self._source(desired) is self._applied:
            return DomainResult()
        return None

    async def teardown(self) -> None:
        for iface in list(self._interfaces.values()):
            for error in await iface.remove():
                log.error("%s: %s", self.part, error)
        self._interfaces.clear()
        self._save_made()

    def status(self) -> Mapping[str, Any] | None:
        if not self._applied_once:
            return None
        return {**(self._last.status or {}), "interfaces": sorted(self._last.specs),
                "refused": list(self._last.refused)}


def clash_reason(name: str, port: int, mesh_interface: str, taken_ports: Mapping[int, str]) -> str:
    """Why a bridge interface `name` listening on `port` would step on another ("" when it would not): the mesh
    interface's name (its key and peers would be overwritten: the node off the mesh), or a port the mesh, the
    relay or another bridge interface listens on."""
    if name == mesh_interface:
        return f"interface {name} is the mesh interface"
    if port in taken_ports:
        return f"listen_port {port} is {taken_ports[port]}'s"
    return ""


class RouteGuard:
    """The mesh's route guard (`plexd.state.route_limits`), for one bridge part's routes: they go in the mesh's
    routing table, looked up before the main one, so they steer this daemon's own traffic too. Refused whatever
    the block says: the control plane's and this machine's addresses, a mesh peer's endpoint, a prefix another
    of this part's peers or tunnels has; unless the operator allowed it (`mesh.allow_routes`): resolvers,
    gateways, LANs, link-local, the metadata service, and more of the public address space in all than
    `mesh.max_route_percent`."""

    def __init__(self, desired: DesiredState) -> None:
        self._limits = desired.route_limits
        # Private space (RFC 1918, unique-local IPv6) does not count against the share limit: a remote site's
        # 10.0.0.0/8 is an ordinary tunnel, and hijacking it takes no public traffic. Everything else still holds,
        # and the public prefixes' share is counted without the private ones.
        self._private_limits = replace(self._limits, max_route_percent=100.0)
        self._public: dict[route_limits.IPNetwork, str] = {}
        self._public_space = route_limits.RoutedSpace(self._public)
        self._endpoints = desired.endpoint_owners()  # the mesh's own table: relay addresses and shared NATs too
        self._routed: dict[route_limits.IPNetwork, str] = {}
        self._space = route_limits.RoutedSpace(self._routed)

    def reason(self, cidr: str, owner: str, *, endpoint: str = "") -> str:
        """Why `cidr` may not be routed to `owner` ("" when it may). `endpoint`: the owner's own (a tunnel's
        remote end), which its routes must not hold either: the tunnel would carry its own carrier."""
        net = route_limits.network(cidr)
        if net is None:
            return "not a prefix"
        endpoints: Mapping[route_limits.IPAddress, str] = self._endpoints
        own = endpoint_ip(endpoint)
        if own is not None:
            endpoints = {**self._endpoints, own: owner}
        if _private(net):
            return route_limits.refuse_prefix(net, self._private_limits, endpoints, self._routed, None,
                                              self._space) or ""
        return route_limits.refuse_prefix(net, self._limits, endpoints, self._routed, None, self._public_space) or ""

    def claim(self, cidr: str, owner: str) -> None:
        net = route_limits.network(cidr)
        if net is not None and net not in self._routed:
            self._routed[net] = owner
            self._space.add(net)
            if not _private(net):
                self._public[net] = owner
                self._public_space.add(net)


PRIVATE = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))


def _private(net: route_limits.IPNetwork) -> bool:
    """Inside RFC 1918 or unique-local IPv6 (not Python's wider is_private, which holds 240/4 and Teredo)."""
    return any(p.version == net.version and net.subnet_of(p) for p in PRIVATE)  # type: ignore[arg-type]


def own_networks(underlay: Underlay) -> list[Any]:
    """This machine's networks outside the mesh (what no access peer or remote site may claim)."""
    out = []
    for text in underlay.addresses:
        try:
            out.append(ipaddress.ip_interface(text).network)
        except ValueError:
            continue
    return out

