"""The userspace UDP relay: forwards WireGuard traffic for any number of relay sessions on one port.

Routing is the flow table's (`plexd/bridge/flows.py`: by WireGuard index, never by source ip:port alone; handshakes
checked by their mac1 with the sides' public keys). This module owns the socket, the sessions' lifetime and the
status counters:

- A session lives `min(5 min, expires_at - now)` from the moment the control plane last listed it, but only
  while the control plane is reachable (`cp_reachable()`); while it is not, every session is refreshed instead,
  so relayed pairs keep working through an outage (the Go relay dropped them at their TTL).
- A packet that matches no session is dropped and counted, never logged per packet.
- The socket is read in batches: one wake-up of the event loop drains up to `BATCH` datagrams and forwards each
  with a non-blocking `sendto` (asyncio's datagram transport reads one datagram per wake-up, which made the
  loop's own bookkeeping most of the cost of a packet). A full send buffer drops the packet, counted; WireGuard
  retransmits, as it would over any lossy path.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from plexd.base.clock import Clock
from plexd.bridge.fastpath import KernelFastPath
from plexd.bridge.flows import Flow, FlowTable
from plexd.state.relay_block import MAX_TTL_SECONDS, RelaySession

log = logging.getLogger(__name__)

DEFAULT_PORT = 51821
BATCH = 256  # datagrams read per wake-up before the loop serves others
MAX_DATAGRAM = 65535
SOCKET_BUFFER = 4 << 20  # a burst waits in the kernel rather than being dropped
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
        self._socket: socket.socket | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.fastpath: KernelFastPath | None = None
        self._fastpath_task: asyncio.Task[None] | None = None
        self.fastpath_error = ""
        self.send_errors = 0
        self.send_dropped = 0  # the send buffer was full
        self.expired = 0

    # Lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            if sock.family == socket.AF_INET6 and ipaddress.ip_address(self.host).is_unspecified:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # `[::]`: IPv4 sides too
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
                except OSError:
                    pass  # the kernel's cap applies
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self._socket = sock
        self.port = sock.getsockname()[1]
        loop.add_reader(sock.fileno(), self._drain, sock)
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
        self.close_socket()

    def close_socket(self) -> None:
        sock, self._socket = self._socket, None
        if sock is not None and sock.fileno() != -1:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()

    @property
    def listening(self) -> bool:
        return self._socket is not None and self._socket.fileno() != -1

    # Sessions

    def set_sessions(self, sessions: list[RelaySession]) -> None:
        """What the control plane lists now (a full state or the set after an event): each one's lease restarts.
        One already past its `expires_at` is not served at all (a listing the control plane has not pruned)."""
        now = self.clock.now()
        live = [s for s in sessions if s.ttl(now) > 0]
        self.table.set_sessions(live)
        self._leases = {s.session_id: _Lease(now + timedelta(seconds=s.ttl(now))) for s in live}

    def set_peer_keys(self, keys: Mapping[str, str]) -> None:
        """Node id -> WireGuard public key (base64) for the sessions' sides; a session's own keys fill the gaps."""
        self.table.set_peer_keys(keys)

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

    def _drain(self, sock: socket.socket) -> None:
        now = self.clock.monotonic()  # one reading per batch: a batch takes well under a millisecond
        route, recvfrom, sendto = self.table.route, sock.recvfrom, sock.sendto
        # On a dual-stack socket (`[::]`) IPv4 sides arrive as ::ffff:a.b.c.d and must be sent to as such; the
        # sessions name them as a.b.c.d.
        mapped = sock.family == socket.AF_INET6
        for _ in range(BATCH):
            try:
                data, source = recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.send_errors += 1  # an ICMP error reported on the socket: the relay goes on
                return
            host = source[0]
            if mapped and host.startswith("::ffff:"):
                host = host[7:]
            for target in route(data, (host, source[1]), now):
                if mapped and ":" not in target[0]:
                    target = ("::ffff:" + target[0], target[1])
                try:
                    sendto(data, target)
                except BlockingIOError:
                    self.send_dropped += 1
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
                "handshakes_refused": _keyless_reason(flow),
                "idle_seconds": None if c.last_activity is None else round(now - c.last_activity, 3),
            })
        fastpath = None if self.fastpath is None else {
            "installed": self.fastpath.installed, "elements": len(self.fastpath.current), "error": self.fastpath_error}
        return {"listening": self.listening, "port": self.port, "sessions": sessions,
                "dropped": asdict(self.table.drops), "send_errors": self.send_errors,
                "send_dropped": self.send_dropped, "expired": self.expired,
                "fastpath": fastpath}


def _keyless_reason(flow: Flow) -> str | None:
    """Why the session relays no handshake, or None when it does."""
    missing = flow.keyless
    if not missing:
        return None
    return (f"no WireGuard public key for {' and '.join(missing)} (not a peer in the state, and the session names "
            "none): its handshakes' mac1 cannot be checked, so none are relayed")


def _fmt(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
