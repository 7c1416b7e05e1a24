"""The telemetry spool: one bounded, ordered, on-disk queue per stream (metrics, logs, audit) in one SQLite file
(``data_dir/telemetry.db``, 0600, WAL).

Why on disk and bounded in bytes: the Go agent keeps at most twice a batch in memory, so an outage of a few
minutes loses data and a restart loses all of it. Here an outage of hours and any number of restarts lose
nothing until a stream's byte cap is reached; then the *oldest* entries go first, and every such loss is counted
(``dropped``, persisted) and handed to `on_drop` (a log line, a metric, a log entry for the control plane).

The entries of one append are stored together, up to `pack` (and `PACK_BYTES`) to a row, as their JSON
texts joined by commas, and a batch is sent as those texts inside one array: at 1,000 peers a collection is 10 rows
instead of 1,000, and no entry is decoded and encoded again on its way out.

Where a source stands (a journal cursor, a file's inode and offset) is stored in the same transaction as the
entries read up to it, so a restart neither sends a line twice nor skips one.

A write that fails (a full disk, an I/O error) loses only the entries of that write: they are counted as
dropped, one log line says so when it starts and one when writes work again, and the daemon carries on.
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexd.base.gojson import EncodedJSON
from plexd.base.sqlitefile import connect_private, immediate, open_or_start_empty

log = logging.getLogger(__name__)

STREAMS = ("metrics", "logs", "audit")
MAX_BATCH_BYTES = 1 << 20  # one POST carries at most this much (a control plane's body limit is usually larger)
PACK_ENTRIES = 100  # entries of one append stored in one row, at most
PACK_BYTES = 64 << 10

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, size INTEGER NOT NULL, body TEXT NOT NULL);
-- body: n entries' JSON texts joined by commas (a file of an older version has no n: one entry a row)
CREATE INDEX IF NOT EXISTS entries_by_stream ON entries (stream, seq);
CREATE TABLE IF NOT EXISTS streams (
    stream TEXT PRIMARY KEY, bytes INTEGER NOT NULL DEFAULT 0, count INTEGER NOT NULL DEFAULT 0,
    dropped INTEGER NOT NULL DEFAULT 0, dropped_bytes INTEGER NOT NULL DEFAULT 0,
    reported INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS positions (source TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class Batch:
    stream: str
    last_seq: int
    texts: list[str]  # the entries as stored (compact JSON, comma-joined per row): sent as is, never decoded
    count: int  # entries

    @property
    def entries(self) -> list[dict[str, Any]]:
        return json.loads(EncodedJSON.array(self.texts).text)


OnDrop = Callable[[str, int, int, str], None]  # stream, entries, bytes, why ("full" or the write error)


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: TelemetryQueue, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return call


class TelemetryQueue:
    def __init__(self, path: str | Path, caps: Mapping[str, int], *, on_drop: OnDrop | None = None,
                 pack: int = PACK_ENTRIES) -> None:
        """`pack`: entries to a row at most; no larger than the smallest batch a shipper asks for, since a batch
        holds whole rows."""
        self.path = Path(path)
        self.caps = dict(caps)
        self.pack = max(1, pack)
        self.on_drop = on_drop or (lambda *_: None)
        self._unwritable: dict[str, int] = {}  # stream → entries lost since writes started failing
        self._sent_upto: dict[str, int] = {}  # delivered even if the delete failed (a full disk): not sent twice
        # The collectors and shippers run the queue's work in worker threads (a batch of 1,000 entries is
        # milliseconds of JSON and SQLite the event loop should not wait for): one at a time.
        self._lock = threading.RLock()
        self._db = open_or_start_empty(self.path, self._connect, "telemetry queue",
                                       "telemetry collected before this start is lost")

    def _connect(self) -> sqlite3.Connection:
        # NORMAL: a process crash loses nothing committed; a power loss may lose the last moments
        db = connect_private(self.path, _SCHEMA, synchronous="NORMAL", probe_table="entries")
        if "n" not in {row[1] for row in db.execute("PRAGMA table_info(entries)")}:
            db.execute("ALTER TABLE entries ADD COLUMN n INTEGER NOT NULL DEFAULT 1")
        for stream in STREAMS:
            db.execute("INSERT OR IGNORE INTO streams(stream) VALUES(?)", (stream,))
        return db

    @_locked
    def close(self) -> None:
        self._db.close()

    # -- writing ------------------------------------------------------------------------------------------------

    @_locked
    def append(self, stream: str, entries: Iterable[Mapping[str, Any]], *,
               position: tuple[str, Any] | None = None) -> bool:
        """Queue `entries` (and, in the same transaction, move `position` = (source, value)); drop the oldest
        past the stream's cap. False when the write failed (the entries are counted as dropped)."""
        rows = [(stream, len(body), body, n) for body, n in _packed(map(encode, entries), self.pack)]
        count = sum(r[3] for r in rows)
        if not rows and position is None:
            return True
        try:
            with immediate(self._db):
                self._db.executemany("INSERT INTO entries(stream, size, body, n) VALUES(?,?,?,?)", rows)
                self._db.execute("UPDATE streams SET bytes = bytes + ?, count = count + ? WHERE stream=?",
                                 (sum(r[1] for r in rows), count, stream))
                if position is not None:
                    self._db.execute("INSERT OR REPLACE INTO positions(source, value) VALUES(?,?)",
                                     (position[0], json.dumps(position[1])))
                dropped = self._trim(stream)
        except sqlite3.Error as exc:
            self._write_failed(stream, count, exc)
            return False
        self._write_worked(stream)
        if dropped[0]:
            self.on_drop(stream, dropped[0], dropped[1], "full")
        return True

    def _trim(self, stream: str) -> tuple[int, int]:
        """Delete the oldest entries until the stream fits its cap; (entries, bytes) deleted."""
        total, _ = self._db.execute("SELECT bytes, count FROM streams WHERE stream=?", (stream,)).fetchone()
        excess = total - self.caps.get(stream, total)
        if excess <= 0:
            return 0, 0
        freed, count, last = 0, 0, None
        for seq, size, n in self._db.execute("SELECT seq, size, n FROM entries WHERE stream=? ORDER BY seq",
                                             (stream,)):
            freed, count, last = freed + size, count + n, seq
            if freed >= excess:
                break
        self._db.execute("DELETE FROM entries WHERE stream=? AND seq<=?", (stream, last))
        self._db.execute("UPDATE streams SET bytes = bytes - ?, count = count - ?, dropped = dropped + ?, "
                         "dropped_bytes = dropped_bytes + ? WHERE stream=?", (freed, count, count, freed, stream))
        return count, freed

    def _write_failed(self, stream: str, count: int, exc: sqlite3.Error) -> None:
        first = stream not in self._unwritable
        self._unwritable[stream] = self._unwritable.get(stream, 0) + count
        if first:
            log.error("telemetry queue %s cannot be written (%s): %s entries lost, and every %s entry until it "
                      "can be; the mesh is not affected", self.path, exc, count, stream)
        self.on_drop(stream, count, 0, f"unwritable: {exc}")

    def _write_worked(self, stream: str) -> None:
        lost = self._unwritable.pop(stream, None)
        if lost is None:
            return
        log.warning("telemetry queue %s writable again; %d %s entries were lost while it was not", self.path, lost,
                    stream)
        try:
            self._db.execute("UPDATE streams SET dropped = dropped + ? WHERE stream=?", (lost, stream))
        except sqlite3.Error:
            pass

    # -- reading ------------------------------------------------------------------------------------------------

    @_locked
    def batch(self, stream: str, limit: int, max_bytes: int = MAX_BATCH_BYTES) -> Batch | None:
        """The oldest entries of `stream`: at most `limit`, and at most `max_bytes`, unless the first stored row
        alone is more."""
        texts, size, count, last = [], 0, 0, 0
        for seq, length, body, n in self._db.execute(
                "SELECT seq, size, body, n FROM entries WHERE stream=? AND seq>? ORDER BY seq LIMIT ?",
                (stream, self._sent_upto.get(stream, 0), limit)):
            if texts and (size + length > max_bytes or count + n > limit):
                break
            texts.append(body)
            size, count, last = size + length, count + n, seq
        return Batch(stream, last, texts, count) if texts else None

    @_locked
    def delivered(self, batch: Batch) -> None:
        """The control plane took `batch`: forget it."""
        self._sent_upto[batch.stream] = max(batch.last_seq, self._sent_upto.get(batch.stream, 0))
        with_size = self._db.execute("SELECT coalesce(sum(size), 0), coalesce(sum(n), 0) FROM entries WHERE "
                                     "stream=? AND seq<=?", (batch.stream, batch.last_seq)).fetchone()
        try:
            with immediate(self._db):
                self._db.execute("DELETE FROM entries WHERE stream=? AND seq<=?", (batch.stream, batch.last_seq))
                self._db.execute("UPDATE streams SET bytes = bytes - ?, count = count - ? WHERE stream=?",
                                 (*with_size, batch.stream))
        except sqlite3.Error as exc:  # skipped by batch(); deleted with the next delivered batch
            log.debug("telemetry queue %s: cannot delete a delivered %s batch yet: %s", self.path, batch.stream,
                      exc)

    @_locked
    def unreported_drops(self) -> dict[str, int]:
        """Per stream, entries dropped (cap or unwritable) that the control plane has not been told of."""
        rows = self._db.execute("SELECT stream, dropped, reported FROM streams")
        out = {stream: dropped - reported + self._unwritable.get(stream, 0) for stream, dropped, reported in rows}
        return {stream: count for stream, count in out.items() if count > 0}

    @_locked
    def drops_reported(self, counts: dict[str, int]) -> None:
        try:
            self._db.executemany("UPDATE streams SET reported = reported + ? WHERE stream=?",
                                 [(count, stream) for stream, count in counts.items()])
        except sqlite3.Error as exc:  # told again next time: a repeated notice, never a silent loss
            log.debug("telemetry queue %s: cannot record a reported drop: %s", self.path, exc)

    @_locked
    def position(self, source: str) -> Any:
        row = self._db.execute("SELECT value FROM positions WHERE source=?", (source,)).fetchone()
        return json.loads(row[0]) if row else None

    @_locked
    def status(self, stream: str) -> dict[str, int]:
        nbytes, count, dropped, dropped_bytes = self._db.execute(
            "SELECT bytes, count, dropped, dropped_bytes FROM streams WHERE stream=?", (stream,)).fetchone()
        return {"pending": count, "bytes": nbytes, "dropped": dropped + self._unwritable.get(stream, 0),
                "dropped_bytes": dropped_bytes, "cap_bytes": self.caps.get(stream, 0)}


def _packed(texts: Iterable[str], pack: int) -> Iterator[tuple[str, int]]:
    """Entries' texts joined into rows of at most `pack` entries and PACK_BYTES (one larger entry alone)."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        if chunk and (len(chunk) >= pack or size + len(text) > PACK_BYTES):
            yield ",".join(chunk), len(chunk)
            chunk, size = [], 0
        chunk.append(text)
        size += len(text) + 1
    if chunk:
        yield ",".join(chunk), len(chunk)


def encode(entry: Mapping[str, Any]) -> str:
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))
