"""The mesh interface's link state: addresses, MTU, up/down and routes for peers' allowed IPs (raw rtnetlink,
plexd.machine.rtnl).

Mesh routes live in a routing table of their own (`mesh.route_table`, default 5182), looked up through one policy
rule per address family (`mesh.route_rule_priority`) before the main table: plexd never adds, replaces or deletes
a main-table route, so a control plane cannot overwrite the machine's own routes, and removing plexd's table
leaves the machine's routing as it was. A route via the mesh interface found in the main table (put there by
hand, or by a plexd before this design) is drift and moves to the mesh table.

Same two verbs as every adapter: `observe()` reads the live link, `apply(ops)` performs the minimal operations the
plan asked for, in order, as one batch of netlink requests. Blocking netlink calls run in a worker thread, but an
event's few route writes, which take tens of microseconds, run on the event loop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from plexd.base.errors import PlexdError
from plexd.machine.rtnl import (
    Address,
    Link,
    Message,
    Rule,
    Where,
    address_write,
    dump_addresses,
    dump_links,
    dump_routes,
    dump_rules,
    link_delete,
    link_names,
    link_set,
    route_write,
    rule_write,
    session,
    write,
)

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

    # -- observe ------------------------------------------------------------------------------------------

    async def underlay(self) -> Underlay:
        """This machine's addresses outside the mesh interface and its default gateways: what must never be
        routed into the tunnel."""
        return await asyncio.to_thread(self._underlay)

    def _underlay(self) -> Underlay:
        try:
            with session(self.netns) as sock:
                names = link_names(sock)
                mesh = {index for index, name in names.items() if name == self.interface}
                on = {(f"{a.address}/{a.prefixlen}", names.get(a.index, "")) for a in dump_addresses(sock)
                      if a.index not in mesh and not _ipv6_link_local(a)}
                gateways = {gateway for family in (socket.AF_INET, socket.AF_INET6)
                            for r in dump_routes(family, sock)
                            if r.table == MAIN_TABLE and r.default and r.oif not in mesh for gateway in r.gateways}
        except (OSError, ValueError) as e:  # RouteDumpError is an OSError
            raise LinkError(f"cannot list this machine's addresses and routes: {e}") from None
        return Underlay(frozenset(address for address, _ in on), frozenset(gateways), frozenset(on))

    async def observe(self) -> LinkState | None:
        return await asyncio.to_thread(self._observe)

    def _observe(self) -> LinkState | None:
        try:
            with session(self.netns) as sock:  # seven dumps, one socket
                link = next((k for k in dump_links(sock) if k.name == self.interface), None)
                if link is None:
                    return None
                state = self._read(link, sock)
                # Gone while it was read (its wireguard-go died): absent, as it will be at the next look, rather
                # than a link without addresses or routes that the plan would try to fill.
                return state if self._index(sock) == link.index else None
        except OSError as e:  # a dump the kernel refused, or kept changing (RouteDumpError)
            raise LinkError(f"cannot read {self.interface}: {e.strerror or e}") from None

    def _read(self, link: Link, sock: socket.socket) -> LinkState:
        index = link.index
        addresses = {f"{a.address}/{a.prefixlen}" for a in dump_addresses(sock)
                     if a.index == index and not _ipv6_link_local(a)}
        routes: set[str] = set()
        main_routes: set[str] = set()
        for family in (socket.AF_INET, socket.AF_INET6):  # one dump each, every table
            for r in dump_routes(family, sock):
                if r.oif != index or r.protocol == RTPROT_KERNEL or r.type != 1:
                    continue  # ours: unicast via the mesh interface, not added by the kernel itself
                if r.table == self.table:
                    routes.add(r.dst)
                elif r.table == MAIN_TABLE:
                    main_routes.add(r.dst)
        return LinkState(index=index, kind=link.kind, mtu=link.mtu, up=link.up, addresses=frozenset(addresses),
                         routes=frozenset(routes), main_routes=frozenset(main_routes), rules=self._rules(sock))

    async def observe_rules(self) -> frozenset[int]:
        """The address families whose rule to the mesh table exists (rules do not go away with the interface)."""
        def read() -> frozenset[int]:
            try:
                return self._rules()
            except OSError as e:
                raise LinkError(f"cannot list the routing rules: {e.strerror or e}") from None

        return await asyncio.to_thread(read)

    def _rules(self, where: Where = None) -> frozenset[int]:
        where = self.netns if where is None else where
        return frozenset(version for version, family in FAMILY.items()
                         if any(self._is_our_rule(rule) for rule in dump_rules(family, where)))

    def _is_our_rule(self, rule: Rule) -> bool:
        return rule.table == self.table and rule.priority == self.rule_priority and rule.action == 1

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
        requests: list[tuple[LinkOp, Message]] = []
        for op in ops:
            try:
                requests.append((op, self._message(index, op)))
            except ValueError as e:  # not an address or a network: named, and the rest still run
                failures.append((op, str(e)))
        try:
            codes = write([m for _, m in requests], self.netns)
        except OSError as e:
            return failures + [(op, f"netlink: {e.strerror or e}") for op, _ in requests]
        for (op, _), code in zip(requests, codes, strict=True):
            # Already there / already gone means the goal is met (another actor raced us).
            if code and not _goal_met(op, code):
                failures.append((op, f"{os.strerror(code)} (errno {code})"))
        return failures

    def _index(self, where: Where = None) -> int | None:
        try:
            if self.netns is None:
                return socket.if_nametoindex(self.interface)
            names = link_names(self.netns if where is None else where)
            return next((i for i, name in names.items() if name == self.interface), None)
        except OSError:
            return None

    def _message(self, index: int, op: LinkOp) -> Message:
        if op.action == "mtu":
            return link_set(index, mtu=int(op.value or 0))
        if op.action == "up":
            return link_set(index, up=True)
        if op.action in ("addr_add", "addr_del"):
            return address_write(op.action == "addr_add", index, str(op.value))
        if op.action in ("route_add", "route_del"):  # add is replace: only ever in the mesh table
            return route_write(op.action == "route_add", str(op.value), index, self.table)
        if op.action == "main_route_del":  # any scope: a route added by hand (`ip route add`) has scope link
            return route_write(False, str(op.value), index, MAIN_TABLE)
        if op.action == "rule_add":
            return rule_write(True, int(op.value or 4), self.table, self.rule_priority)
        raise ValueError(f"unknown link operation {op.action}")  # pragma: no cover - LinkAction is closed

    async def delete_link(self) -> None:
        """The interface goes (its routes with it), and the rules with it unless the mesh table still holds routes
        (another plexd interface on this machine uses them)."""
        await asyncio.to_thread(self._delete)

    def _delete(self) -> None:
        index = self._index()
        try:
            if index is not None:
                (code,) = write([link_delete(index)], self.netns)
                if code and code != errno.ENODEV:
                    raise LinkError(f"cannot delete {self.interface}: {os.strerror(code)}")
            if any(r.table == self.table for family in FAMILY.values() for r in dump_routes(family, self.netns)):
                return
            for version in self._rules():
                (code,) = write([rule_write(False, version, self.table, self.rule_priority)], self.netns)
                if code and code != errno.ENOENT:
                    raise LinkError(f"cannot remove the rule to routing table {self.table}: {os.strerror(code)}")
        except OSError as e:
            raise LinkError(f"cannot remove {self.interface} and its rules: {e.strerror or e}") from None


_ROUTE_WRITES = frozenset({"route_add", "route_del", "main_route_del"})
INLINE_ROUTES = 16  # route writes done on the event loop itself (tens of µs each); more go to a worker thread


def _ipv6_link_local(address: Address) -> bool:
    """The kernel's own addresses on every IPv6 link: neither ours nor the machine's to protect."""
    return address.family == socket.AF_INET6 and address.scope == RT_SCOPE_LINK


def _goal_met(op: LinkOp, code: int) -> bool:
    """An add that found it there, or a delete that found it gone: another actor raced us to the same end."""
    return (op.action.endswith("_add") and code == errno.EEXIST) or (
        op.action.endswith("_del") and code in (errno.ESRCH, errno.EADDRNOTAVAIL, errno.ENOENT))
