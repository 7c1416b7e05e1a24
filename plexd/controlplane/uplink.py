"""What the node tells the control plane when it cannot be told now: one durable, bounded outbox and one policy.

    UplinkOutbox(path, send)  data_dir/uplink.db (SQLite, WAL, synchronous=FULL, 0600): entries of a kind with a
                              JSON body, in lanes; `put` is durable before it returns; past `max_entries`/`max_bytes`
                              the oldest are dropped, counted and logged; an unreadable file is moved aside, never
                              fatal
    lanes                     each stream is a lane, delivered oldest first and retried on its own backoff, so a
                              stream the control plane refuses for a while never holds up another:
                                drift              drift reports (`plexd.services.reconciler`)
                                session_activity   access session reports (`plexd.node.access`)
                                actions            action acks, results and integrity violations, queued in the
                                                   same transaction as the journal row they belong to
                                                   (`plexd.actions.journal` keeps its tables in this file)
                                reports            node-API report changes, one entry per key (a key written again
                                                   replaces its entry), sent in batches (`plexd.nodeapi.sync`)
    retry_verdict(exc)        the one retry policy (`plexd.controlplane.retry`), shared with telemetry, whose queue
                              stays its own file (see `plexd.telemetry.queue`)

Entries leave the outbox only when the control plane took them or refused them for good, so a report made while
the control plane was down is delivered after it comes back, across a daemon restart too, exactly once (a crash
between the answer and the delete sends it again: at least once, never lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexd.base.backoff import Backoff
from plexd.base.clock import wait_event
from plexd.base.errors import PlexdError
from plexd.base.sqlitefile import connect_private, immediate, open_or_start_empty
from plexd.controlplane.errors import ControlPlaneError
from plexd.controlplane.retry import Verdict, retry_verdict

log = logging.getLogger(__name__)

MAX_ENTRIES = 10_000
MAX_BYTES = 16 << 20
_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, body TEXT NOT NULL,
                                   size INTEGER NOT NULL, queued_at REAL NOT NULL, attempts INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
# Lanes and keys came after the first files were written: added to an older file when it is opened.
_LANES = """
CREATE INDEX IF NOT EXISTS outbox_by_lane ON outbox (lane, seq);
CREATE UNIQUE INDEX IF NOT EXISTS outbox_by_key ON outbox (lane, key) WHERE key IS NOT NULL;
"""

PARKED = 3600.0  # how long a lane nobody here can send waits before it is looked at again

Send = Callable[[str, dict[str, Any]], Awaitable[None]]
Poster = Callable[[dict[str, Any]], Awaitable[None]]


class NoSender(Exception):
    """Raised by a `send` for a kind this process does not deliver (`plexd reconcile --once` sends drift reports
    only): the lane's entries stay queued for the daemon, untouched."""


@dataclass(frozen=True)
class Entry:
    seq: int
    kind: str
    body: dict[str, Any]
    key: str | None = None


BatchSend = Callable[[Sequence[Entry]], Awaitable[None]]


@dataclass
class _Lane:
    """One stream: how it is sent, and where its delivery stands."""

    send: BatchSend
    batch: int
    debounce: float  # after the first entry of a quiet lane, wait this long for others to join it
    backoff: Backoff
    retry_at: float = 0.0  # monotonic: the backoff's next try
    waiting_since: float | None = None  # monotonic: when the lane's oldest unsent entry was noticed
    sent: int = 0
    last_error: str = ""
    failing: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one delivery of this lane at a time

    def due(self) -> float:
        since = self.waiting_since if self.waiting_since is not None else 0.0
        return max(self.retry_at, since + self.debounce)


