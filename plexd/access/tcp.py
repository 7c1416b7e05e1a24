"""TCP sessions (docs/protocol.md §A1.3, `kind: tcp`): a listener of the session's own that forwards to the
session's target and nothing else.

Raw clients (a `psql`, a browser) must keep working, so there is no in-band token, as in the Go agent; what admits
a source is plexd's firewall (a per-session rule for the mesh peers the policy allows, added by the engine), and
the listener binds the node's mesh IP only, never all interfaces. That rule is this session's authentication:
there is no "pre-authentication" phase to budget, so what keeps one allowed peer from starving the others is a
share per source address enforced under contention, and an idle timeout per connection (`connection_idle`: no
byte either way that long and the connection is closed), so a peer's silent connections neither keep the others
out nor hold their slots for the session's whole life. While there is room any source may connect (a browser's
6 connections to a host, and a WebSocket or a preconnect besides). When all `max_connections` are taken, a
newcomer from a source holding fewer than `max_per_source` closes the newest connection of the source holding
the most, if that holds more; else the newcomer is closed at once, counted. Unlike Go (one connection at a time),
up to `max_connections` run at once. Bytes are spliced in the kernel (`plexd.base.splice`).

The target is resolved once, when the session opens, and every connection dials those addresses: a DNS answer
that changes later (rebinding) cannot move the session to another host. A host name that resolves to a
loopback, link-local (where the cloud metadata services live), unspecified or other cloud metadata address is
refused: such a target is served only when the control plane names the address itself.

Activity (§A1.4) goes to `report(session_id, body)`: `session_started` with the `listener_endpoint` once the
listener is bound, and `session_ended` with the bytes each way and `terminated_by` (`ttl_expired`,
`idle_timeout`, `plexd_close`, `operator_revoke`) when it closes. `bytes_in` is operator → target.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plexd.access.activity import Report, emit
from plexd.access.lifetime import watch_lifetime
from plexd.base.hostname import is_ip
from plexd.base.serving import accept_forever, idle_timeout, mesh_listener, only_from, stop_serving
from plexd.base.splice import relay
from plexd.state.sessions_block import Session, TcpTarget

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 8
MAX_PER_SOURCE = 6  # a source's share of the 8 once all are taken (a browser's per-host count); more while free
# A connection with no byte either way this long is closed (the session's idle_timeout when it has one); a pool's
# idle connection (HikariCP, pgbouncer: 10 min) is checked or reopened by the pool anyway.
CONNECTION_IDLE = 600.0
DIAL_TIMEOUT = 10.0
RESOLVE_TIMEOUT = 10.0
# Reached only when named as a literal: the metadata services that are not link-local (AWS IPv6, Alibaba, Azure's
# wire server).
METADATA = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200", "168.63.129.16"))
TERMINATIONS = ("ttl_expired", "idle_timeout", "plexd_close", "operator_revoke")



@dataclass
class TcpCounters:
    connections: int = 0
    refused_over_cap: int = 0
    refused_per_source: int = 0  # all slots taken, and its source already held its share
    dropped_over_share: int = 0  # all slots taken, its source over its share: closed for another's newcomer
    idle_closed: int = 0
    dial_failures: int = 0
    bytes_in: int = 0  # operator → target
    bytes_out: int = 0  # target → operator


class TcpSession:
    """One session's listener and its live connections. `start()` binds; `close(reason)` ends everything."""

    def __init__(self, session: Session, bind_host: str, *, report: Report | None = None,
                 max_connections: int = MAX_CONNECTIONS, max_per_source: int = MAX_PER_SOURCE,
                 connection_idle: float | None = None, now: Callable[[], float] = time.time,
                 device: str | None = None) -> None:
        """`device`: the mesh interface, the only one the listener takes connections from (`mesh_listener`)."""
        if not isinstance(session.target, TcpTarget):
            raise ValueError(f"session {session.session_id} is a {session.kind} session, not tcp")
        self.session = session
        self.target: TcpTarget = session.target
        self.bind_host, self.device = bind_host, device
        self.device_index = 0  # the interface index the listener is bound to, once started
        self.max_connections, self.max_per_source = max_connections, max_per_source
        self.connection_idle = connection_idle or session.idle_timeout or CONNECTION_IDLE
        self._addresses: list[tuple[int, int, int, Any]] = []  # the target's, resolved once by start()
        self._per_source: Counter[str] = Counter()
        self.counters = TcpCounters()
        self._report = report
        self._now = now
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: dict[asyncio.Task[None], tuple[str, socket.socket]] = {}  # source and client, oldest first
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
        """Resolve the target, bind `bind_host`:0 (the kernel picks the port), announce it, watch expiry and
        idleness. ValueError (nothing bound) names a target that does not resolve or resolves where it may not."""
        self._addresses = await self._resolve()
        listener, self.device_index = mesh_listener(self.bind_host, self.device)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(), name=f"plexd:tcp-accept:{self.session.session_id}")
        self.last_activity = self._now()
        self._watch = asyncio.create_task(self._watch_lifetime(), name=f"plexd:tcp-session:{self.session.session_id}")
        await self._emit({"tcp": {"phase": "session_started", "target_host": self.target.host,
                                  "target_port": self.target.port, "listener_endpoint": self.listener_endpoint}})
        log.info("tcp session %s listening on %s for %s:%d (%s)", self.session.session_id, self.listener_endpoint,
                 self.target.host, self.target.port, ", ".join(str(a[3][0]) for a in self._addresses),
                 extra={"session_id": self.session.session_id})
        return self.port

    async def _resolve(self) -> list[tuple[int, int, int, Any]]:
        host = self.target.host
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT):
                infos = await asyncio.get_running_loop().getaddrinfo(host, self.target.port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or "timed out"
            raise ValueError(f"target host {host!r} does not resolve: {why}") from None
        if not is_ip(host):  # a literal is the control plane's explicit choice; a name could be anyone's
            for *_, address in infos:
                if why := _internal(address[0]):
                    raise ValueError(f"target host {host!r} resolves to {address[0]} ({why}); such an address is "
                                     "served only when the session names it as a literal")
        if not infos:
            raise ValueError(f"target host {host!r} has no address")
        return [(family, kind, proto, address) for family, kind, proto, _name, address in infos]

    async def _emit(self, body: dict[str, Any]) -> None:
        await emit(self._report, self.session.session_id, "tcp", body)

    def _note(self, counter: str, touch: Callable[[], None]) -> Callable[[int], None]:
        def add(n: int) -> None:
            setattr(self.counters, counter, getattr(self.counters, counter) + n)
            self.last_activity = self._now()
            touch()  # the connection's own idle window starts again
        return add

    async def _accept(self) -> None:
        """Raw sockets end to end: a stream transport would read the client's first bytes into a buffer of its
        own before the splice starts."""
        assert self._listener is not None
        async for client, addr in accept_forever(self._listener, f"tcp session {self.session.session_id}"):
            source = str(addr[0])
            refused = "refused_over_cap" if self.closed is not None else self._make_room(source)
            if refused:
                setattr(self.counters, refused, getattr(self.counters, refused) + 1)
                client.close()
                continue
            client.setblocking(False)
            task = asyncio.create_task(self._forward(client), name=f"plexd:tcp-conn:{self.session.session_id}")
            self._conns[task] = (source, client)
            self._per_source[source] += 1
            task.add_done_callback(self._ended)

    def _make_room(self, source: str) -> str:
        """Room for one more connection from `source`, when all are taken made by closing the newest connection of
        the source holding the most, if that holds more than its share and `source` less; else the counter of
        why there is none."""
        if len(self._conns) < self.max_connections:
            return ""
        if self._per_source[source] >= self.max_per_source:
            return "refused_per_source"
        busiest, most = self._per_source.most_common(1)[0]
        if most <= self.max_per_source:
            return "refused_over_cap"  # every source within its share: first come, first served
        newest = next(t for t, (s, _) in reversed(self._conns.items()) if s == busiest)
        client = self._conns[newest][1]
        self.counters.dropped_over_share += 1
        # A task cancelled before its first step (accepted in the same burst: `sock_accept` does not yield while
        # the backlog holds connections) never runs its `finally`: its socket is closed here.
        never_ran = inspect.getcoroutinestate(newest.get_coro()) == inspect.CORO_CREATED
        self._ended(newest)  # its slot is the newcomer's at once
        newest.cancel()
        if never_ran:
            client.close()
        return ""

    def _ended(self, task: asyncio.Task[None]) -> None:
        held = self._conns.pop(task, None)
        if held is None:
            return  # displaced: already gone from the counts
        self._per_source[held[0]] -= 1
        if not self._per_source[held[0]]:
            del self._per_source[held[0]]

    async def _dial(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        last: OSError = OSError(f"no address for {self.target.host}")
        for family, kind, proto, address in self._addresses:
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
                async with idle_timeout(self.connection_idle) as touch:
                    await relay(client, upstream, a_to_b=self._note("bytes_in", touch),
                                b_to_a=self._note("bytes_out", touch))
            except TimeoutError:
                self.counters.idle_closed += 1
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

    def rebind(self, index: int) -> None:
        """The mesh interface was recreated (index `index`): the listener and its connections take what arrives on
        the new one (`plexd.base.serving.only_from`), keeping the port and the connections. OSError: not done."""
        for sock in [*self.listening_sockets(), *(client for _, client in self._conns.values())]:
            if sock.fileno() != -1:
                only_from(sock, index)
        self.device_index = index

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
                "refused_per_source": self.counters.refused_per_source,
                "dropped_over_share": self.counters.dropped_over_share, "idle_closed": self.counters.idle_closed,
                "dial_failures": self.counters.dial_failures, "bytes_in": self.counters.bytes_in,
                "bytes_out": self.counters.bytes_out, "closed": self.closed}


def _internal(address: str) -> str | None:
    """Why a resolved `address` may be dialled only when named as a literal (None: it may)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # a link-local IPv6 comes with its scope
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1 to the kernel
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_unspecified:
        return "unspecified"
    if ip in METADATA:
        return "cloud metadata"
    return None
