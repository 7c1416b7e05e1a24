"""One ingress port of a bridge: accepts TCP from outside the mesh and forwards it to a mesh target.

A port serves one rule, or several `tcp` rules told apart by the server name of the client's TLS ClientHello
(SNI, read with MSG_PEEK so the bytes still go to the target untouched). `tcp` rules splice bytes both ways
(`plexd.base.splice`); `terminate` rules end TLS here with the rule's certificate and forward plain TCP.

Bounded: 256 connections per port. A source is an address, but an IPv6 /64 is one source (a host or LAN picks its
addresses from a whole /64). A connection waits until it forwards its first byte, either way (a silent client, a
ClientHello being read, a target being dialled): 8 such per source and 64 per port. A newcomer over its source's
waiting budget closes that source's oldest waiting connection; over the port's, or to a full port, the oldest
waiting one of the source holding the most (its own source's when that holds as many), so clients that connect and
say nothing keep nobody out. To a full port where every connection forwards, a newcomer whose source holds less
than its share (`bridge.ingress.max_per_source`, 64) closes the newest connection of the source holding the most,
if that holds more; else the newcomer is closed, counted. While there is room a source may hold more than its share
(an office behind one NAT). The first byte, either way, must come within 10 s of the accept (a ClientHello where
one is read; never renewed), the target has 10 s to answer a dial, and a connection ends after
`bridge.ingress.idle_timeout` (1 hour) without a byte either way. Sources outside `bridge.ingress.allowed_sources`
(when set) are closed at once, counted. Nothing is logged per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plexd.base.serving import accept_forever, stop_serving
from plexd.base.splice import relay
from plexd.bridge.sni import RECORD_HEADER, record_length, server_name
from plexd.state.bridge_blocks import IngressRule

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # per port
MAX_PER_SOURCE = 64  # a source's share of a full port (bridge.ingress.max_per_source)
MAX_WAITING_PER_SOURCE = 8  # connections that have not forwarded a byte yet
MAX_WAITING = 64
HELLO_TIMEOUT = 10.0  # from the accept to the first byte either way
IDLE_TIMEOUT = 3600.0  # without a byte either way (bridge.ingress.idle_timeout): pools and quiet streams last
DIAL_TIMEOUT = 10.0
CHUNK = 1 << 16


@dataclass
class PortCounters:
    accepted: int = 0
    refused_over_cap: int = 0
    refused_per_source: int = 0  # the port full, and its source already held its share
    refused_source: int = 0
    dropped_waiting: int = 0  # closed before it forwarded a byte, to make room for a newer connection
    dropped_over_share: int = 0  # the port full, its source over its share: closed for another source's newcomer
    dropped_silent: int = 0  # no byte within HELLO_TIMEOUT
    dropped_idle: int = 0
    no_rule: int = 0  # no rule for the server name the client asked for (or no name, or not TLS)
    dial_failures: int = 0
    tls_failures: int = 0
    ended_by_rule_change: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    source: str  # `source_key` of its address
    last: float  # time.monotonic() of the last byte either way (of the accept, before any)
    task: asyncio.Task[None] = field(init=False)
    timer: asyncio.TimerHandle | None = None
    heard: bool = False  # a byte came, either way
    started: bool = False  # its task has run (one cancelled before its first step never runs its `finally`)

    def unread(self) -> bool:
        """Bytes from the client wait in its socket (its task has not read them yet)."""
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing there (EAGAIN), or the socket is gone
            return False


class IngressPort:
    def __init__(self, host: str, port: int, *, allowed_sources: Sequence[str] = (),
                 tls_context: Callable[[IngressRule], ssl.SSLContext], idle_timeout: float = IDLE_TIMEOUT,
                 max_per_source: int = MAX_PER_SOURCE) -> None:
        self.host, self.port = host, port
        self.idle_timeout, self.max_per_source = idle_timeout, max_per_source
        self.rules: dict[str, IngressRule] = {}  # by hostname ("" for the port's only rule)
        self.allowed = [ipaddress.ip_network(c, strict=False) for c in allowed_sources]
        self._tls_context = tls_context
        self.counters = PortCounters()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: dict[asyncio.Task[None], _Client] = {}
        self._waiting: dict[asyncio.Task[None], _Client] = {}  # no byte forwarded yet, oldest first
        self._serving: dict[asyncio.Task[Any], IngressRule] = {}  # each live connection's rule, once picked

    @property
    def listening(self) -> bool:
        return (self._listener is not None and self._listener.fileno() != -1 and self._accepting is not None
                and not self._accepting.done())

    @property
    def active(self) -> int:
        return len(self._conns)

    def set_rules(self, rules: Sequence[IngressRule]) -> None:
        """The port's rules now. A live connection whose rule is gone or changed (another target, mode or
        certificate) ends: it was let in under terms the control plane no longer gives."""
        self.rules = {r.hostname: r for r in rules}
        ended = [task for task, rule in self._serving.items() if self.rules.get(rule.hostname) != rule]
        for task in ended:
            task.cancel()
        if ended:
            self.counters.ended_by_rule_change += len(ended)
            log.info("ingress port %d: %d connections ended: their rule was revoked or changed", self.port,
                     len(ended))

    async def start(self) -> None:
        """Listen (OSError when the port is taken: the caller reports it)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self._accepting = asyncio.create_task(self._accept(), name=f"plexd:ingress:{self.port}")

    async def close(self) -> None:
        await stop_serving(self._accepting, self._listener, self._conns)

    async def _accept(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        async for client, address in accept_forever(self._listener, f"ingress port {self.port}"):
            if self.allowed and not self._admitted(address[0]):
                self.counters.refused_source += 1
                client.close()
                continue
            source = source_key(address[0])
            refused = self._make_room(source)
            if refused:
                setattr(self.counters, refused, getattr(self.counters, refused) + 1)
                client.close()
                continue
            client.setblocking(False)
            self.counters.accepted += 1
            conn = _Client(client, source, time.monotonic())
            conn.task = asyncio.create_task(self._serve(conn), name=f"plexd:ingress-conn:{self.port}")
            self._conns[conn.task] = self._waiting[conn.task] = conn
            conn.task.add_done_callback(self._ended)
            conn.timer = loop.call_later(HELLO_TIMEOUT, self._check, conn)

    def _make_room(self, source: str) -> str:
        """Room for one more connection from `source`, made by closing a waiting one where a waiting budget or the
        port is full, or a connection of a source over its share where the port is full and none waits; else the
        counter of why there is none."""
        own = [c for c in self._waiting.values() if c.source == source]
        if len(own) >= MAX_WAITING_PER_SOURCE:
            self._drop(own[0], "dropped_waiting")
        elif self._waiting and (len(self._waiting) >= MAX_WAITING or len(self._conns) >= MAX_CONNECTIONS):
            self._drop(self._oldest_of_busiest(source), "dropped_waiting")
        if len(self._conns) < MAX_CONNECTIONS:
            return ""
        held = Counter(c.source for c in self._conns.values())
        busiest, most = held.most_common(1)[0]
        if held[source] >= self.max_per_source:
            return "refused_per_source"
        if most <= self.max_per_source:
            return "refused_over_cap"  # every source within its share: first come, first served
        self._drop(next(c for c in reversed(self._conns.values()) if c.source == busiest), "dropped_over_share")
        return ""

    def _oldest_of_busiest(self, source: str) -> _Client:
        """The oldest waiting connection of the source holding the most waiting ones; `source`'s own when it holds
        as many (a newcomer never takes another source's place to hold more than it)."""
        counts = Counter(c.source for c in self._waiting.values())
        busiest = max(counts, key=counts.__getitem__)
        if counts[source] >= counts[busiest]:
            busiest = source
        return next(c for c in self._waiting.values() if c.source == busiest)

    def _drop(self, conn: _Client, counter: str) -> None:
        setattr(self.counters, counter, getattr(self.counters, counter) + 1)
        self._end(conn)

    def _heard(self, conn: _Client) -> bool:
        """Whether a byte came on `conn`, either way (or waits in its socket, its task not having read it yet)."""
        conn.heard = conn.heard or conn.unread()
        return conn.heard

    def _end(self, conn: _Client) -> None:
        """Gone from the counts at once; its task closes its sockets as it ends. A task cancelled before its first
        step never runs at all (in a burst `sock_accept` returns without yielding, so a connection can be closed
        for a newer one before its task started): its socket is closed here. A started task's is not: the loop may
        still watch it, and its `finally` closes it."""
        self._ended(conn.task)
        conn.task.cancel()
        if not conn.started:
            conn.sock.close()

    def _ended(self, task: asyncio.Task[None]) -> None:
        conn = self._conns.pop(task, None)
        self._waiting.pop(task, None)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()

    def _check(self, conn: _Client) -> None:
        """At HELLO_TIMEOUT: a connection without a byte either way is closed. Then, every `idle_timeout` after the
        last byte either way: an idle connection is closed."""
        if conn.task.done():
            return
        idle = time.monotonic() - conn.last
        if not self._heard(conn):
            self.counters.dropped_silent += 1
            self._end(conn)
        elif idle >= self.idle_timeout:
            self.counters.dropped_idle += 1
            self._end(conn)
        else:
            conn.timer = asyncio.get_running_loop().call_later(self.idle_timeout - idle, self._check, conn)

    def _admitted(self, source: str) -> bool:
        try:
            ip = ipaddress.ip_address(source.split("%")[0])
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self.allowed)

    async def _serve(self, conn: _Client) -> None:
        conn.started = True
        client = conn.sock
        try:
            rule = await self._pick(client)
            if rule is None:
                self.counters.no_rule += 1
                return
            task = asyncio.current_task()
            if task is not None:
                self._serving[task] = rule
            try:
                async with asyncio.timeout(DIAL_TIMEOUT):
                    upstream = await _dial(rule.target)
            except (OSError, TimeoutError):
                self.counters.dial_failures += 1
                return
            try:
                if rule.mode == "terminate":
                    await self._terminate(client, upstream, rule, conn)
                else:
                    await relay(client, upstream, a_to_b=self._count("bytes_in", conn),
                                b_to_a=self._count("bytes_out", conn))
            finally:
                upstream.close()
        except (OSError, ValueError, TimeoutError):
            pass  # the client or the target went away, or sent nonsense: this connection ends, the port goes on
        finally:
            self._serving.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            client.close()

    async def _pick(self, client: socket.socket) -> IngressRule | None:
        if set(self.rules) == {""}:
            return self.rules[""]
        if not self.rules:
            return None
        async with asyncio.timeout(HELLO_TIMEOUT):
            record = await _peek_record(client)
        name = server_name(record)
        rule = self.rules.get(name)
        if rule is None and "." in name:  # `*.example.com` stands for exactly one more label, as in TLS
            rule = self.rules.get("*." + name.split(".", 1)[1])
        return rule

    async def _terminate(self, client: socket.socket, upstream: socket.socket, rule: IngressRule,
                         conn: _Client) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=CHUNK)
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, client,
                                                              ssl=self._tls_context(rule),
                                                              ssl_handshake_timeout=HELLO_TIMEOUT)
        except (ssl.SSLError, OSError, TimeoutError, ConnectionError):
            self.counters.tls_failures += 1
            return
        conn.heard = True  # its ClientHello came
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        up_reader, up_writer = await asyncio.open_connection(sock=upstream)
        try:
            await asyncio.gather(_pump(reader, up_writer, self._count("bytes_in", conn)),
                                 _pump(up_reader, writer, self._count("bytes_out", conn)))
        finally:
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    def _count(self, counter: str, conn: _Client) -> Callable[[int], None]:
        def add(n: int) -> None:
            setattr(self.counters, counter, getattr(self.counters, counter) + n)
            conn.last = time.monotonic()
            # Either way: a server that speaks first (SMTP, FTP, IMAP, a push-only stream) answers for its silent
            # client. Where a ClientHello is read the target is dialled only after it came, so only the client
            # can be first there.
            conn.heard = True
            self._waiting.pop(conn.task, None)  # forwarding: it waits no more
        return add

    def status(self) -> Mapping[str, Any]:
        c = self.counters
        return {"listen_port": self.port, "listening": self.listening, "connections": self.active,
                "waiting": len(self._waiting), "accepted": c.accepted, "refused_over_cap": c.refused_over_cap,
                "refused_per_source": c.refused_per_source, "refused_source": c.refused_source,
                "dropped_waiting": c.dropped_waiting, "dropped_over_share": c.dropped_over_share,
                "dropped_silent": c.dropped_silent, "dropped_idle": c.dropped_idle, "no_rule": c.no_rule,
                "dial_failures": c.dial_failures, "tls_failures": c.tls_failures, "bytes_in": c.bytes_in,
                "bytes_out": c.bytes_out}


