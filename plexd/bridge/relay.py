"""The userspace UDP relay: forwards WireGuard traffic for any number of relay sessions on one port.

Routing is the flow table's (`plexd/bridge/flows.py`: by WireGuard index, never by source ip:port alone). This
module owns the socket, the sessions' lifetime and the status counters:

- A session lives `min(5 min, expires_at - now)` from the moment the control plane last listed it, but only
  while the control plane is reachable (`cp_reachable()`); while it is not, every session is refreshed instead,
  so relayed pairs keep working through an outage (the Go relay dropped them at their TTL).
- A packet that matches no session is dropped and counted, never logged per packet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from plexd.bridge.fastpath import KernelFastPath
from plexd.bridge.flows import FlowTable
from plexd.bridge.sessions import MAX_TTL_SECONDS, RelaySession
from plexd.clock import Clock

log = logging.getLogger(__name__)

DEFAULT_PORT = 51821
SWEEP_INTERVAL = 5.0
FASTPATH_SYNC_INTERVAL = 1.0


@dataclass
class _Lease:
    valid_until: datetime


class Relay:
    def __init__(self, host: str = "0.0.0.0", port: int = DEFAULT_PORT, *,
                 cp_reachable: Callable[[], bool] = lambda: True, clock: Clock | None = None) -> None:
        self.host, self.port = host, port
        self.cp_reachable = cp_reachable
        self.clock = clock or Clock()
        self.table = FlowTable()
        self._leases: dict[str, _Lease] = {}
        self._transport: asyncio.DatagramTransport | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.fastpath: KernelFastPath | None = None
        self._fastpath_task: asyncio.Task[None] | None = None
        self.fastpath_error = ""
        self.send_errors = 0
        self.expired = 0

    # Lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=(self.host, self.port))
        self.port = self._transport.get_extra_info("sockname")[1]
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="relay-sweep")
        log.info("relay listening on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        for task in (self._sweeper, self._fastpath_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._sweeper = self._fastpath_task = None
        await self.disable_fastpath()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    @property
    def listening(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    # Sessions

    def set_sessions(self, sessions: list[RelaySession]) -> None:
        """What the control plane lists now (a full state or the set after an event): each one's lease restarts."""
        now = self.clock.now()
        self.table.set_sessions(sessions)
        self._leases = {s.session_id: _Lease(now + timedelta(seconds=s.ttl(now))) for s in sessions}

    def sweep(self) -> list[str]:
        """Expire sessions past their lease while the control plane is reachable; refresh them all while not."""
        now = self.clock.now()
        if not self.cp_reachable():
            for lease in self._leases.values():
                lease.valid_until = max(lease.valid_until, now + timedelta(seconds=MAX_TTL_SECONDS))
            return []
        gone = [sid for sid, lease in self._leases.items() if lease.valid_until <= now]
        for sid in gone:
            del self._leases[sid]
            self.table.remove(sid)
        if gone:
            self.expired += len(gone)
            log.info("relay sessions expired (not listed again by the control plane): %s", ", ".join(gone))
        return gone

    async def _sweep_forever(self) -> None:
        while True:
            await self.clock.sleep(SWEEP_INTERVAL)
            self.sweep()

    # The kernel fast path

    async def enable_fastpath(self, relay_ip: str, fastpath: KernelFastPath | None = None) -> None:
        """Install `inet plexd_relay` and keep its maps equal to the stable flows (synced every second)."""
        self.fastpath = fastpath or KernelFastPath(relay_ip, self.port)
        await asyncio.to_thread(self.fastpath.apply)
        await self.sync_fastpath()
        self._fastpath_task = asyncio.create_task(self._sync_forever(), name="relay-fastpath")

    async def disable_fastpath(self) -> None:
        if self._fastpath_task is not None:
            self._fastpath_task.cancel()
            try:
                await self._fastpath_task
            except asyncio.CancelledError:
                pass
            self._fastpath_task = None
        if self.fastpath is not None and self.fastpath.installed:
            await asyncio.to_thread(self.fastpath.remove)
        self.fastpath = None

    async def sync_fastpath(self) -> None:
        if self.fastpath is None:
            return
        try:
            await asyncio.to_thread(self.fastpath.sync, list(self.table.flows.values()))
            self.fastpath_error = ""
        except Exception as e:  # nftables refused: the userspace relay still forwards everything
            if str(e) != self.fastpath_error:
                log.warning("relay fast path not updated, userspace forwards meanwhile: %s", e)
            self.fastpath_error = str(e)

    async def _sync_forever(self) -> None:
        while True:
            await self.clock.sleep(FASTPATH_SYNC_INTERVAL)
            await self.sync_fastpath()

    # Packets

    def datagram(self, data: bytes, source: tuple[Any, ...]) -> None:
        targets = self.table.route(data, (source[0], source[1]), self.clock.monotonic())
        transport = self._transport
        if transport is None:
            return
        for target in targets:
            try:
                transport.sendto(data, target)
            except OSError:
                self.send_errors += 1

    # Status

    def status(self) -> dict[str, Any]:
        now = self.clock.monotonic()
        sessions = []
        for sid, flow in self.table.flows.items():
            c = flow.counters
            sessions.append({
                "session_id": sid,
                "peer_a_id": flow.sides[0].node_id, "peer_a_address": _fmt(flow.sides[0].address),
                "peer_b_id": flow.sides[1].node_id, "peer_b_address": _fmt(flow.sides[1].address),
                "stable": flow.stable,
                "packets_a_to_b": c.packets_a_to_b, "bytes_a_to_b": c.bytes_a_to_b,
                "packets_b_to_a": c.packets_b_to_a, "bytes_b_to_a": c.bytes_b_to_a,
                "address_changes": c.address_changes,
                "idle_seconds": None if c.last_activity is None else round(now - c.last_activity, 3),
            })
        fastpath = None if self.fastpath is None else {
            "installed": self.fastpath.installed, "elements": len(self.fastpath.current), "error": self.fastpath_error}
        return {"listening": self.listening, "port": self.port, "sessions": sessions,
                "dropped": asdict(self.table.drops), "send_errors": self.send_errors, "expired": self.expired,
                "fastpath": fastpath}


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.relay.datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP unreachable from a side that went away: counted, the relay goes on.
        self.relay.send_errors += 1


def _fmt(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
