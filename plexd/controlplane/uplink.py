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
                                telemetry_metrics  telemetry, each entry a row of up to 100 points, log lines or
                                telemetry_logs     audit records stored as their JSON texts and sent as they are,
                                telemetry_audit    with the byte caps of `telemetry.*.queue_max_bytes`; queued
                                                   from worker threads through a `writer()`, with the log sources'
                                                   positions in the same transaction (`plexd.telemetry.queue`)
    retry_verdict(exc)        the one retry policy (`plexd.controlplane.retry`)

Entries leave the outbox only when the control plane took them or refused them for good, so a report made while
the control plane was down is delivered after it comes back, across a daemon restart too, exactly once (a crash
between the answer and the delete sends it again: at least once, never lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexd.base.backoff import Backoff
from plexd.base.clock import wait_event
from plexd.base.errors import PlexdError
from plexd.base.sqlitefile import connect_private, immediate, open_or_start_empty
from plexd.controlplane.client_errors import AlreadySettled, ControlPlaneError
from plexd.controlplane.retry import Verdict, retry_verdict

log = logging.getLogger(__name__)

MAX_ENTRIES = 10_000
MAX_BYTES = 16 << 20
_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, body TEXT NOT NULL,
                                   size INTEGER NOT NULL, queued_at REAL NOT NULL, attempts INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- what each lane holds, kept with every insert and delete (the caps and the status read it, never the rows)
CREATE TABLE IF NOT EXISTS lane_totals (lane TEXT PRIMARY KEY, rows INTEGER NOT NULL, entries INTEGER NOT NULL,
                                        bytes INTEGER NOT NULL) WITHOUT ROWID;
"""
# Lanes and keys came after the first files were written: added to an older file when it is opened.
_LANES = """
CREATE INDEX IF NOT EXISTS outbox_by_lane ON outbox (lane, seq);
CREATE UNIQUE INDEX IF NOT EXISTS outbox_by_key ON outbox (lane, key) WHERE key IS NOT NULL;
"""
UNLIMITED = 1 << 62

PARKED = 3600.0  # how long a lane nobody here can send waits before it is looked at again

Send = Callable[[str, dict[str, Any]], Awaitable[None]]
Poster = Callable[[dict[str, Any]], Awaitable[None]]


class NoSender(PlexdError):
    """Raised by a `send` for a kind this process does not deliver (`plexd reconcile --once` sends drift reports
    only): the lane's entries stay queued for the daemon, untouched."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"no sender for {kind!r} in this process: left queued")
        self.kind = kind


@dataclass(frozen=True)
class Entry:
    """One row of a lane: a JSON object (`body`), or for a packed lane (telemetry) a JSON array of `n` entries,
    sent as they are (`text`; `items` is the array's inside)."""

    seq: int
    kind: str
    text: str
    key: str | None = None
    n: int = 1

    @functools.cached_property
    def body(self) -> dict[str, Any]:
        return json.loads(self.text)  # our own 0600 file

    @property
    def items(self) -> str:
        """A packed row's entries, comma-joined, to go inside a larger array."""
        return self.text[1:-1]


BatchSend = Callable[[Sequence[Entry]], Awaitable[None]]


@dataclass
class _Lane:
    """One stream: how it is sent, and where its delivery stands."""

    send: BatchSend
    batch: int  # rows a send carries at most
    debounce: float  # after the first entry of a quiet lane, wait this long for others to join it
    backoff: Backoff
    max_entries: int
    max_bytes: int
    batch_entries: int = UNLIMITED  # and at most this many entries (packed rows hold several)
    batch_bytes: int = UNLIMITED  # and at most this much (one larger row alone)
    on_drop: Callable[[int, int], None] | None = None  # (entries, bytes) the caps dropped; any thread
    has_news: Callable[[], bool] | None = None  # something to send with no entry queued (telemetry's drop notices)
    sent_upto: int = 0  # the highest sequence number the control plane took (not sent again if its delete failed)
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
            _recount(self._db)
        else:
            self._db = open_or_start_empty(self.path, self._connect, "uplink outbox",
                                           "reports and action results queued for the control plane are lost, "
                                           "and executions from before cannot be recognised as replays")
        self._lanes: dict[str, _Lane] = {}
        self._wake = asyncio.Event()
        try:  # the loop `run` will serve on: writers in worker threads wake it
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._full_warned_at = 0.0

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        db = connect_private(self.path, _SCHEMA, synchronous="FULL", probe_table="outbox")
        _add_lanes(db)
        _recount(db)
        return db

    def add_lane(self, name: str, send: BatchSend, *, batch: int = 1, debounce: float = 0.0,
                 backoff: Backoff | None = None, max_entries: int | None = None, max_bytes: int | None = None,
                 batch_entries: int = UNLIMITED, batch_bytes: int = UNLIMITED,
                 on_drop: Callable[[int, int], None] | None = None,
                 has_news: Callable[[], bool] | None = None) -> None:
        """A lane whose entries `send` delivers, up to `batch` rows, `batch_entries` entries and `batch_bytes` at
        once (one larger row alone); its caps are the outbox's unless given. `on_drop(entries, bytes)`, when
        given, says what the caps dropped instead of the outbox's own warning. `has_news()`: the lane has
        something to send although no entry is queued (`send` is then called with none; `notify` wakes it)."""
        self._lanes[name] = _Lane(send, batch, debounce, backoff or _like(self.backoff),
                                  max_entries or self.max_entries, max_bytes or self.max_bytes, batch_entries,
                                  batch_bytes, on_drop, has_news)

    def _lane(self, name: str) -> _Lane:
        lane = self._lanes.get(name)
        if lane is None:
            async def one_at_a_time(entries: Sequence[Entry]) -> None:
                for entry in entries:
                    if entry.n != 1:  # a packed lane (telemetry) whose sender is not in this process
                        raise NoSender(entry.kind)
                    await self._send(entry.kind, entry.body)

            lane = self._lanes[name] = _Lane(one_at_a_time, 1, 0.0, _like(self.backoff), self.max_entries,
                                             self.max_bytes)
        return lane

    # -- queueing ---------------------------------------------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        """The outbox's connection, for a store that keeps its own tables in the same file (the action journal)
        and must queue an entry in the transaction that changes them. The event loop's thread only: a worker
        thread queues through a `writer()`."""
        return self._db

    def put(self, kind: str, body: dict[str, Any], *, lane: str | None = None, key: str | None = None) -> int:
        """Queue one entry, on disk before this returns (or with the caller's open transaction on `db`); the oldest
        go when the caps are reached. `lane` defaults to the kind. A `key` replaces the lane's entry of that key,
        which moves to the end. Returns its sequence number (`deliver` lists those the control plane took)."""
        text = json.dumps(body, separators=(",", ":"))  # ASCII: a lone surrogate from outside input is escaped
        lane = lane or kind
        with contextlib.nullcontext() if self._db.in_transaction else immediate(self._db):
            seq, dropped = self._insert(self._db, lane, kind, [(text, 1)], key)
        self._dropped(lane, *dropped)
        self._queued(lane)
        return seq

    def writer(self, *, durable: bool = True) -> UplinkWriter:
        """A connection of its own to this outbox's file, for one worker thread (the event loop's `db` is never
        used from another thread). `durable=False`: commits are safe from a crash of the process, and may be lost
        with the machine's power (synchronous=NORMAL: telemetry, written every few seconds)."""
        if self.path is None:
            raise ValueError("an outbox in memory has no writer for other threads")
        return UplinkWriter(self, connect_private(self.path, _SCHEMA, synchronous="FULL" if durable else "NORMAL",
                                                  probe_table="outbox"))

    def _insert(self, db: sqlite3.Connection, lane: str, kind: str, rows: Sequence[tuple[str, int]],
                key: str | None = None) -> tuple[int, tuple[int, int]]:
        """Insert `rows` (text, entries in it) in `db`'s open transaction and hold the lane's caps: (the last
        sequence number, (entries, bytes) dropped)."""
        if key is not None:
            _delete_rows(db, lane, "key = ?", (key,))
        now, seq, total = time.time(), 0, 0
        for text, n in rows:
            size = len(text.encode())
            total += size
            seq = db.execute("INSERT INTO outbox (kind, body, size, queued_at, lane, key, n) VALUES (?, ?, ?, ?, ?, ?, "
                             "?)", (kind, text, size, now, lane, key, n)).lastrowid or 0
        _tally(db, lane, len(rows), sum(n for _, n in rows), total)
        return int(seq), self._enforce_caps(db, lane)

    def _enforce_caps(self, db: sqlite3.Connection, lane: str) -> tuple[int, int]:
        """The caps hold per lane: a flood of one kind of report never pushes out another kind. The newest row is
        always kept."""
        caps = self._lane(lane)
        count, _, total = _totals(db, lane)
        if count <= caps.max_entries and total <= caps.max_bytes:
            return 0, 0
        last = None
        for seq, size in db.execute("SELECT seq, size FROM outbox WHERE lane = ? ORDER BY seq", (lane,)):
            if count <= 1 or (count <= caps.max_entries and total <= caps.max_bytes):
                break
            count, total, last = count - 1, total - size, seq
        entries, freed = _delete_rows(db, lane, "seq <= ?", (last,))
        _count(db, "dropped_full", lane, entries)
        _count(db, "dropped_bytes", lane, freed)
        return entries, freed

    def _dropped(self, lane: str, entries: int, nbytes: int) -> None:
        if not entries:
            return
        on_drop = self._lane(lane).on_drop
        if on_drop is not None:
            on_drop(entries, nbytes)
            return
        now = time.monotonic()
        if now - self._full_warned_at >= 60:
            self._full_warned_at = now
            log.warning("uplink outbox full (%d entries / %d bytes at most per kind): %d oldest report(s) dropped",
                        self.max_entries, self.max_bytes, entries)

    def notify(self, lane: str) -> None:
        """`lane` has something to send (queued, or news): from any thread."""
        self._queued(lane)

    def _queued(self, lane: str) -> None:
        """Something was queued on `lane`: its debounce starts, and the service looks again. From another thread
        (a writer's), handed to the event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._queued, lane)
                return
        waiting = self._lane(lane)
        if waiting.waiting_since is None:
            waiting.waiting_since = time.monotonic()
        self._wake.set()

    def pending(self, lane: str | None = None, limit: int = -1) -> list[Entry]:
        """The entries of `lane` (every lane: None), oldest first, at most `limit` rows (-1: all)."""
        rows = self._db.execute("SELECT seq, kind, body, key, n FROM outbox WHERE ?1 IS NULL OR lane = ?1 "
                                "ORDER BY seq LIMIT ?2", (lane, limit)).fetchall()
        return [Entry(*row) for row in rows]

    def _batch(self, name: str, lane: _Lane) -> list[Entry]:
        """The lane's next batch: at most `batch` rows, `batch_entries` and `batch_bytes` (the first row whatever
        its size), past what the control plane already took. Read row by row: only what goes is fetched."""
        entries: list[Entry] = []
        size = count = 0
        for row in self._db.execute("SELECT seq, kind, body, key, n FROM outbox WHERE lane = ? AND seq > ? "
                                    "ORDER BY seq LIMIT ?", (name, lane.sent_upto, lane.batch)):
            entry = Entry(*row)
            size, count = size + len(entry.text), count + entry.n
            if entries and (size > lane.batch_bytes or count > lane.batch_entries):
                break
            entries.append(entry)
        return entries

    def _remove(self, lane: str, entries: Sequence[Entry], counter: str | None = None) -> None:
        """Delete `entries` of `lane`, counting them under `counter` when given ("refused")."""
        with immediate(self._db):
            seqs = ",".join(str(e.seq) for e in entries)  # plexd's own integers
            _delete_rows(self._db, lane, f"seq IN ({seqs})", ())
            if counter is not None:
                _count(self._db, counter, lane, sum(e.n for e in entries))
                _count(self._db, counter + "_batches", lane, 1)

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
        if lane.sent_upto:  # taken by the control plane, not deleted then (a full disk): deleted now
            with immediate(self._db):
                _delete_rows(self._db, name, "seq <= ?", (lane.sent_upto,))
        news = lane.has_news is not None and lane.has_news()
        while (entries := self._batch(name, lane)) or news:
            news = False  # news alone goes once, with no entry
            what = _describe(name, entries) if entries else f"{name} notice"
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
                if isinstance(exc, AlreadySettled):
                    log.info("%s report dropped: the control plane has it settled already (%s)", what, verdict.reason)
                else:
                    log.error("%s report dropped: the control plane refused it for good (%s)", what,
                              verdict.reason)
                self._remove(name, entries, "refused")
                continue
            except Exception:  # a bug in building the request: never let one entry block the lane
                log.exception("%s report dropped: it cannot be sent", what)
                self._remove(name, entries, "refused")
                continue
            if entries:
                # Taken: never sent again, even if the delete below fails (a full disk) and the rows stay a while.
                lane.sent_upto = max(lane.sent_upto, entries[-1].seq)
                self._remove(name, entries)
            taken += [e.seq for e in entries]
            lane.sent += sum(e.n for e in entries)
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
                _totals(self._db, name)[1], verdict.delay)

    def _lanes_waiting(self) -> list[str]:
        """Lanes with entries, the one holding the oldest first, then lanes with news only."""
        firsts = []
        for (name,) in self._db.execute("SELECT lane FROM lane_totals WHERE rows > 0").fetchall():
            (first,) = self._db.execute("SELECT min(seq) FROM outbox WHERE lane = ?", (name,)).fetchone()
            if first is not None:
                firsts.append((first, name))
        waiting = [name for _, name in sorted(firsts)]
        return waiting + [name for name, lane in self._lanes.items()
                          if name not in waiting and lane.has_news is not None and lane.has_news()]

    def control_plane_back(self, spread: float = 2.0) -> None:
        """The control plane answers again (the event stream reconnected): lanes that failed while it was away try
        again within `spread` seconds rather than at the end of a backoff that grew during the outage (up to a
        minute: acks and results of actions waited that long after a 30 s outage, `python -m bench chaos`). The
        spread is random, on top of the stream's own jittered reconnect, so a fleet does not send at once."""
        now = time.monotonic()
        for lane in self._lanes.values():
            if lane.failing:
                lane.backoff.reset()
                lane.retry_at = min(lane.retry_at, now + random.uniform(0, spread))
        self._wake.set()

    async def run(self) -> None:
        """The service: deliver each lane when it is due (something queued, its debounce and backoff over), each
        lane in a task of its own, so a lane whose request hangs until its timeout holds up no other."""
        busy: dict[str, asyncio.Task[None]] = {}
        self._loop = asyncio.get_running_loop()

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
        """Rows queued (a packed row holds several entries)."""
        return int(self._db.execute("SELECT coalesce(sum(rows), 0) FROM lane_totals WHERE ?1 IS NULL OR lane = ?1",
                                    (lane,)).fetchone()[0])

    def count(self, name: str, lane: str, n: int) -> None:
        """Add `n` to a persisted counter of `lane` (`counter` reads it)."""
        with immediate(self._db):
            _count(self._db, name, lane, n)

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
        """`pending` counts entries (a packed row holds several), `bytes` what they take on disk."""
        entries, nbytes = self._db.execute("SELECT coalesce(sum(entries), 0), coalesce(sum(bytes), 0) FROM "
                                           "lane_totals WHERE ?1 IS NULL OR lane = ?1", (lane,)).fetchone()
        state = self._lane(lane) if lane is not None else None
        return {"pending": entries, "bytes": nbytes, "sent": state.sent if state else self.sent,
                "refused": self.counter("refused", lane), "dropped_full": self.counter("dropped_full", lane),
                "dropped_bytes": self.counter("dropped_bytes", lane),
                "last_error": state.last_error if state else self.last_error}

    def close(self) -> None:
        self._db.close()


