"""The local Prometheus endpoint: plexd's own health at ``GET /metrics`` (config ``metrics``, off by default).

Everything is read at scrape time from the parts that already count it (the event stream, the reconciler, the
engine, the heartbeat, the queues) and from one read of the live device, so nothing on the daemon's paths
pays for metrics nobody scrapes. Only the converge durations are observed as they happen (a histogram).

    plexd_info{version}                                    1
    plexd_event_stream_state{state}                        1 for the current state (connected, polling, offline)
    plexd_event_stream_connects_total
    plexd_events_accepted_total / plexd_events_rejected_total{reason}
    plexd_reconcile_cycles_total / plexd_reconcile_failures_total / plexd_reconcile_held
    plexd_corrections_total{type}                          drift corrected by the converge, by correction type
    plexd_converge_duration_seconds{kind}                  histogram; kind: full (reconcile) or events (deltas)
    plexd_heartbeats_sent_total / plexd_heartbeat_failures_total / plexd_heartbeat_consecutive_failures
    plexd_queue_depth{queue} / plexd_queue_dropped_total{queue}   actions_outbox, node_api_reports,
                                                           drift_reports, session_reports (the uplink
                                                           outbox's lanes), telemetry_metrics, telemetry_logs,
                                                           telemetry_audit
    plexd_policy_enforced                                  1 enforced, 0 degraded or disabled
    plexd_peers_desired
    plexd_peer_last_handshake_age_seconds{peer}            +Inf before the first handshake
    plexd_peer_receive_bytes_total{peer} / plexd_peer_transmit_bytes_total{peer}

The listener speaks just enough HTTP/1.1 for a scraper: one bounded request per connection (8 KiB of head within
5 s), then close. It serves at most ``metrics.max_connections`` at once (more are answered 503 and closed, so a
flood of slow clients holds a few slots for 5 s each, never the daemon's memory or descriptors), and with
``metrics.token_file`` a scrape must carry ``Authorization: Bearer <token>`` (401 otherwise, before anything is
rendered). Without a token it is loopback only (the config refuses another listen address).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import stat
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from plexd import __version__
from plexd.base.errors import PlexdError
from plexd.converge.gate import Gate
from plexd.machine.wireguard import PeerCounters
from plexd.node.access import SESSION_ACTIVITY
from plexd.node.domain_list import wireguard
from plexd.node.parts import Node
from plexd.services.reconciler import DRIFT

log = logging.getLogger(__name__)

REQUEST_LIMIT = 8192  # a scrape request is a few hundred bytes
REQUEST_TIMEOUT = 5.0
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class NodeCollector:
    """The families, from the node's parts and the device snapshot taken just before."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.counters: Mapping[str, PeerCounters] | None = None  # the device's peers, read just before

    def collect(self) -> Iterator[Metric]:
        node = self.node
        yield _gauge("plexd_info", "plexd's version", 1, version=__version__)
        stream = node.stream.status()
        states = GaugeMetricFamily("plexd_event_stream_state", "1 for the event stream's current state",
                                   labels=["state"])
        for state in ("connected", "polling", "offline"):
            states.add_metric([state], 1 if stream["state"] == state else 0)
        yield states
        yield _counter("plexd_event_stream_connects", "event stream connections made", stream["connects"])
        yield _counter("plexd_events_accepted", "events verified and applied", stream["events_accepted"])
        rejected = CounterMetricFamily("plexd_events_rejected", "events refused, by reason", labels=["reason"])
        for reason, count in sorted(node.stream.rejected_by_reason.items()):
            rejected.add_metric([reason], count)
        yield rejected
        rec = node.reconciler
        yield _counter("plexd_reconcile_cycles", "reconcile cycles run", rec.cycles)
        yield _counter("plexd_reconcile_failures", "reconcile cycles that failed", rec.failures)
        held = node.mesh.gate.hold.current() is not None
        yield _gauge("plexd_reconcile_held", "1 while corrections are on hold", int(held))
        corrections = CounterMetricFamily("plexd_corrections", "drift corrected by the converge, by type",
                                          labels=["type"])
        for kind, count in sorted(node.reconciler.drift_corrected.items()):
            corrections.add_metric([kind], count)
        yield corrections
        hb = node.heartbeat
        yield _counter("plexd_heartbeats_sent", "heartbeats the control plane took", hb.sent)
        yield _counter("plexd_heartbeat_failures", "heartbeats that failed", hb.failures)
        yield _gauge("plexd_heartbeat_consecutive_failures", "failures since the last accepted heartbeat",
                     hb.consecutive_failures)
        yield from self._queues()
        enforcement, _ = node.mesh.enforcement()
        yield _gauge("plexd_policy_enforced", "1 when the policy is enforced", int(enforcement == "enforced"))
        desired = node.mesh.get_desired()
        yield _gauge("plexd_peers_desired", "peers the control plane sends", len(desired.peers))
        yield from self._peers({p.public_key: pid for pid, p in desired.peers.items()})

    def _queues(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("plexd_queue_depth", "entries waiting to be sent", labels=["queue"])
        dropped = CounterMetricFamily("plexd_queue_dropped", "entries dropped because a queue was full",
                                      labels=["queue"])
        outbox = self.node.action_outbox.status()
        depth.add_metric(["actions_outbox"], outbox["pending"])
        dropped.add_metric(["actions_outbox"], outbox["dropped_full"])
        sync = self.node.report_sync.status()
        depth.add_metric(["node_api_reports"], sync["pending"])
        dropped.add_metric(["node_api_reports"], sync["dropped"])
        for label, lane in (("drift_reports", DRIFT), ("session_reports", SESSION_ACTIVITY)):
            depth.add_metric([label], self.node.uplink.size(lane))
            dropped.add_metric([label], self.node.uplink.counter("dropped_full", lane))
        for stream, status in self.node.telemetry.status().items():
            depth.add_metric([f"telemetry_{stream}"], status["pending"])
            dropped.add_metric([f"telemetry_{stream}"], status["dropped"])
        yield depth
        yield dropped

    def _peers(self, ids: dict[str, str]) -> Iterator[Metric]:
        age = GaugeMetricFamily("plexd_peer_last_handshake_age_seconds", "seconds since the peer's last handshake",
                                labels=["peer"])
        rx = CounterMetricFamily("plexd_peer_receive_bytes", "bytes received from the peer", labels=["peer"])
        tx = CounterMetricFamily("plexd_peer_transmit_bytes", "bytes sent to the peer", labels=["peer"])
        now = time.time()
        for key, peer in (self.counters.items() if self.counters is not None else ()):
            label = [ids.get(key) or key]
            age.add_metric(label, max(0.0, now - peer.last_handshake) if peer.last_handshake else math.inf)
            rx.add_metric(label, peer.rx)
            tx.add_metric(label, peer.tx)
        yield from (age, rx, tx)
        if self.node.paths.paths:
            relayed = GaugeMetricFamily("plexd_peer_relayed", "1 while the peer is reached through a bridge's relay",
                                        labels=["peer"])
            switches = CounterMetricFamily("plexd_peer_path_switches", "switches between direct and relay",
                                           labels=["peer"])
            for pid, st in self.node.paths.paths.items():
                relayed.add_metric([pid], 1 if st.path == "relay" else 0)
                switches.add_metric([pid], st.switches)
            yield from (relayed, switches)


def read_metrics_token(path: str) -> str:
    """metrics.token_file's token (whitespace trimmed). Unreadable, empty or readable by others: PlexdError naming
    the file, and the endpoint does not start (it would otherwise be open, or its token anybody's)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        token = raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PlexdError(f"metrics.token_file: cannot read {path}: {reason}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise PlexdError(f"metrics.token_file: {path} is readable or writable by everyone (mode "
                         f"{stat.S_IMODE(mode):04o}); chmod 0600 or 0640")
    if not token:
        raise PlexdError(f"metrics.token_file: {path} is empty")
    return token


class MetricsEndpoint:
    def __init__(self, listen: str, gate: Gate, *, token_file: str = "", max_connections: int = 8) -> None:
        self.token_file = token_file
        self.max_connections = max_connections
        self._token: bytes | None = None
        self.active = 0
        self.refused_busy = 0  # connections answered 503 because max_connections were being served
        self.refused_auth = 0  # requests without the bearer token
        host, _, port = listen.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector: NodeCollector | None = None  # the node's families, registered by `serve`
        self.durations = Histogram("plexd_converge_duration_seconds", "how long converges take", ["kind"],
                                   registry=self.registry, buckets=DURATION_BUCKETS)
        gate.on_timed(lambda kind, seconds: self.durations.labels(kind).observe(seconds))
        self.scrapes = 0

    async def render(self) -> bytes:
        if self.collector is not None:
            try:
                self.collector.counters = await wireguard(self.collector.node.mesh.engine).counters()
            except PlexdError as exc:  # the other families still come out; the peers' are empty
                log.debug("metrics: cannot read the device: %s", exc)
                self.collector.counters = None
        self.scrapes += 1
        return generate_latest(self.registry)

    async def serve(self, node: Node | None = None) -> None:
        """The service: listen until cancelled, serving `node`'s families (None: only the converge durations). A
        port that cannot be bound fails the service (restarted with backoff by the supervisor, and named in the log
        and `plexd status`)."""
        if node is not None and self.collector is None:
            self.collector = NodeCollector(node)
            self.registry.register(self.collector)
        if self.token_file:  # read at each start: a new token takes a restart of the service
            self._token = read_metrics_token(self.token_file).encode()
        try:
            server = await asyncio.start_server(self._handle, self.host, self.port, limit=REQUEST_LIMIT)
        except OSError as exc:
            raise PlexdError(f"metrics: cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.port = server.sockets[0].getsockname()[1]  # the port bound, when 0 asked for any
        log.info("metrics endpoint on http://%s:%d/metrics (%s, at most %d connections)", self.host, self.port,
                 "bearer token required" if self._token else "no auth: loopback only", self.max_connections)
        async with server:
            await server.serve_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.active >= self.max_connections:  # answered without reading: a slot is never waited for
            self.refused_busy += 1
            await _answer(writer, "503 Service Unavailable", b"too many connections to the metrics endpoint\n",
                          "text/plain")
            return
        self.active += 1
        try:
            await self._serve_one(reader, writer)
        finally:
            self.active -= 1

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        extra = ""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            method, path = _request_line(head)
            if self._token is not None and not self._authorized(head):
                self.refused_auth += 1
                status, body, ctype = "401 Unauthorized", b"a bearer token is required (metrics.token_file)\n", \
                    "text/plain"
                extra = 'WWW-Authenticate: Bearer realm="plexd metrics"\r\n'
            elif path.split("?", 1)[0] != "/metrics":
                status, body, ctype = "404 Not Found", b"only /metrics is served here\n", "text/plain"
            elif method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
            else:
                status, body, ctype = "200 OK", await self.render(), CONTENT_TYPE_LATEST
                if method == "HEAD":
                    body = b""
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, body, ctype = "400 Bad Request", b"a bounded HTTP/1.1 GET /metrics, please\n", "text/plain"
        except ConnectionError:
            writer.close()
            return
        await _answer(writer, status, body, ctype, extra)

    def _authorized(self, head: bytes) -> bool:
        return self._token is not None and bearer_matches(head, self._token)


def bearer_matches(head: bytes, token: bytes) -> bool:
    """True when the request head's first Authorization header is ``Bearer <token>`` (compared in constant time)."""
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            scheme, _, credential = value.strip().partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), token)
    return False


async def _answer(writer: asyncio.StreamWriter, status: str, body: bytes, ctype: str, extra: str = "") -> None:
    writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
                 "Connection: close\r\n\r\n".encode() + body)
    try:
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def _request_line(head: bytes) -> tuple[str, str]:
    line = head.split(b"\r\n", 1)[0].decode("ascii")  # UnicodeDecodeError is a ValueError
    method, path, version = line.split(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(version)
    return method, path


def _gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
