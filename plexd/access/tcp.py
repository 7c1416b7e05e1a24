"""TCP sessions (plexd-access-protocol.md §1.3, `kind: tcp`): a listener of the session's own that forwards to the
session's target and nothing else.

Raw clients (a `psql`, a browser) must keep working, so there is no in-band token, as in the Go agent; what admits
a source is plexd's firewall (a per-session rule for the mesh peers the policy allows, added by the engine), and
the listener binds the node's mesh IP only, never all interfaces. Unlike Go (one connection at a time), up to
`max_connections` run at once; one more is closed at once and counted. Bytes are spliced in the kernel
(`plexd.access.splice`).

Activity (§1.4) goes to `report(session_id, body)`: `session_started` with the `listener_endpoint` once the
listener is bound, and `session_ended` with the bytes each way and `terminated_by` (`ttl_expired`,
`idle_timeout`, `plexd_close`, `operator_revoke`) when it closes. `bytes_in` is operator → target.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plexd.access.activity import Report, emit
from plexd.access.lifetime import watch_lifetime
from plexd.access.serving import accept_forever, stop_serving
from plexd.access.sessions import Session, TcpTarget
from plexd.access.splice import relay

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 8
DIAL_TIMEOUT = 10.0
TERMINATIONS = ("ttl_expired", "idle_timeout", "plexd_close", "operator_revoke")



@dataclass
class TcpCounters:
    connections: int = 0
    refused_over_cap: int = 0
    dial_failures: int = 0
    bytes_in: int = 0  # operator → target
    bytes_out: int = 0  # target → operator


class TcpSession:
    """One session's listener and its live connections. `start()` binds; `close(reason)` ends everything."""

    def __init__(self, session: Session, bind_host: str, *, report: Report | None = None,
                 max_connections: int = MAX_CONNECTIONS, now: Callable[[], float] = time.time) -> None:
        if not isinstance(session.target, TcpTarget):
            raise ValueError(f"session {session.session_id} is a {session.kind} session, not tcp")
        self.session = session
        self.target: TcpTarget = session.target
        self.bind_host = bind_host
        self.max_connections = max_connections
        self.counters = TcpCounters()
        self._report = report
        self._now = now
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._watch: asyncio.Task[None] | None = None
        self.last_activity = now()
        self.port = 0
        self.closed: str | None = None  # the termination reason, once closed

    @property
    def listener_endpoint(self) -> str:
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        return f"{host}:{self.port}"

    @property
    def live_connections(self) -> int:
        return len(self._conns)

    async def start(self) -> int:
        """Bind `bind_host`:0 (the kernel picks the port), announce it, watch expiry and idleness."""
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.bind_host, 0))
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(), name=f"plexd:tcp-accept:{self.session.session_id}")
        self.last_activity = self._now()
        self._watch = asyncio.create_task(self._watch_lifetime(), name=f"plexd:tcp-session:{self.session.session_id}")
        await self._emit({"tcp": {"phase": "session_started", "target_host": self.target.host,
                                  "target_port": self.target.port, "listener_endpoint": self.listener_endpoint}})
        log.info("tcp session %s listening on %s for %s:%d", self.session.session_id, self.listener_endpoint,
                 self.target.host, self.target.port, extra={"session_id": self.session.session_id})
        return self.port

    async def _emit(self, body: dict[str, Any]) -> None:
        await emit(self._report, self.session.session_id, "tcp", body)

    def _note(self, counter: str) -> Callable[[int], None]:
        def add(n: int) -> None:
            setattr(self.counters, counter, getattr(self.counters, counter) + n)
            self.last_activity = self._now()
        return add

    async def _accept(self) -> None:
        """Raw sockets end to end: a stream transport would read the client's first bytes into a buffer of its
        own before the splice starts."""
        assert self._listener is not None
        async for client, _addr in accept_forever(self._listener, f"tcp session {self.session.session_id}"):
            if self.closed is not None or len(self._conns) >= self.max_connections:
                self.counters.refused_over_cap += 1
                client.close()
                continue
            client.setblocking(False)
            task = asyncio.create_task(self._forward(client), name=f"plexd:tcp-conn:{self.session.session_id}")
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _dial(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.target.host, self.target.port, type=socket.SOCK_STREAM)
        last: OSError = OSError(f"no address for {self.target.host}")
        for family, kind, proto, _name, address in infos:
            up = socket.socket(family, kind, proto)
            up.setblocking(False)
            try:
                await loop.sock_connect(up, address)
                return up
            except OSError as exc:
                up.close()
                last = exc
        raise last

    async def _forward(self, client: socket.socket) -> None:
        self.counters.connections += 1
        self.last_activity = self._now()
        try:
            try:
                async with asyncio.timeout(DIAL_TIMEOUT):
                    upstream = await self._dial()
            except (OSError, TimeoutError) as exc:
                self.counters.dial_failures += 1
                log.warning("tcp session %s: cannot reach %s:%d: %s", self.session.session_id, self.target.host,
                            self.target.port, exc or "timeout", extra={"session_id": self.session.session_id})
                return
            try:
                await relay(client, upstream, a_to_b=self._note("bytes_in"), b_to_a=self._note("bytes_out"))
            except OSError as exc:  # no pipe for the splice (out of descriptors): this connection ends, not the rest
                log.warning("tcp session %s: connection dropped: %s", self.session.session_id, exc.strerror or exc,
                            extra={"session_id": self.session.session_id})
            finally:
                upstream.close()
        finally:
            client.close()

    async def _watch_lifetime(self) -> None:
        await watch_lifetime(self.session, now=self._now, last_activity=lambda: self.last_activity,
                             closed=lambda: self.closed is not None, close=self.close)

    def listening_sockets(self) -> list[socket.socket]:
        """The listener's socket (the sessions domain marks it for the firewall's session rules)."""
        return [self._listener] if self._listener is not None and self._listener.fileno() != -1 else []

    async def close(self, reason: str) -> None:
        """Stop listening, end every connection, report `session_ended`. Idempotent."""
        if self.closed is not None:
            return
        if reason not in TERMINATIONS:
            raise ValueError(f"unknown termination {reason!r}")
        self.closed = reason
        await stop_serving(self._accepting, self._listener, self._conns)
        watch, current = self._watch, asyncio.current_task()
        if watch is not None and watch is not current:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        log.info("tcp session %s ended (%s): %d bytes in, %d out", self.session.session_id, reason,
                 self.counters.bytes_in, self.counters.bytes_out, extra={"session_id": self.session.session_id})
        await self._emit({"tcp": {"phase": "session_ended", "bytes_in": self.counters.bytes_in,
                                  "bytes_out": self.counters.bytes_out, "terminated_by": reason}})

    def status(self) -> dict[str, Any]:
        return {"session_id": self.session.session_id, "kind": "tcp", "listener_endpoint": self.listener_endpoint,
                "target": f"{self.target.host}:{self.target.port}", "connections": self.live_connections,
                "accepted": self.counters.connections, "refused_over_cap": self.counters.refused_over_cap,
                "dial_failures": self.counters.dial_failures, "bytes_in": self.counters.bytes_in,
                "bytes_out": self.counters.bytes_out, "closed": self.closed}