class UplinkWriter:
    """A worker thread's way into the outbox: its own connection to the file, one transaction at a time.

        with writer.transaction() as db:      BEGIN IMMEDIATE on the writer's connection; `db` for the caller's
            writer.put_texts(...)             own tables (positions), committed with the entries
    """

    def __init__(self, outbox: UplinkOutbox, db: sqlite3.Connection) -> None:
        self._outbox, self.db = outbox, db
        self._lock = threading.Lock()  # collectors in several threads share one writer
        self._queued: list[tuple[str, int, int]] = []  # lanes written in the open transaction, and drops

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._queued = []
            with immediate(self.db):
                yield self.db
            for lane, entries, nbytes in self._queued:  # committed: now they may be announced
                self._outbox._dropped(lane, entries, nbytes)
                self._outbox._queued(lane)

    def put_texts(self, lane: str, kind: str, rows: Sequence[tuple[str, int]]) -> None:
        """Queue rows of (a JSON array of entries, how many) in the open transaction."""
        if rows:
            _, dropped = self._outbox._insert(self.db, lane, kind, rows)
            self._queued.append((lane, *dropped))

    def count(self, name: str, lane: str, n: int) -> None:
        """Add `n` to a persisted counter of `lane`, in the open transaction."""
        _count(self.db, name, lane, n)

    def close(self) -> None:
        with self._lock:
            self.db.close()


