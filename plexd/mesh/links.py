"""The mesh interface's link state: addresses, MTU, up/down and routes for peers' allowed IPs (pyroute2).

Mesh routes live in a routing table of their own (`mesh.route_table`, default 5182), looked up through one policy
rule per address family (`mesh.route_rule_priority`) before the main table: plexd never adds, replaces or deletes
a main-table route, so a control plane cannot overwrite the machine's own routes, and removing plexd's table
leaves the machine's routing as it was. A route via the mesh interface found in the main table (put there by
hand, or by a plexd before this design) is drift and moves to the mesh table.

Same two verbs as every adapter: `observe()` reads the live link, `apply(ops)` performs the minimal operations the
plan asked for. Blocking netlink calls run in a worker thread. `observe()` opens an `IPRoute` per call; `apply()`
keeps one in the daemon's own namespace (an event's apply is a route or two: the open was a third of its cost),
closed on any error and at teardown.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from plexd.base.errors import PlexdError
from plexd.mesh.rtnl import RouteDumpError, RouteWrite, dump_addresses, dump_links, dump_routes, write_routes

log = logging.getLogger(__name__)

MAIN_TABLE = 254
DEFAULT_TABLE = 5182
DEFAULT_RULE_PRIORITY = 5182  # before main (32766); after local (0) and the low numbers other tools take
RTPROT_KERNEL = 2
RT_SCOPE_LINK = 253
WIREGUARD_KINDS = frozenset({"wireguard", "tun"})  # wireguard-go's device is a TUN


class LinkError(PlexdError):
    """The mesh interface could not be read or changed."""


@dataclass(frozen=True)
class LinkState:
    """The live link. `addresses` are `addr/prefix` strings; `routes` are destination CIDRs routed via the link
    in the mesh table; `main_routes` those routed via the link in the main table (excluding the kernel's own
    prefix routes); `rules` the address families (4, 6) whose rule to the mesh table exists."""

    index: int
    kind: str
    mtu: int
    up: bool
    addresses: frozenset[str] = frozenset()
    routes: frozenset[str] = frozenset()
    main_routes: frozenset[str] = frozenset()
    rules: frozenset[int] = frozenset()

    @property
    def is_wireguard(self) -> bool:
        return self.kind in WIREGUARD_KINDS


LinkAction = Literal["mtu", "up", "addr_add", "addr_del", "route_add", "route_del", "main_route_del", "rule_add"]


@dataclass(frozen=True)
class LinkOp:
    action: LinkAction
    value: str | int | None = None


def _addr_args(cidr: str) -> dict:
    iface = ipaddress.ip_interface(cidr)
    args: dict = {"address": str(iface.ip), "prefixlen": iface.network.prefixlen}
    if iface.version == 6:
        args["flags"] = 0x02  # IFA_F_NODAD: DAD would keep the address tentative for ~2 s
    return args


@dataclass(frozen=True)
class Underlay:
    """This machine outside the mesh: its addresses as `addr/prefix` (IPv6 link-local left out) and the gateways
    of its default routes."""

    addresses: frozenset[str] = frozenset()
    gateways: frozenset[str] = frozenset()
    on: frozenset[tuple[str, str]] = frozenset()  # (address, interface name): where each address is


FAMILY = {4: socket.AF_INET, 6: socket.AF_INET6}


class Links:
    def __init__(self, interface: str, netns: str | None = None, *, table: int = DEFAULT_TABLE,
                 rule_priority: int = DEFAULT_RULE_PRIORITY) -> None:
        self.interface = interface
        self.netns = netns
        self.table = table
        self.rule_priority = rule_priority
        # apply() keeps one netlink socket in this namespace (opening one per call was a third of an event's
        # apply); dropped on any error and opened again. In another namespace (tests) each call opens its own.
        self._apply_ipr: IPRoute | None = None
        self._apply_lock = threading.Lock()

    def _ipr(self) -> IPRoute:
        try:
            return IPRoute(netns=self.netns) if self.netns else IPRoute()
        except (OSError, NetlinkError) as e:
            raise LinkError(f"cannot open netlink for {self.interface}: {e}") from None

    # -- observe ------------------------------------------------------------------------------------------

    async def underlay(self) -> Underlay:
        """This machine's addresses outside the mesh interface and its default gateways: what must never be
        routed into the tunnel."""
        return await asyncio.to_thread(self._underlay)

    def _underlay(self) -> Underlay:
        # Raw dumps (plexd.mesh.rtnl): read before every state pull, where opening an IPRoute cost more than
        # the reading.
        try:
            names = dump_links(self.netns)
            mesh = {index for index, name in names.items() if name == self.interface}
            on = {(f"{a.address}/{a.prefixlen}", names.get(a.index, "")) for a in dump_addresses(self.netns)
                  if a.index not in mesh and not (a.family == socket.AF_INET6 and a.scope == RT_SCOPE_LINK)}
            gateways = {gateway for family in (socket.AF_INET, socket.AF_INET6)
                        for r in dump_routes(family, self.netns)
                        if r.table == MAIN_TABLE and r.default and r.oif not in mesh for gateway in r.gateways}
        except (OSError, ValueError) as e:  # RouteDumpError is an OSError
            raise LinkError(f"cannot list this machine's addresses and routes: {e}") from None
        return Underlay(frozenset(address for address, _ in on), frozenset(gateways), frozenset(on))

    async def observe(self) -> LinkState | None:
        return await asyncio.to_thread(self._observe)

    def _observe(self) -> LinkState | None:
        with self._ipr() as ipr:
            try:
                found = ipr.link_lookup(ifname=self.interface)
            except NetlinkError as e:
                raise LinkError(f"cannot look up {self.interface}: {e}") from None
            if not found:
                return None
            try:
                return self._read(ipr, found[0])
            except NetlinkError as e:
                if e.code == errno.ENODEV:  # gone between the lookup and the read (its wireguard-go died)
                    return None
                raise LinkError(f"cannot read {self.interface}: {e}") from None
            except RouteDumpError as e:
                raise LinkError(f"cannot read the routes of {self.interface}: {e}") from None

    def _read(self, ipr: Any, index: int) -> LinkState:
        (link,) = ipr.get_links(index)
        kind = link.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND") or ""
        addresses = set()
        for a in ipr.get_addr(index=index):
            if a["family"] == 10 and a["scope"] == RT_SCOPE_LINK:
                continue  # IPv6 link-local: the kernel's, not ours
            addresses.add(f"{a.get('IFA_ADDRESS')}/{a['prefixlen']}")
        routes: set[str] = set()
        main_routes: set[str] = set()
        for family in (socket.AF_INET, socket.AF_INET6):  # one dump each, every table (see plexd.mesh.rtnl)
            for r in dump_routes(family, self.netns):
                if r.oif != index or r.protocol == RTPROT_KERNEL or r.type != 1:
                    continue  # ours: unicast via the mesh interface, not added by the kernel itself
                if r.table == self.table:
                    routes.add(r.dst)
                elif r.table == MAIN_TABLE:
                    main_routes.add(r.dst)
        rules = self._rules(ipr)
        return LinkState(index=index, kind=kind, mtu=link.get("IFLA_MTU") or 0, up=bool(link["flags"] & 1),
                         addresses=frozenset(addresses), routes=frozenset(routes),
                         main_routes=frozenset(main_routes), rules=frozenset(rules))

    async def observe_rules(self) -> frozenset[int]:
        """The address families whose rule to the mesh table exists (rules do not go away with the interface)."""
        def read() -> frozenset[int]:
            with self._ipr() as ipr:
                try:
                    return self._rules(ipr)
                except NetlinkError as e:
                    raise LinkError(f"cannot list the routing rules: {e}") from None

        return await asyncio.to_thread(read)

    def _rules(self, ipr: Any) -> frozenset[int]:
        return frozenset(version for version, family in FAMILY.items()
                         if any(self._is_our_rule(rule) for rule in ipr.get_rules(family=family)))

    def _is_our_rule(self, rule: Any) -> bool:
        table = rule.get("FRA_TABLE") or rule["table"]
        return table == self.table and (rule.get("FRA_PRIORITY") or 0) == self.rule_priority and rule["action"] == 1

    # -- apply --------------------------------------------------------------------------------------------

    async def apply(self, ops: Sequence[LinkOp]) -> list[tuple[LinkOp, str]]:
        """Run the operations in order; returns (op, error) for each one that failed (the rest still run)."""
        if not ops:
            return []
        if len(ops) <= INLINE_ROUTES and self.netns is None and all(op.action in _ROUTE_WRITES for op in ops):
            return self._apply(list(ops))  # an event's few routes: one raw send, cheaper than a thread hop
        return await asyncio.to_thread(self._apply, list(ops))

    def _apply(self, ops: list[LinkOp]) -> list[tuple[LinkOp, str]]:
        index = self._index()
        if index is None:
            return [(op, f"interface {self.interface} does not exist") for op in ops]
        failures: list[tuple[LinkOp, str]] = []
        start = 0
        while start < len(ops):  # in order: runs of route writes in one raw batch, the rest through pyroute2
            routes = ops[start].action in _ROUTE_WRITES
            end = start
            while end < len(ops) and (ops[end].action in _ROUTE_WRITES) == routes:
                end += 1
            run = ops[start:end]
            failures += self._write_routes(index, run) if routes else self._apply_pyroute2(index, run)
            start = end
        return failures

    def _index(self) -> int | None:
        try:
            if self.netns is None:
                return socket.if_nametoindex(self.interface)
            return next((i for i, name in dump_links(self.netns).items() if name == self.interface), None)
        except OSError:
            return None

    def _write_routes(self, index: int, ops: list[LinkOp]) -> list[tuple[LinkOp, str]]:
        failures: list[tuple[LinkOp, str]] = []
        writes: list[tuple[LinkOp, RouteWrite]] = []
        for op in ops:
            try:
                ipaddress.ip_network(str(op.value), strict=False)
            except ValueError as e:
                failures.append((op, str(e)))
                continue
            writes.append((op, RouteWrite(op.action == "route_add", str(op.value), index,
                                          MAIN_TABLE if op.action == "main_route_del" else self.table)))
        try:
            codes = write_routes([w for _, w in writes], self.netns)
        except OSError as e:
            return failures + [(op, f"netlink: {e.strerror or e}") for op, _ in writes]
        for (op, _), code in zip(writes, codes, strict=True):
            # Already there / already gone means the goal is met (another actor raced us).
            if code and not _goal_met(op, code):
                failures.append((op, f"{os.strerror(code)} (errno {code})"))
        return failures

    def _apply_pyroute2(self, index: int, ops: list[LinkOp]) -> list[tuple[LinkOp, str]]:
        if self.netns:
            with self._ipr() as ipr:
                return self._apply_with(ipr, index, ops)
        with self._apply_lock:
            if self._apply_ipr is None:
                self._apply_ipr = self._ipr()
            try:
                return self._apply_with(self._apply_ipr, index, ops)
            except Exception:
                self._apply_ipr.close()
                self._apply_ipr = None
                raise

    def _apply_with(self, ipr: IPRoute, index: int, ops: list[LinkOp]) -> list[tuple[LinkOp, str]]:
        failures: list[tuple[LinkOp, str]] = []
        for op in ops:
            try:
                self._one(ipr, index, op)
            except NetlinkError as e:
                if not _goal_met(op, e.code):
                    failures.append((op, f"{e.args[1] if len(e.args) > 1 else e} (errno {e.code})"))
        return failures

    def close(self) -> None:
        with self._apply_lock:
            if self._apply_ipr is not None:
                self._apply_ipr.close()
                self._apply_ipr = None

    def _one(self, ipr: IPRoute, index: int, op: LinkOp) -> None:
        if op.action == "mtu":
            ipr.link("set", index=index, mtu=int(op.value or 0))
        elif op.action == "up":
            ipr.link("set", index=index, state="up")
        elif op.action == "addr_add":
            ipr.addr("add", index=index, **_addr_args(str(op.value)))
        elif op.action == "addr_del":
            args = _addr_args(str(op.value))
            args.pop("flags", None)
            ipr.addr("del", index=index, **args)
        elif op.action == "rule_add":
            ipr.rule("add", table=self.table, priority=self.rule_priority, family=FAMILY[int(op.value or 4)])
        else:  # pragma: no cover - LinkAction is closed; routes go by _write_routes
            raise ValueError(op.action)

    async def delete_link(self) -> None:
        """The interface goes (its routes with it), and the rules with it unless the mesh table still holds routes
        (another plexd interface on this machine uses them)."""
        await asyncio.to_thread(self._delete)

    def _delete(self) -> None:
        with self._ipr() as ipr:
            found = ipr.link_lookup(ifname=self.interface)
            if found:
                try:
                    ipr.link("del", index=found[0])
                except NetlinkError as e:
                    if e.code != errno.ENODEV:
                        raise LinkError(f"cannot delete {self.interface}: {e}") from None
            self._delete_rules(ipr)

    def _delete_rules(self, ipr: IPRoute) -> None:
        try:
            if any(ipr.get_routes(family=family, table=self.table) for family in FAMILY.values()):
                return
            for family in FAMILY.values():
                for rule in ipr.get_rules(family=family):
                    if self._is_our_rule(rule):
                        ipr.rule("del", table=self.table, priority=self.rule_priority, family=family)
        except NetlinkError as e:
            raise LinkError(f"cannot remove the rules to routing table {self.table}: {e}") from None


_ROUTE_WRITES = frozenset({"route_add", "route_del", "main_route_del"})
INLINE_ROUTES = 16  # route writes done on the event loop itself (tens of µs each); more go to a worker thread


def _goal_met(op: LinkOp, code: int) -> bool:
    """An add that found it there, or a delete that found it gone: another actor raced us to the same end."""
    return (op.action.endswith("_add") and code == errno.EEXIST) or (
        op.action.endswith("_del") and code in (errno.ESRCH, errno.EADDRNOTAVAIL, errno.ENOENT))
