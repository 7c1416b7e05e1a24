"""Watch the node's routes as the kernel announces them (`ip monitor route` inside its namespace).

The event benches time "the peer is on the device" without polling the device: plexd applies an event as one UAPI
`set` and then the route for the peer's new address, so the route's arrival (announced by the kernel the moment
it is added, whatever the mesh size) marks the end of the apply. Polling `get=1` instead would cost a dump of
every peer per probe (over 1 MB at 5,000 peers), which both slows the daemon being measured and blurs the figure.
The benches still check the device itself once at the end.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time


class RouteWatch:
    def __init__(self, netns: str, interface: str = "plexd0") -> None:
        self.netns = netns
        self.interface = interface
        self._routes: set[ipaddress.IPv4Network] = set()
        self._changed = asyncio.Condition()
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> RouteWatch:
        self._proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", self.netns, "ip", "-4", "monitor", "route", stdout=asyncio.subprocess.PIPE)
        self._task = asyncio.create_task(self._read())
        await asyncio.sleep(0.2)  # `ip monitor` subscribes before it prints anything
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._proc is not None and self._task is not None
        self._proc.kill()
        await self._proc.wait()
        self._task.cancel()

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        async for raw in self._proc.stdout:
            words = raw.decode().split()
            if f"dev {self.interface}" not in " ".join(words) or not words:
                continue
            deleted = words[0] == "Deleted"
            try:
                net = ipaddress.IPv4Network(words[1] if deleted else words[0])
            except ValueError:
                continue
            async with self._changed:
                (self._routes.discard if deleted else self._routes.add)(net)
                self._changed.notify_all()

    def covers(self, ip: str) -> bool:
        addr = ipaddress.IPv4Address(ip)
        return any(addr in net for net in self._routes)

    async def wait_covered(self, ip: str, timeout: float) -> float:
        """Wait until a route via the interface covers `ip`; returns time.perf_counter() when it was seen."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.covers(ip)), timeout)
        return time.perf_counter()