def _describe(lane: str, entries: Sequence[Entry]) -> str:
    """An entry's kind (and execution), or a batch's lane, size and keys, for a log line."""
    if len(entries) == 1 and entries[0].key is None and entries[0].n == 1:
        body = entries[0].body
        execution = body.get("execution_id") if isinstance(body, dict) else None
        return entries[0].kind + (f" for execution {execution}" if execution else "")
    keys = ", ".join(sorted(e.key for e in entries if e.key is not None))
    return f"{lane} batch of {sum(e.n for e in entries)}" + (f" (keys: {keys[:300]})" if keys else "")


def _add_lanes(db: sqlite3.Connection) -> None:
    columns = {row[1] for row in db.execute("PRAGMA table_info(outbox)")}
    if "lane" not in columns:  # a file of the first version: its entries go in the lane of their kind
        with immediate(db):
            db.execute("ALTER TABLE outbox ADD COLUMN lane TEXT NOT NULL DEFAULT ''")
            db.execute("ALTER TABLE outbox ADD COLUMN key TEXT")
            db.execute("UPDATE outbox SET lane = kind")
    if "n" not in columns:  # before packed lanes: one entry a row
        try:
            db.execute("ALTER TABLE outbox ADD COLUMN n INTEGER NOT NULL DEFAULT 1")
        except sqlite3.OperationalError as exc:  # `plexd reconcile --once` added it at the same moment
            if "duplicate column" not in str(exc):
                raise
    db.executescript(_LANES)


