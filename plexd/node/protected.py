"""The addresses a control plane may never route into the tunnel: its own and this machine's underlay.

Read at start and before every state pull (addresses change: DHCP, a second NIC, a new control-plane IP behind
DNS), and handed to the desired model as `RouteLimits` (see `plexd.route_limits`). A lookup that fails keeps
what was known before: failing to learn an address must not open a route it protects.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from urllib.parse import urlsplit

from plexd.errors import PlexdError
from plexd.mesh.links import Links
from plexd.route_limits import RouteLimits, address

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT = 3.0


class ProtectedAddresses:
    def __init__(self, api_url: str, links: Links, *, allow_exit_routes: bool = False) -> None:
        self.host = urlsplit(api_url).hostname or ""
        self.links = links
        self.allow_exit_routes = allow_exit_routes
        self._control_plane: set[str] = set()
        self._underlay: set[str] = set()

    @property
    def current(self) -> RouteLimits:
        addrs = {address(a) for a in self._control_plane | self._underlay}
        return RouteLimits(frozenset(a for a in addrs if a is not None), self.allow_exit_routes)

    async def refresh(self) -> RouteLimits:
        await asyncio.gather(self._refresh_control_plane(), self._refresh_underlay())
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
            self._underlay = await self.links.underlay_addresses()
        except PlexdError as exc:
            log.warning("cannot read this machine's addresses (%s); keeping the last known ones", exc)
