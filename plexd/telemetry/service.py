"""Telemetry for the control plane: three streams, each a collector that queues in a lane of the one uplink
outbox, which delivers it (docs/protocol.md §1.14 shapes, §6 intervals, all configurable under ``telemetry``).

    metrics  every collect_interval: system (/proc, statvfs), tunnel per peer on the live device, latency per
             peer (ICMP over the mesh, -1 when unanswered)             → POST /metrics every report_interval
    logs     the journal (journalctl, cursor kept) or log files (followed across rotation)  → POST /logs
    audit    auditd's log (records joined by serial) and the local actions audit log       → POST /audit

Each stream's collection is one supervised service (``telemetry_metrics``, ``telemetry_logs``,
``telemetry_audit``): a bug or a bad input in one restarts that stream only, and none of them touches the mesh.
Delivery is the uplink outbox's (its ``uplink`` service, each stream a lane: batches of ``batch_size`` gathered for
``report_interval``, the one retry policy with a backoff capped at ``report_interval``). When a lane's byte cap
drops entries, the count goes to the log (at most a line a minute per stream), to ``plexd status`` and the
Prometheus endpoint, and — as one ``warning`` entry from ``plexd`` with the count — to the control plane ahead of
the next logs batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from plexd.base.gojson import EncodedJSON, now_text
from plexd.base.memo import ByIdentity
from plexd.config import datadir
from plexd.config.settings import TelemetryConfig
from plexd.controlplane.uplink import BatchSend, Entry, NoSender, UplinkOutbox
from plexd.machine.wireguard import CounterRow
from plexd.state.model import Peer
from plexd.telemetry.auditd import AuditLog, local_action_entry
from plexd.telemetry.logs import FileLogs, JournalLogs, journald_running
from plexd.telemetry.ping import ProbeUnavailable, round_trips
from plexd.telemetry.points import MetricPoints
from plexd.telemetry.queue import PACK_ENTRIES, STREAMS, TelemetryQueue, encode, lane
from plexd.telemetry.system import SystemSampler
from plexd.telemetry.tail import FileTail

log = logging.getLogger(__name__)

DROP_LOG_EVERY = 60.0
Post = Callable[[str, EncodedJSON], Awaitable[None]]  # (stream, a JSON array of entries): one POST to the control plane


def take_turn(items: Sequence[Any], budget: int, start: int) -> tuple[list[Any], int]:
    """At most `budget` of `items` from position `start` on, wrapping around, and where the next turn starts: every
    item comes round once every len(items) / budget turns. All of them when they fit."""
    if budget <= 0 or not items:
        return [], 0
    if len(items) <= budget:
        return list(items), 0
    start %= len(items)
    chosen = [*items[start:start + budget], *items[:max(0, start + budget - len(items))]]
    return chosen, (start + budget) % len(items)


class Telemetry:
    def __init__(self, cfg: TelemetryConfig, outbox: UplinkOutbox, hostname: str, post: Post, *,
                 read_counters: Callable[[], Awaitable[Sequence[CounterRow] | None]],
                 desired_peers: Callable[[], Mapping[str, Peer]], local_audit: str = "",
                 older_queues: Sequence[Path] = ()) -> None:
        """`older_queues`: where an older version may have left its telemetry.db (`telemetry_db_paths`)."""
        self.cfg, self.hostname = cfg, hostname
        self.read_counters, self.desired_peers = read_counters, desired_peers
        self.local_audit = local_audit
        stream_cfg = {"metrics": cfg.metrics, "logs": cfg.logs, "audit": cfg.audit}
        caps = {name: c.queue_max_bytes for name, c in stream_cfg.items()}
        self.queue = TelemetryQueue(outbox, caps, on_drop=self._dropped,
                                    pack=min([PACK_ENTRIES] + [c.batch_size for c in stream_cfg.values()]))
        self.enabled = [name for name in STREAMS if stream_cfg[name].enabled]
        # Every stream has its lane and caps; a disabled one keeps what an earlier run queued, unsent.
        for name, c in stream_cfg.items():
            self.queue.add_lane(name, self._sender(name, post), batch_size=c.batch_size, interval=c.report_interval,
                                has_news=self._has_notices if name == "logs" and name in self.enabled else None)
        self.queue.adopt(older_queues)
        if cfg.queue_dir:
            log.warning("telemetry.queue_dir (%s) is no longer used: telemetry waits in the uplink outbox, %s; a "
                        "telemetry.db found there is taken over", cfg.queue_dir, outbox.path)
        self._drops: dict[str, list[float]] = {}  # stream → [entries since the last line, when it was]
        self.system = SystemSampler()
        self._probe_problem = ""
        self._latency_turn = 0  # where the next collection's share of the peers to probe starts
        self._probe_order = ByIdentity[list[tuple[str, str]]](size=2)
        self.points = MetricPoints()

    # -- the services -------------------------------------------------------------------------------------------

    def services(self) -> dict[str, Callable[[], Awaitable[None]]]:
        runs = {"metrics": self.run_metrics, "logs": self.run_logs, "audit": self.run_audit}
        return {f"telemetry_{name}": runs[name] for name in self.enabled}

    async def run_metrics(self) -> None:
        await self._stream("metrics", self.cfg.metrics.collect_interval, self.collect_metrics)

    async def run_logs(self) -> None:
        cfg = self.cfg.logs
        use_journal = cfg.source == "journal" or (cfg.source == "auto" and (journald_running() or cfg.journal_dir))
        source: FileLogs | JournalLogs
        extra: list[Awaitable[None]] = []
        if use_journal:
            source = JournalLogs(self.queue.position(JournalLogs.SOURCE), self.hostname, units=cfg.units,
                                 priority=cfg.priority, directory=cfg.journal_dir)
            extra.append(source.run())
        else:
            saved = {f"file:{p}": self.queue.position(f"file:{p}") for p in cfg.files}
            source = FileLogs(cfg.files, saved, self.hostname)
            if not cfg.files:
                log.info("logs: journald is not running and telemetry.logs.files is empty: only plexd's own "
                         "notices are forwarded")

        async def collect() -> None:
            for entries, position in source.collect():
                self.queue.append("logs", entries, position=position)

        await self._stream("logs", cfg.collect_interval, collect, *extra)

    async def run_audit(self) -> None:
        cfg = self.cfg.audit
        auditd = AuditLog(cfg.file, self.queue.position("auditd:" + cfg.file), self.hostname) if cfg.file else None
        local = None
        if cfg.local_actions and self.local_audit:
            local = FileTail(self.local_audit, self.queue.position("local-actions"), what="local actions audit log")

        async def collect() -> None:
            if auditd is not None:
                entries, position = auditd.collect()
                if entries or position is not None:
                    self.queue.append("audit", entries,
                                      position=(auditd.source, position) if position is not None else None)
            if local is not None and (lines := local.read()):
                entries = [e for line in lines if (e := local_action_entry(line.text, self.hostname))]
                self.queue.append("audit", entries, position=("local-actions", lines[-1].position))

        await self._stream("audit", cfg.collect_interval, collect)

    async def _stream(self, name: str, interval: float, collect: Callable[[], Awaitable[None]],
                      *extra: Awaitable[None]) -> None:
        async def collecting() -> None:
            loop = asyncio.get_running_loop()
            due = loop.time()
            while True:  # on a fixed cadence: a slow collection does not stretch the interval
                await collect()
                due = max(due + interval, loop.time())
                await asyncio.sleep(due - loop.time())

        async with asyncio.TaskGroup() as group:
            for job in (collecting(), *extra):
                group.create_task(job)

    def _sender(self, stream: str, post: Post) -> BatchSend:
        """How a batch of the stream's lane goes: its stored rows inside one array (never decoded), the logs
        stream's with the notices of what any stream lost ahead of them (alone when nothing else is queued)."""
        async def send(entries: Sequence[Entry]) -> None:
            if stream not in self.enabled:
                raise NoSender(stream)  # kept for when the stream is enabled again
            notices, told = self._drop_notices() if stream == "logs" else ([], None)
            texts = [encode(e) for e in notices] + [e.items for e in entries]
            if texts:
                await post(stream, EncodedJSON.array(texts))
            if told is not None:
                told()
        return send

    def _has_notices(self) -> bool:
        return bool(self.queue.unreported_drops())

    # -- metrics ------------------------------------------------------------------------------------------------

    async def collect_metrics(self) -> None:
        rows = await self.read_counters()
        peers = self.desired_peers()  # a desired state's peers are never changed in place, only replaced
        rtts = await self._latency(peers)
        stamp, now = now_text(), time.time()
        # Off the event loop, in one hand-off: at 1,000 peers the points and their queueing are a few ms an event
        # would wait for.
        await asyncio.to_thread(lambda: self.queue.append_texts("metrics", self.points.texts(
            stamp, self._system(), rows, peers, rtts, now)))

    def _system(self) -> dict[str, Any] | None:
        try:
            return self.system.sample()
        except (OSError, ValueError, IndexError) as exc:
            log.warning("metrics: cannot read system figures: %s", exc)
            return None

    async def _latency(self, peers: Mapping[str, Peer]) -> dict[str, int]:
        # Sorted once per desired state, not at every collection (1,000 peers, four times a minute).
        every = self._probe_order.get(peers, None, lambda: sorted(
            (peer_id, peer.mesh_ip) for peer_id, peer in peers.items() if peer.mesh_ip))
        chosen, self._latency_turn = take_turn(every, self.cfg.metrics.latency_peers, self._latency_turn)
        targets = dict(chosen)
        if not targets:
            return {}
        try:
            # answers later than most of an interval would make the next collection late
            timeout = min(self.cfg.metrics.latency_timeout, 0.8 * self.cfg.metrics.collect_interval)
            rtts = await round_trips(targets, timeout)
        except ProbeUnavailable as exc:
            if str(exc) != self._probe_problem:
                log.warning("metrics: latency cannot be measured: %s; reported as -1", exc)
                self._probe_problem = str(exc)
            return dict.fromkeys(targets, -1)
        return rtts

    # -- losses -------------------------------------------------------------------------------------------------

    def _dropped(self, stream: str, count: int, nbytes: int, why: str) -> None:
        """In the collector's worker thread: the log line (the counts are the outbox's, `plexd status`), and the
        logs lane woken for its notice."""
        self.queue.outbox.notify(lane("logs"))
        if why == "full":
            pending = self._drops.setdefault(stream, [0, 0.0])
            pending[0] += count
            if time.monotonic() - pending[1] >= DROP_LOG_EVERY:
                log.warning("telemetry: %s queue full (%d bytes): dropped the %d oldest entries since the last "
                            "line; raise telemetry.%s.queue_max_bytes to keep more through an outage", stream,
                            self.queue.caps[stream], pending[0], stream)
                pending[:] = [0, time.monotonic()]

    def _drop_notices(self) -> tuple[list[dict[str, Any]], Callable[[], None]]:
        """One ``warning`` log entry per stream that lost entries since the control plane was last told, sent
        ahead of the next logs batch (not queued: a full queue would drop its own notice)."""
        counts = self.queue.unreported_drops()
        entries = [{"timestamp": now_text(), "source": "plexd", "unit": "plexd", "severity": "warning",
                    "hostname": self.hostname,
                    "message": f"telemetry {stream} queue: {count} entries dropped (the oldest, past "
                               f"telemetry.{stream}.queue_max_bytes, or unwritable)"}
                   for stream, count in sorted(counts.items())]
        return entries, lambda: self.queue.drops_reported(counts)

    def status(self) -> dict[str, Any]:
        return {name: {**self.queue.status(name), "enabled": name in self.enabled} for name in STREAMS}

    async def close(self) -> None:
        self.queue.close()



def telemetry_db_paths(cfg: TelemetryConfig, data_dir: str) -> list[Path]:
    """Where versions before the one outbox kept their telemetry queue: data_dir, and `queue_dir` when set."""
    return list(dict.fromkeys(Path(d) / datadir.TELEMETRY_DB for d in (data_dir, cfg.queue_dir) if d))