def _recount(db: sqlite3.Connection) -> None:
    """The lanes' totals from their rows, once at open: an older file has none, and nothing else keeps them in
    step with a row changed from outside."""
    with immediate(db):
        db.execute("DELETE FROM lane_totals")
        db.execute("INSERT INTO lane_totals SELECT lane, count(*), sum(n), sum(size) FROM outbox GROUP BY lane")


def _delete_rows(db: sqlite3.Connection, lane: str, where: str, params: tuple[Any, ...]) -> tuple[int, int]:
    """Delete `lane`'s rows matching `where` in the open transaction, keeping the lane's totals; (entries, bytes)
    deleted."""
    gone = db.execute(f"DELETE FROM outbox WHERE lane = ? AND {where} RETURNING n, size", (lane, *params)).fetchall()
    entries, nbytes = sum(n for n, _ in gone), sum(size for _, size in gone)
    _tally(db, lane, -len(gone), -entries, -nbytes)
    return entries, nbytes


def _tally(db: sqlite3.Connection, lane: str, rows: int, entries: int, nbytes: int) -> None:
    db.execute("INSERT INTO lane_totals VALUES (?, ?, ?, ?) ON CONFLICT(lane) DO UPDATE SET rows = rows + ?, "
               "entries = entries + ?, bytes = bytes + ?", (lane, rows, entries, nbytes, rows, entries, nbytes))