def source_key(address: str) -> str:
    """Whom a connection from `address` counts against: the address, but an IPv6 /64 is one source (a host or a
    LAN picks addresses from a whole /64 at will), and an IPv4-mapped address (an IPv4 client of a dual-stack
    listener) is its IPv4 address, not the /64 all of IPv4 maps into."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


async def _dial(target: tuple[str, int]) -> socket.socket:
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
    up = socket.socket(family, socket.SOCK_STREAM)
    up.setblocking(False)
    try:
        await loop.sock_connect(up, target)
    except BaseException:
        up.close()
        raise
    return up


async def _peek_record(client: socket.socket) -> bytes:
    """The client's first TLS record, left in the socket (MSG_PEEK): the target still gets every byte.

    A peek does not consume, so a socket holding part of the record stays readable: the receive low-water mark
    (SO_RCVLOWAT) is set to what is still wanted, and the socket becomes readable only once that much is
    there (or at the client's FIN). Without it, a client that sent three bytes and stopped woke the loop until
    the hello timeout."""
    loop = asyncio.get_running_loop()
    want = RECORD_HEADER
    try:
        while True:
            mark = want
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(client.fileno(), _settle, ready)
            try:
                await ready
            finally:
                loop.remove_reader(client.fileno())
            data = client.recv(want, socket.MSG_PEEK)
            if not data:
                raise ValueError("the client closed before its ClientHello")
            if len(data) >= RECORD_HEADER:
                want = record_length(data)
                if len(data) >= want:
                    return data[:want]
            if len(data) < mark:
                await asyncio.sleep(0.01)  # woken short of the mark (a FIN after part of it): no spin
    finally:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # the splice that follows reads as it comes


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, note: Callable[[int], None]) -> None:
    while data := await reader.read(CHUNK):
        note(len(data))
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(OSError, RuntimeError):
        if writer.can_write_eof():
            writer.write_eof()
