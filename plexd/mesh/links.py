"""The mesh interface's link state: addresses, MTU, up/down and routes for peers' allowed IPs (pyroute2).

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
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from plexd.errors import PlexdError

log = logging.getLogger(__name__)

MAIN_TABLE = 254
RTPROT_KERNEL = 2
RT_SCOPE_LINK = 253
WIREGUARD_KINDS = frozenset({"wireguard", "tun"})  # wireguard-go's device is a TUN


class LinkError(PlexdError):
    """The mesh interface could not be read or changed."""


@dataclass(frozen=True)
class LinkState:
    """The live link. `addresses` are `addr/prefix` strings; `routes` are destination CIDRs routed via the link
    (main table, excluding the kernel's own prefix routes)."""

    index: int
    kind: str
    mtu: int
    up: bool
    addresses: frozenset[str] = frozenset()
    routes: frozenset[str] = frozenset()

    @property
    def is_wireguard(self) -> bool:
        return self.kind in WIREGUARD_KINDS


LinkAction = Literal["mtu", "up", "addr_add", "addr_del", "route_add", "route_del"]


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


class Links:
    def __init__(self, interface: str, netns: str | None = None) -> None:
        self.interface = interface
        self.netns = netns
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

    async def underlay_addresses(self) -> set[str]:
        """Every address of this machine outside the mesh interface (IPv6 link-local left out): what must never
        be routed into the tunnel."""
        return await asyncio.to_thread(self._underlay_addresses)

    def _underlay_addresses(self) -> set[str]:
        with self._ipr() as ipr:
            try:
                mesh = set(ipr.link_lookup(ifname=self.interface))
                return {str(a.get("IFA_ADDRESS")) for a in ipr.get_addr()
                        if a["index"] not in mesh and a.get("IFA_ADDRESS")
                        and not (a["family"] == 10 and a["scope"] == RT_SCOPE_LINK)}
            except NetlinkError as e:
                raise LinkError(f"cannot list this machine's addresses: {e}") from None

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

    def _read(self, ipr: Any, index: int) -> LinkState:
        (link,) = ipr.get_links(index)
        kind = link.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND") or ""
        addresses = set()
        for a in ipr.get_addr(index=index):
            if a["family"] == 10 and a["scope"] == RT_SCOPE_LINK:
                continue  # IPv6 link-local: the kernel's, not ours
            addresses.add(f"{a.get('IFA_ADDRESS')}/{a['prefixlen']}")
        routes = set()
        for family in (2, 10):
            for r in ipr.get_routes(family=family, table=MAIN_TABLE):
                if r.get("RTA_OIF") != index or r["proto"] == RTPROT_KERNEL or r["type"] != 1:
                    continue
                dst = r.get("RTA_DST") or ("0.0.0.0" if family == 2 else "::")
                routes.add(str(ipaddress.ip_network(f"{dst}/{r['dst_len']}", strict=False)))
        return LinkState(index=index, kind=kind, mtu=link.get("IFLA_MTU") or 0, up=bool(link["flags"] & 1),
                         addresses=frozenset(addresses), routes=frozenset(routes))

    # -- apply --------------------------------------------------------------------------------------------

    async def apply(self, ops: Sequence[LinkOp]) -> list[tuple[LinkOp, str]]:
        """Run the operations in order; returns (op, error) for each one that failed (the rest still run)."""
        if not ops:
            return []
        return await asyncio.to_thread(self._apply, list(ops))

    def _apply(self, ops: list[LinkOp]) -> list[tuple[LinkOp, str]]:
        if self.netns:
            with self._ipr() as ipr:
                return self._apply_with(ipr, ops)
        with self._apply_lock:
            if self._apply_ipr is None:
                self._apply_ipr = self._ipr()
            try:
                return self._apply_with(self._apply_ipr, ops)
            except Exception:
                self._apply_ipr.close()
                self._apply_ipr = None
                raise

    def _apply_with(self, ipr: IPRoute, ops: list[LinkOp]) -> list[tuple[LinkOp, str]]:
        failures: list[tuple[LinkOp, str]] = []
        found = ipr.link_lookup(ifname=self.interface)
        if not found:
            return [(op, f"interface {self.interface} does not exist") for op in ops]
        index = found[0]
        for op in ops:
            try:
                self._one(ipr, index, op)
            except NetlinkError as e:
                # Already there / already gone means the goal is met (another actor raced us).
                if (op.action.endswith("_add") and e.code == errno.EEXIST) or (
                    op.action.endswith("_del") and e.code in (errno.ESRCH, errno.EADDRNOTAVAIL, errno.ENOENT)
                ):
                    continue
                failures.append((op, f"{e.args[1] if len(e.args) > 1 else e} (errno {e.code})"))
        return failures

    def close(self) -> None:
        with self._apply_lock:
            if self._apply_ipr is not None:
                self._apply_ipr.close()
                self._apply_ipr = None

    @staticmethod
    def _one(ipr: IPRoute, index: int, op: LinkOp) -> None:
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
        elif op.action == "route_add":
            ipr.route("replace", dst=str(op.value), oif=index)
        elif op.action == "route_del":
            ipr.route("del", dst=str(op.value), oif=index, table=MAIN_TABLE)
        else:  # pragma: no cover - LinkAction is closed
            raise ValueError(op.action)

    async def delete_link(self) -> None:
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