def _totals(db: sqlite3.Connection, lane: str) -> tuple[int, int, int]:
    """(rows, entries, bytes) the lane holds."""
    row = db.execute("SELECT rows, entries, bytes FROM lane_totals WHERE lane = ?", (lane,)).fetchone()
    return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)


def _count(db: sqlite3.Connection, name: str, lane: str, n: int) -> None:
    """Add `n` to a persisted counter, in all and for the lane (in the caller's transaction)."""
    for counter in (name, f"{name}:{lane}"):
        db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
                   (counter, n, n))


def _like(backoff: Backoff) -> Backoff:
    """A backoff of the same shape, for a lane of its own."""
    return Backoff(base=backoff.base, cap=backoff.cap, factor=backoff.factor, jitter=backoff.jitter)


class Senders:
    """The `send` of an outbox that carries several kinds of report, each posted its own way. A kind whose sender
    is made after the outbox (the NAT endpoint's: the engine's domain) is added with `add`."""

    def __init__(self, senders: dict[str, Poster]) -> None:
        self._senders = dict(senders)

    def add(self, kind: str, post: Poster) -> None:
        if kind in self._senders:
            raise ValueError(f"the uplink already has a sender for {kind!r}")
        self._senders[kind] = post

    async def __call__(self, kind: str, body: dict[str, Any]) -> None:
        post = self._senders.get(kind)
        if post is None:
            raise NoSender(kind)  # left queued for a process that sends it
        await post(body)


def by_kind(senders: dict[str, Poster]) -> Senders:
    """One `send` for an outbox that carries several kinds of report, each posted its own way."""
    return Senders(senders)
