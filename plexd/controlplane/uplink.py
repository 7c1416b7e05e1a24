"""What the node tells the control plane when it cannot be told now: one durable, bounded outbox and one policy.

    UplinkOutbox(path, send)  data_dir/uplink.db (SQLite, WAL, 0600): entries of a kind with a JSON body, oldest
                              first; `put` is durable before it returns; past `max_entries`/`max_bytes` the oldest
                              are dropped, counted and logged; an unreadable file is moved aside, never fatal
    retry_verdict(exc)        the one retry policy (`plexd.controlplane.retry`), shared with action results,
                              node-API report sync and telemetry

Entries leave the outbox only when the control plane took them or refused them for good, so a report made while
the control plane was down is delivered after it comes back, across a daemon restart too, exactly once (a crash
between the answer and the delete sends it again: at least once, never lost).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexd.base.backoff import Backoff
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

Send = Callable[[str, dict[str, Any]], Awaitable[None]]
Poster = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Entry:
    seq: int
    kind: str
    body: dict[str, Any]


class UplinkOutbox:
    def __init__(self, path: str | Path | None, send: Send, *, backoff: Backoff | None = None,
                 max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        """`path` None: an outbox in memory (`plexd reconcile --once` without a data_dir to share, tests)."""
        self.path = Path(path) if path is not None else None
        self._send = send
        self.backoff = backoff or Backoff()
        self.max_entries, self.max_bytes = max_entries, max_bytes
        if self.path is None:
            self._db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            self._db.executescript(_SCHEMA)
        else:
            self._db = open_or_start_empty(self.path, self._connect, "uplink outbox",
                                           "reports queued for the control plane are lost")
        self._lock = asyncio.Lock()  # one delivery pass at a time, oldest first
        self._wake = asyncio.Event()
        self._retry_at = 0.0  # monotonic: the backoff's next try
        self.sent = 0
        self.last_error = ""
        self._full_warned_at = 0.0

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        return connect_private(self.path, _SCHEMA, synchronous="FULL", probe_table="outbox")

    # -- queueing ---------------------------------------------------------------------------------------------

    def put(self, kind: str, body: dict[str, Any]) -> int:
        """Queue one entry, on disk before this returns; the oldest go when the caps are reached. Returns its
        sequence number (`deliver` lists those the control plane took)."""
        text = json.dumps(body, separators=(",", ":"))
        size = len(text.encode())
        with immediate(self._db):
            seq = self._db.execute("INSERT INTO outbox (kind, body, size, queued_at) VALUES (?, ?, ?, ?)",
                                   (kind, text, size, time.time())).lastrowid
            dropped = self._enforce_caps()
            if dropped:
                self._count("dropped_full", dropped)
        if dropped:
            self._warn_full(dropped)
        self._wake.set()
        return int(seq or 0)

    def _enforce_caps(self) -> int:
        count, total = self._db.execute("SELECT count(*), coalesce(sum(size), 0) FROM outbox").fetchone()
        dropped = 0
        while count > 1 and (count > self.max_entries or total > self.max_bytes):
            seq, size = self._db.execute("SELECT seq, size FROM outbox ORDER BY seq LIMIT 1").fetchone()
            self._db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))
            count, total, dropped = count - 1, total - size, dropped + 1
        return dropped

    def _count(self, name: str, n: int) -> None:
        self._db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
                         (name, n, n))

    def _warn_full(self, dropped: int) -> None:
        now = time.monotonic()
        if now - self._full_warned_at >= 60:
            self._full_warned_at = now
            log.warning("uplink outbox full (%d entries / %d bytes at most): %d oldest report(s) dropped",
                        self.max_entries, self.max_bytes, dropped)

    def pending(self) -> list[Entry]:
        rows = self._db.execute("SELECT seq, kind, body FROM outbox ORDER BY seq").fetchall()
        return [Entry(seq, kind, json.loads(body)) for seq, kind, body in rows]  # our own 0600 file

    def _head(self) -> Entry | None:
        row = self._db.execute("SELECT seq, kind, body FROM outbox ORDER BY seq LIMIT 1").fetchone()
        return None if row is None else Entry(row[0], row[1], json.loads(row[2]))

    def _remove(self, seq: int, counter: str | None = None) -> None:
        with immediate(self._db):
            self._db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))
            if counter is not None:
                self._count(counter, 1)

    # -- delivering -------------------------------------------------------------------------------------------

    async def deliver(self) -> list[int]:
        """Send what is queued, oldest first, until empty or a failure worth retrying; returns the sequence
        numbers the control plane took. Callers that want it now (a reconcile cycle) call this directly; the
        `run` service calls it on a wake-up or when the backoff is over."""
        taken: list[int] = []
        async with self._lock:
            while (entry := self._head()) is not None:
                try:
                    await self._send(entry.kind, entry.body)
                except (ControlPlaneError, OSError) as exc:
                    verdict = (retry_verdict(exc, self.backoff) if isinstance(exc, ControlPlaneError)
                               else Verdict(True, self.backoff.next_delay(), str(exc) or type(exc).__name__))
                    if verdict.retry:
                        self.last_error = verdict.reason
                        self._retry_at = time.monotonic() + verdict.delay
                        self._db.execute("UPDATE outbox SET attempts = attempts + 1 WHERE seq = ?", (entry.seq,))
                        log.warning("%s report not delivered (%s); %d queued, retrying in %.0fs", entry.kind,
                                    verdict.reason, self.size(), verdict.delay)
                        return taken
                    log.error("%s report dropped: the control plane refused it for good (%s)", entry.kind,
                              verdict.reason)
                    self._remove(entry.seq, "refused")
                    continue
                except Exception:  # a bug in building the request: never let one entry block the queue
                    log.exception("%s report dropped: it cannot be sent", entry.kind)
                    self._remove(entry.seq, "refused")
                    continue
                self._remove(entry.seq)
                taken.append(entry.seq)
                self.sent += 1
                self.last_error = ""
                self.backoff.reset()
                self._retry_at = 0.0
        return taken

    async def run(self) -> None:
        """The service: deliver whenever something is queued, retrying on the backoff's schedule."""
        while True:
            wait = self._retry_at - time.monotonic()
            if self.size() == 0:
                self._wake.clear()
                await self._wake.wait()
            elif wait > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
                if time.monotonic() < self._retry_at:
                    continue  # woken by a put during the backoff: wait it out, the queue goes in order
            await self.deliver()

    # -- state ------------------------------------------------------------------------------------------------

    def size(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM outbox").fetchone()[0])

    def counter(self, name: str) -> int:
        row = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row else 0

    def status(self) -> dict[str, Any]:
        return {"pending": self.size(), "sent": self.sent, "refused": self.counter("refused"),
                "dropped_full": self.counter("dropped_full"), "last_error": self.last_error}

    def close(self) -> None:
        self._db.close()


def by_kind(senders: dict[str, Poster]) -> Send:
    """One `send` for an outbox that carries several kinds of report, each posted its own way."""

    async def send(kind: str, body: dict[str, Any]) -> None:
        post = senders.get(kind)
        if post is None:
            raise ValueError(f"no way to send a {kind!r} report")  # dropped and logged by the outbox
        await post(body)

    return send
