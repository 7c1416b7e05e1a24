"""What the route guard protects on this machine: the control plane, this machine's addresses, LANs, default
gateways and DNS resolvers.

Read at start and before every state pull (addresses change: DHCP, a second NIC, a new control-plane IP behind
DNS, a new resolver), and handed to the desired model as `RouteLimits` (see `plexd.state.route_limits`). A lookup
that fails keeps what was known before: failing to learn an address must not open a route it protects.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import replace
from urllib.parse import urlsplit

from plexd.base.errors import PlexdError
from plexd.config.settings import Config
from plexd.machine.links import Links, Underlay
from plexd.state.route_limits import ALWAYS_GUARDED, Guarded, RouteLimits, address, network

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT = 3.0
RESOLV_CONF = "/etc/resolv.conf"
RESOLV_CONF_MAX = 64 * 1024  # a resolv.conf is a few lines; never read an arbitrary file whole


class ProtectedAddresses:
    def __init__(self, api_url: str, links: Links, *, allow_exit_routes: bool = False,
                 allow_routes: Iterable[str] = (), max_route_percent: float | None = None,
                 resolv_conf: str = RESOLV_CONF) -> None:
        self.host = urlsplit(api_url).hostname or ""
        self.links = links
        self.resolv_conf = resolv_conf
        allow = tuple(n for n in (network(a) for a in allow_routes) if n is not None)
        self._base = RouteLimits(allow_exit_routes=allow_exit_routes, allow=allow)
        if max_route_percent is not None:
            self._base = replace(self._base, max_route_percent=max_route_percent)
        self._control_plane: set[str] = set()
        self._underlay = Underlay()
        self._resolvers: set[str] = set()

    @classmethod
    def from_config(cls, config: Config, links: Links) -> ProtectedAddresses:
        mesh = config.mesh
        return cls(config.api.url, links, allow_exit_routes=mesh.allow_exit_routes, allow_routes=mesh.allow_routes,
                   max_route_percent=mesh.max_route_percent)

    @property
    def current(self) -> RouteLimits:
        own = {a.partition("/")[0] for a in self._underlay.addresses}
        addrs = {address(a) for a in self._control_plane | own}
        guarded = [*self._named(self._resolvers, "the DNS resolver"),
                   *self._named(self._underlay.gateways, "the default gateway"),
                   *self._lans(), *ALWAYS_GUARDED]
        return replace(self._base, protected=frozenset(a for a in addrs if a is not None), guarded=tuple(guarded))

    @staticmethod
    def _named(addresses: Iterable[str], what: str) -> list[Guarded]:
        found = (address(a) for a in sorted(addresses))
        return [Guarded(ipaddress.ip_network(a), f"{what} {a}") for a in found if a is not None]

    def _lans(self) -> list[Guarded]:
        lans = set()
        for text in self._underlay.addresses:
            net = network(text)
            if net is not None and net.num_addresses > 1:  # a /32 is the address itself: protected already
                lans.add(net)
        return [Guarded(n, f"this node's LAN {n}") for n in sorted(lans, key=lambda n: (n.version, n))]

    async def refresh(self) -> RouteLimits:
        await asyncio.gather(self._refresh_control_plane(), self._refresh_underlay(),
                             asyncio.to_thread(self._refresh_resolvers))
        return self.current

    async def _refresh_control_plane(self) -> None:
        if not self.host:
            return
        if address(self.host) is not None:
            self._control_plane = {self.host}
            return
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT):
                infos = await asyncio.get_running_loop().getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
            self._control_plane = {str(info[4][0]).partition("%")[0] for info in infos}
        except (OSError, TimeoutError) as exc:
            log.debug("cannot resolve the control plane %s (%s); keeping %s", self.host, exc,
                      sorted(self._control_plane) or "nothing")

    async def _refresh_underlay(self) -> None:
        try:
            self._underlay = await self.links.underlay()
        except PlexdError as exc:
            log.warning("cannot read this machine's addresses (%s); keeping the last known ones", exc)

    def _refresh_resolvers(self) -> None:
        try:
            with open(self.resolv_conf, "rb") as f:
                text = f.read(RESOLV_CONF_MAX).decode("utf-8", "replace")
        except FileNotFoundError:
            self._resolvers = set()
            return
        except OSError as exc:
            log.warning("cannot read %s (%s); keeping the last known resolvers", self.resolv_conf, exc)
            return
        self._resolvers = parse_nameservers(text)


def parse_nameservers(text: str) -> set[str]:
    """The `nameserver` addresses of a resolv.conf (a scope suffix dropped; anything else ignored)."""
    found = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            ip = address(parts[1].partition("%")[0])
            if ip is not None:
                found.add(str(ip))
    return found