class UplinkOutbox:
    def __init__(self, path: str | Path | None, send: Send, *, backoff: Backoff | None = None,
                 max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        """`send(kind, body)` delivers an entry of a lane nobody added with `add_lane`, one at a time. `path`
        None: an outbox in memory (`plexd reconcile --once` without a data_dir to share, tests)."""
        self.path = Path(path) if path is not None else None
        self._send = send
        self.backoff = backoff or Backoff()
        self.max_entries, self.max_bytes = max_entries, max_bytes
        if self.path is None:
            self._db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            self._db.executescript(_SCHEMA)
            _add_lanes(self._db)
        else:
            self._db = open_or_start_empty(self.path, self._connect, "uplink outbox",
                                           "reports and action results queued for the control plane are lost, "
                                           "and executions from before cannot be recognised as replays")
        self._lanes: dict[str, _Lane] = {}
        self._wake = asyncio.Event()
        self._full_warned_at = 0.0

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        db = connect_private(self.path, _SCHEMA, synchronous="FULL", probe_table="outbox")
        _add_lanes(db)
        return db

    def add_lane(self, name: str, send: BatchSend, *, batch: int = 1, debounce: float = 0.0,
                 backoff: Backoff | None = None) -> None:
        """A lane whose entries `send` delivers, up to `batch` at once."""
        self._lanes[name] = _Lane(send, batch, debounce, backoff or _like(self.backoff))

    def _lane(self, name: str) -> _Lane:
        lane = self._lanes.get(name)
        if lane is None:
            async def one_at_a_time(entries: Sequence[Entry]) -> None:
                for entry in entries:
                    await self._send(entry.kind, entry.body)

            lane = self._lanes[name] = _Lane(one_at_a_time, 1, 0.0, _like(self.backoff))
        return lane

    # -- queueing ---------------------------------------------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        """The outbox's connection, for a store that keeps its own tables in the same file (the action journal)
        and must queue an entry in the transaction that changes them."""
        return self._db

    def put(self, kind: str, body: dict[str, Any], *, lane: str | None = None, key: str | None = None) -> int:
        """Queue one entry, on disk before this returns (or with the caller's open transaction on `db`); the oldest
        go when the caps are reached. `lane` defaults to the kind. A `key` replaces the lane's entry of that key,
        which moves to the end. Returns its sequence number (`deliver` lists those the control plane took)."""
        text = json.dumps(body, separators=(",", ":"))  # ASCII: a lone surrogate from outside input is escaped
        size = len(text.encode())
        lane = lane or kind
        outer = self._db.in_transaction
        with contextlib.nullcontext() if outer else immediate(self._db):
            if key is not None:
                self._db.execute("DELETE FROM outbox WHERE lane = ? AND key = ?", (lane, key))
            seq = self._db.execute(
                "INSERT INTO outbox (kind, body, size, queued_at, lane, key) VALUES (?, ?, ?, ?, ?, ?)",
                (kind, text, size, time.time(), lane, key)).lastrowid
            dropped = self._enforce_caps(lane)
        if dropped:
            self._warn_full(dropped)
        waiting = self._lane(lane)
        if waiting.waiting_since is None:
            waiting.waiting_since = time.monotonic()
        self._wake.set()
        return int(seq or 0)

    def _enforce_caps(self, lane: str) -> int:
        """The caps hold per lane: a flood of one kind of report never pushes out another kind."""
        count, total = self._db.execute("SELECT count(*), coalesce(sum(size), 0) FROM outbox WHERE lane = ?",
                                        (lane,)).fetchone()
        dropped = 0
        while count > 1 and (count > self.max_entries or total > self.max_bytes):
            seq, size = self._db.execute("SELECT seq, size FROM outbox WHERE lane = ? ORDER BY seq LIMIT 1",
                                         (lane,)).fetchone()
            self._db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))
            count, total, dropped = count - 1, total - size, dropped + 1
        if dropped:
            self._count("dropped_full", lane, dropped)
        return dropped

    def _count(self, name: str, lane: str, n: int) -> None:
        for counter in (name, f"{name}:{lane}"):
            self._db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
                             (counter, n, n))

    def _warn_full(self, dropped: int) -> None:
        now = time.monotonic()
        if now - self._full_warned_at >= 60:
            self._full_warned_at = now
            log.warning("uplink outbox full (%d entries / %d bytes at most per kind): %d oldest report(s) dropped",
                        self.max_entries, self.max_bytes, dropped)

    def pending(self, lane: str | None = None, limit: int = -1) -> list[Entry]:
        """The entries of `lane` (every lane: None), oldest first, at most `limit` (-1: all)."""
        rows = self._db.execute("SELECT seq, kind, body, key FROM outbox WHERE ?1 IS NULL OR lane = ?1 ORDER BY seq "
                                "LIMIT ?2", (lane, limit)).fetchall()
        return [Entry(seq, kind, json.loads(body), key) for seq, kind, body, key in rows]  # our own 0600 file

    def _remove(self, lane: str, entries: Sequence[Entry], counter: str | None = None) -> None:
        with immediate(self._db):
            self._db.executemany("DELETE FROM outbox WHERE seq = ?", [(e.seq,) for e in entries])
            if counter is not None:
                self._count(counter, lane, len(entries))
                self._count(counter + "_batches", lane, 1)

    # -- delivering -------------------------------------------------------------------------------------------

    async def deliver(self, lane: str | None = None) -> list[int]:
        """Send what is queued now, whatever the backoff says, lane by lane (oldest first within one) until each
        is empty or fails in a way worth retrying; returns the sequence numbers the control plane took. Callers
        that want it now (a reconcile cycle, the drain at shutdown) call this; the `run` service delivers a lane
        when it is due."""
        names = [lane] if lane is not None else self._lanes_waiting()
        taken: list[int] = []
        for name in names:
            async with self._lane(name).lock:
                taken += await self._deliver_lane(name)
        return taken

    async def _deliver_when_due(self, name: str) -> None:
        """The service's delivery of one lane: unless a caller of `deliver` just failed it (and so moved its
        backoff on), in which case its next try waits for that."""
        lane = self._lane(name)
        async with lane.lock:
            if lane.due() > time.monotonic():
                return
            try:
                await self._deliver_lane(name)
            except sqlite3.Error as exc:  # the file cannot be read or written now: tried again on the backoff
                delay = lane.backoff.next_delay()
                lane.retry_at = time.monotonic() + delay
                log.error("uplink outbox %s: the %s lane cannot be delivered now (%s); tried again in %.0fs",
                          self.path or "(memory)", name, exc, delay)

    async def _deliver_lane(self, name: str) -> list[int]:
        lane = self._lane(name)
        taken: list[int] = []
        while entries := self.pending(name, lane.batch):
            what = _describe(name, entries)
            try:
                await lane.send(entries)
            except NoSender:
                lane.retry_at = time.monotonic() + PARKED
                log.debug("%s: left queued, nobody here sends it", what)
                return taken
            except (PlexdError, OSError) as exc:
                # A control-plane answer goes by the one policy; anything else the node could not do (no network,
                # a failed re-registration) is retried on the backoff.
                verdict = (retry_verdict(exc, lane.backoff) if isinstance(exc, ControlPlaneError)
                           else Verdict(True, lane.backoff.next_delay(), str(exc) or type(exc).__name__))
                if verdict.retry:
                    self._failed(name, lane, what, verdict)
                    return taken
                log.error("%s report dropped: the control plane refused it for good (%s)", what, verdict.reason)
                self._remove(name, entries, "refused")
                continue
            except Exception:  # a bug in building the request: never let one entry block the lane
                log.exception("%s report dropped: it cannot be sent", what)
                self._remove(name, entries, "refused")
                continue
            self._remove(name, entries)
            taken += [e.seq for e in entries]
            lane.sent += len(entries)
            if lane.failing:
                log.info("%s reports delivered again", name)
            lane.last_error, lane.failing, lane.retry_at = "", False, 0.0
            lane.backoff.reset()
        lane.waiting_since = None
        return taken

    def _failed(self, name: str, lane: _Lane, what: str, verdict: Verdict) -> None:
        lane.last_error = verdict.reason
        lane.retry_at = time.monotonic() + verdict.delay
        self._db.execute("UPDATE outbox SET attempts = attempts + 1 WHERE seq = "
                         "(SELECT min(seq) FROM outbox WHERE lane = ?)", (name,))
        level = logging.INFO if lane.failing else logging.WARNING  # once per outage, not once per retry
        lane.failing = True
        log.log(level, "%s report not delivered (%s); %d queued, retrying in %.0fs", what, verdict.reason,
                self.size(name), verdict.delay)

    def _lanes_waiting(self) -> list[str]:
        """Lanes with entries, the one holding the oldest first."""
        rows = self._db.execute("SELECT lane, min(seq) AS first FROM outbox GROUP BY lane ORDER BY first")
        return [lane for lane, _ in rows.fetchall()]

    async def run(self) -> None:
        """The service: deliver each lane when it is due (something queued, its debounce and backoff over), each
        lane in a task of its own, so a lane whose request hangs until its timeout holds up no other."""
        busy: dict[str, asyncio.Task[None]] = {}

        def done(name: str) -> None:
            busy.pop(name, None)
            self._wake.set()

        try:
            while True:
                self._wake.clear()
                now = time.monotonic()
                waits = []
                for name in self._lanes_waiting():
                    if name in busy:
                        continue
                    lane = self._lane(name)
                    if lane.waiting_since is None:
                        lane.waiting_since = now  # queued by an earlier run of the daemon
                    if lane.due() <= now:
                        busy[name] = task = asyncio.create_task(self._deliver_when_due(name))
                        task.add_done_callback(lambda _t, n=name: done(n))
                    else:
                        waits.append(lane.due())
                await wait_event(self._wake, min(waits, default=now + 3600) - now)
        finally:
            for task in busy.values():
                task.cancel()
            await asyncio.gather(*busy.values(), return_exceptions=True)

    async def flush(self, timeout: float, lane: str | None = None) -> bool:
        """Deliver until the lane (every lane: None) is empty, retrying on its backoff, at most `timeout`
        seconds; True when nothing is left."""
        async def until_empty() -> None:
            while self.size(lane):
                await self.deliver(lane)
                if self.size(lane):
                    waits = [self._lane(n).retry_at for n in ([lane] if lane else self._lanes_waiting())]
                    await asyncio.sleep(max(0.05, min(waits, default=0.0) - time.monotonic()))

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(until_empty(), timeout)
        return self.size(lane) == 0

    # -- state ------------------------------------------------------------------------------------------------

    def size(self, lane: str | None = None) -> int:
        return int(self._db.execute("SELECT count(*) FROM outbox WHERE ?1 IS NULL OR lane = ?1",
                                    (lane,)).fetchone()[0])

    def counter(self, name: str, lane: str | None = None) -> int:
        row = self._db.execute("SELECT value FROM counters WHERE name = ?",
                               (name if lane is None else f"{name}:{lane}",)).fetchone()
        return int(row[0]) if row else 0

    @property
    def sent(self) -> int:
        return sum(lane.sent for lane in self._lanes.values())

    @property
    def last_error(self) -> str:
        return next((lane.last_error for lane in self._lanes.values() if lane.last_error), "")

    def retry_at(self, lane: str) -> float:
        """When the lane's next try is due after a failure (monotonic; 0: not waiting on a failure)."""
        return self._lane(lane).retry_at

    def status(self, lane: str | None = None) -> dict[str, Any]:
        if lane is None:
            return {"pending": self.size(), "sent": self.sent, "refused": self.counter("refused"),
                    "dropped_full": self.counter("dropped_full"), "last_error": self.last_error}
        state = self._lane(lane)
        return {"pending": self.size(lane), "sent": state.sent, "refused": self.counter("refused", lane),
                "dropped_full": self.counter("dropped_full", lane), "last_error": state.last_error}

    def close(self) -> None:
        self._db.close()


def _describe(lane: str, entries: Sequence[Entry]) -> str:
    """An entry's kind (and execution), or a batch's lane, size and keys, for a log line."""
    if len(entries) == 1 and entries[0].key is None:
        execution = entries[0].body.get("execution_id")
        return entries[0].kind + (f" for execution {execution}" if execution else "")
    keys = ", ".join(sorted(e.key for e in entries if e.key is not None))
    return f"{lane} batch of {len(entries)}" + (f" (keys: {keys[:300]})" if keys else "")


def _add_lanes(db: sqlite3.Connection) -> None:
    columns = {row[1] for row in db.execute("PRAGMA table_info(outbox)")}
    if "lane" not in columns:  # a file of the first version: its entries go in the lane of their kind
        with immediate(db):
            db.execute("ALTER TABLE outbox ADD COLUMN lane TEXT NOT NULL DEFAULT ''")
            db.execute("ALTER TABLE outbox ADD COLUMN key TEXT")
            db.execute("UPDATE outbox SET lane = kind")
    db.executescript(_LANES)


def _like(backoff: Backoff) -> Backoff:
    """A backoff of the same shape, for a lane of its own."""
    return Backoff(base=backoff.base, cap=backoff.cap, factor=backoff.factor, jitter=backoff.jitter)


def by_kind(senders: dict[str, Poster]) -> Send:
    """One `send` for an outbox that carries several kinds of report, each posted its own way."""

    async def send(kind: str, body: dict[str, Any]) -> None:
        post = senders.get(kind)
        if post is None:
            raise NoSender(kind)  # left queued for a process that sends it
        await post(body)

    return send
