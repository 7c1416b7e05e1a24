"""The NAT service: discover the public endpoint, refresh for ever; the control plane is told through the engine.

    start      the assembly binds the listen port before the device exists (`PortHandover`): the first
               discovery asks from it, then lets the device have the port (at most HANDOVER_DEADLINE later)
    refresh    every nat_traversal.refresh_interval, from a raw socket while the device holds the port
    failure    retried with jittered backoff, never abandoned (the Go agent gives up after a failed start);
               logged once per failure streak, with each server and why
    no answer  until a server has answered, the node's endpoint is its local one (type unknown), so a node on a
               public address joins even with every STUN server unreachable
    report     not here: `current()` is what the NAT domain (`plexd.nat.endpoint_domain`) converges the control plane's
               record to; when it changes, `on_change` asks the engine for a converge

`status()` is the discovery's part of the `nat` section of `plexd status` (the domain adds what was reported).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from plexd.base.backoff import Backoff
from plexd.config.settings import NatTraversalConfig
from plexd.nat.discovery import Discovery, discover
from plexd.nat.endpoint_domain import Endpoint
from plexd.nat.probe import BoundTransport, RawTransport, Transport, source_address
from plexd.nat.servers import StunServer, resolve
from plexd.nat.stun import Mapped, StunError

log = logging.getLogger(__name__)

HANDOVER_DEADLINE = 3.5  # seconds the device may wait for the first discovery at start
HANDOVER_TIMEOUT = 1.5  # per server, during the hand-over: two servers fit before the deadline


class PortHandover:
    """The listen port, bound by the assembly before any converge, lent to the first discovery.

    The mesh awaits `released()` before its first converge: the device binds the port only after the discovery
    let it go, and never waits more than `deadline` seconds (a timer releases it)."""

    def __init__(self, transport: BoundTransport, deadline: float = HANDOVER_DEADLINE) -> None:
        self._transport: BoundTransport | None = transport
        self._released = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + deadline
        self._timer = loop.call_later(deadline, self.release)

    @classmethod
    def try_bind(cls, port: int, deadline: float = HANDOVER_DEADLINE) -> PortHandover | None:
        """None when the port is taken (the device survived the last plexd): refreshes need no hand-over."""
        try:
            return cls(BoundTransport.bind(port), deadline)
        except OSError as exc:
            log.debug("listen port %d is taken (%s): discovering through a raw socket", port, exc)
            return None

    def take(self) -> BoundTransport | None:
        return self._transport

    def remaining(self) -> float:
        """Seconds until the device gets the port regardless (what the first discovery may take)."""
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def release(self) -> None:
        self._timer.cancel()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._released.set()

    async def released(self) -> None:
        await self._released.wait()


@dataclass
class NatState:
    """What the service knows, for status and heartbeat."""

    discovery: Discovery | None = None  # the last successful one
    last_attempt_at: float | None = None
    last_success_at: float | None = None
    last_error: str = ""
    consecutive_failures: int = 0
    local: Endpoint | None = None  # the local endpoint, while no server has answered yet


class NatService:
    def __init__(
        self,
        servers: Sequence[StunServer],
        listen_port: int,
        on_change: Callable[[str], None] = lambda why: None,
        *,
        refresh_interval: float = 60.0,
        timeout: float = 5.0,
        handover: PortHandover | None = None,
        local_target: Callable[[], str | None] = lambda: None,
        backoff: Backoff | None = None,
        raw_transport: Callable[[int], Transport] = RawTransport,
    ) -> None:
        self.servers = tuple(servers)
        self.listen_port = listen_port
        self._on_change = on_change  # the endpoint to report changed: the engine converges the NAT domain
        self.refresh_interval = refresh_interval
        self.timeout = timeout
        self._handover = handover
        self._local_target = local_target  # the host routed to for the local address when no server answers
        self._backoff = backoff or Backoff(base=min(5.0, refresh_interval), cap=refresh_interval)
        self._raw_transport = raw_transport
        self.state = NatState()
        self._failing: set[str] = set()  # servers whose last attempt failed

    async def run(self) -> None:
        try:
            while True:
                delay = await self.refresh_once()
                await asyncio.sleep(delay)
        finally:
            if self._handover is not None:
                self._handover.release()

    async def refresh_once(self) -> float:
        """One discovery; returns the seconds until the next attempt."""
        before = self.current()
        discovery = await self._discover()
        if not discovery.ok and self.state.discovery is None:
            self.state.local = await self._local_endpoint()
        now = self.current()
        if now is not None and now != before:
            self._on_change(f"NAT discovery: public endpoint {now}")
        if discovery.ok:
            self._backoff.reset()
            return self.refresh_interval
        return self._backoff.next_delay()

    def current(self) -> Endpoint | None:
        """What the control plane should know: the last mapping found, or the local endpoint until a server has
        answered (a failed refresh keeps the last mapping); None when neither is known."""
        d = self.state.discovery
        if d is not None:
            return Endpoint(str(d.public), d.nat_type)
        return self.state.local

    async def _discover(self) -> Discovery:
        self.state.last_attempt_at = time.time()
        handover, self._handover = self._handover, None
        lent = handover.take() if handover is not None else None  # None: its deadline passed already
        transport: Transport | None = lent
        timeout = min(HANDOVER_TIMEOUT, self.timeout) if lent is not None else self.timeout
        limit = handover.remaining() if handover is not None and lent is not None else None
        try:
            if transport is None:
                transport = self._raw_transport(self.listen_port)
            # The hand-over ends at its deadline whatever the servers do: the device must get its port.
            servers = self.servers[:2] if lent is not None else self.servers
            async with asyncio.timeout(limit):
                found = await discover(transport, servers, timeout)
        except TimeoutError:
            why = "no answer before the WireGuard device needed the listen port"
            found = Discovery(None, "unknown", failures=tuple((str(s), why) for s in self.servers))
        except OSError as exc:  # no raw socket (no CAP_NET_RAW): every server fails the same way
            why = f"cannot open a raw socket for the listen port: {exc.strerror or exc}"
            found = Discovery(None, "unknown", failures=tuple((str(s), why) for s in self.servers))
        finally:
            if handover is not None:
                handover.release()  # closes the lent socket
            if transport is not None and transport is not lent:
                transport.close()
        self._note(found)
        return found

    def _note(self, found: Discovery) -> None:
        st = self.state
        # Each server's failure is logged when it starts failing, and its recovery when it answers again.
        for server, why in found.failures:
            level = logging.DEBUG if server in self._failing else logging.WARNING
            self._failing.add(server)
            log.log(level, "STUN server %s: %s", server, why, extra={"stun_server": server})
        for server, _ in found.answers:
            if server in self._failing:
                self._failing.discard(server)
                log.info("STUN server %s answers again", server, extra={"stun_server": server})
        if not found.ok:
            st.consecutive_failures += 1
            st.last_error = "; ".join(f"{s}: {why}" for s, why in found.failures) or "no STUN server configured"
            if st.consecutive_failures == 1:  # once per failure streak
                log.warning("NAT discovery failed (%s); the node keeps its local endpoint and retries with backoff",
                            "every configured STUN server failed" if found.failures else "no server")
            return
        before = st.discovery
        st.discovery, st.last_success_at, st.last_error = found, time.time(), ""
        if st.consecutive_failures:
            log.info("NAT discovery works again after %d failed attempt(s)", st.consecutive_failures)
        st.consecutive_failures = 0
        if before is None or (before.public, before.nat_type) != (found.public, found.nat_type):
            was = f" (was {before.public}, {before.nat_type})" if before is not None else ""
            log.info("public endpoint %s, NAT type %s, seen by %s%s", found.public, found.nat_type, found.server, was,
                     extra={"public_endpoint": str(found.public), "nat_type": found.nat_type})

    async def _local_endpoint(self) -> Endpoint | None:
        """The machine's address towards the control plane, and the listen port (type unknown)."""
        host = self._local_target()
        if not host:
            return None
        try:
            ip = await resolve(host)
            local = Mapped(source_address(ip, self.listen_port), self.listen_port)  # any port: only the route counts
        except StunError as exc:
            log.debug("no local endpoint to report: %s", exc)
            return None
        return Endpoint(str(local), "unknown")

    def status(self) -> dict[str, Any]:
        st = self.state
        d = st.discovery
        return {
            "enabled": True,
            "servers": [str(s) for s in self.servers],
            "public_endpoint": str(d.public) if d is not None else "",
            "nat_type": d.nat_type if d is not None else "",
            "local_endpoint": str(d.local) if d is not None and d.local is not None else "",
            "server": d.server if d is not None else "",
            "last_success_at": st.last_success_at,
            "last_attempt_at": st.last_attempt_at,
            "last_error": st.last_error,
            "consecutive_failures": st.consecutive_failures,
            "refresh_interval_seconds": self.refresh_interval,
        }


def disabled_status(config: NatTraversalConfig) -> dict[str, Any] | None:
    """The status's `nat` section when NAT traversal is off, saying why; None when it is on."""
    if not config.enabled:
        return {"enabled": False, "reason": "nat_traversal.enabled is false"}
    if not config.stun_servers:
        return {"enabled": False, "reason": "no nat_traversal.stun_servers configured"}
    return None
