"""The telemetry streams (metrics, logs, audit) as lanes of the one uplink outbox (``data_dir/uplink.db``):
``telemetry_metrics``, ``telemetry_logs``, ``telemetry_audit``, each with the byte cap of its
``telemetry.<stream>.queue_max_bytes``, delivered by the outbox's service with the one retry policy.

Why on disk and bounded in bytes: the Go agent keeps at most twice a batch in memory, so an outage of a few
minutes loses data and a restart loses all of it. Here an outage of hours and any number of restarts lose
nothing until a stream's byte cap is reached; then the *oldest* entries go first, and every such loss is counted
(persisted in the outbox's counters) and handed to `on_drop` (a log line, a metric, a log entry for the control
plane).

The entries of one append are stored together, up to `pack` (and `PACK_BYTES`) to a row, as one JSON array of
their texts, and a batch is sent as the rows' insides inside one array: at 1,000 peers a collection is 10 rows
instead of 1,000, and no entry is decoded and encoded again on its way out. (A row is valid JSON on its own: a
version of plexd that knows no telemetry lane, after a rollback, reads it as an entry it has no sender for.)

Collectors append from worker threads, through a writer of their own on the outbox's file (synchronous=NORMAL: a
process crash loses nothing committed; a power loss may lose the last seconds, as it would lose their
collection). Where a source stands (a journal cursor, a file's inode and offset) is stored in the same transaction
as the entries read up to it, so a restart neither sends a line twice nor skips one.

A write that fails (a full disk, an I/O error) loses only the entries of that write: they are counted as
dropped, one log line says so when it starts and one when writes work again, and the daemon carries on.

Versions before the one outbox kept all this in ``telemetry.db`` (in data_dir or ``telemetry.queue_dir``): such a
file is taken over once, entries, counts and positions, and removed (`adopt`, once the lanes and their caps are
known).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from plexd.base.backoff import Backoff
from plexd.base.sqlitefile import take_over
from plexd.controlplane.uplink import BatchSend, UplinkOutbox

log = logging.getLogger(__name__)

STREAMS = ("metrics", "logs", "audit")
MAX_BATCH_BYTES = 1 << 20  # one POST carries at most this much (a control plane's body limit is usually larger)
PACK_ENTRIES = 100  # entries of one append stored in one row, at most
PACK_BYTES = 64 << 10

_SCHEMA = """
CREATE TABLE IF NOT EXISTS telemetry_positions (source TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS telemetry_flags (name TEXT PRIMARY KEY) WITHOUT ROWID;
"""

OnDrop = Callable[[str, int, int, str], None]  # stream, entries, bytes, why ("full" or the write error)


def lane(stream: str) -> str:
    """The stream's lane in the uplink outbox (also its `queue` label in the metrics)."""
    return f"telemetry_{stream}"


class TelemetryQueue:
    def __init__(self, outbox: UplinkOutbox, caps: Mapping[str, int], *, on_drop: OnDrop | None = None,
                 pack: int = PACK_ENTRIES) -> None:
        """`pack`: entries to a row at most; no larger than the smallest batch a lane sends, since a batch holds
        whole rows."""
        self.outbox = outbox
        self.caps = dict(caps)
        self.pack = max(1, pack)
        self.on_drop = on_drop or (lambda *_: None)
        self._unwritable: dict[str, int] = {}  # stream → entries lost since writes started failing
        self._writer = outbox.writer(durable=False)
        self._writer.db.executescript(_SCHEMA)

    def add_lane(self, stream: str, send: BatchSend, *, batch_size: int, interval: float,
                 has_news: Callable[[], bool] | None = None) -> None:
        """Deliver `stream` with `send`: at most `batch_size` entries (and MAX_BATCH_BYTES) a batch, gathered for
        `interval` after the first, retried with a backoff capped at `interval`. `has_news`: see
        `UplinkOutbox.add_lane`."""
        self.outbox.add_lane(lane(stream), send, batch=batch_size, batch_entries=batch_size,
                             batch_bytes=MAX_BATCH_BYTES, debounce=interval,
                             backoff=Backoff(base=min(1.0, interval), cap=interval),
                             max_bytes=self.caps[stream], max_entries=1 << 62,
                             on_drop=lambda entries, nbytes: self.on_drop(stream, entries, nbytes, "full"),
                             has_news=has_news)

    def adopt(self, paths: Iterable[Path]) -> None:
        """Take over the telemetry.db an older version left at any of `paths` (after `add_lane`: the caps)."""
        for path in paths:
            self._adopt(path)

    def close(self) -> None:
        self._writer.close()

    # -- writing ------------------------------------------------------------------------------------------------

    def append(self, stream: str, entries: Iterable[Mapping[str, Any]], *,
               position: tuple[str, Any] | None = None) -> bool:
        """Queue `entries` (and, in the same transaction, move `position` = (source, value)); the oldest go past
        the stream's cap. Any thread. False when the write failed (the entries are counted as dropped)."""
        return self.append_texts(stream, map(encode, entries), position=position)

    def append_texts(self, stream: str, texts: Iterable[str], *, position: tuple[str, Any] | None = None) -> bool:
        """`append` for entries already encoded (each a JSON object's text, as `encode` writes it)."""
        rows = list(_packed(texts, self.pack))
        count = sum(n for _, n in rows)
        if not rows and position is None:
            return True
        lost = 0
        try:
            with self._writer.transaction() as db:
                self._writer.put_texts(lane(stream), stream, rows)
                if position is not None:
                    db.execute("INSERT OR REPLACE INTO telemetry_positions(source, value) VALUES(?,?)",
                               (position[0], json.dumps(position[1])))
                # Writes work again: what was lost meanwhile is counted for good, and no longer in memory (taken
                # under the writer's lock, so no reader counts it twice).
                lost = self._unwritable.pop(stream, 0)
                if lost:
                    self._writer.count("dropped_unwritable", lane(stream), lost)
        except sqlite3.Error as exc:
            if lost:
                self._unwritable[stream] = self._unwritable.get(stream, 0) + lost
            self._write_failed(stream, count, exc)
            return False
        if lost:
            log.warning("telemetry queue %s writable again; %d %s entries were lost while it was not",
                        self.outbox.path, lost, stream)
        return True

    def _write_failed(self, stream: str, count: int, exc: sqlite3.Error) -> None:
        first = stream not in self._unwritable
        self._unwritable[stream] = self._unwritable.get(stream, 0) + count
        if first:
            log.error("telemetry queue %s cannot be written (%s): %s entries lost, and every %s entry until it "
                      "can be; the mesh is not affected", self.outbox.path, exc, count, stream)
        self.on_drop(stream, count, 0, f"unwritable: {exc}")

    # -- reading ------------------------------------------------------------------------------------------------

    def position(self, source: str) -> Any:
        with self._writer.transaction() as db:
            row = db.execute("SELECT value FROM telemetry_positions WHERE source=?", (source,)).fetchone()
        return json.loads(row[0]) if row else None  # our own 0600 file

    def dropped(self, stream: str) -> int:
        return (self.outbox.counter("dropped_full", lane(stream)) + self.outbox.counter("dropped_unwritable",
                lane(stream)) + self._unwritable.get(stream, 0))

    def unreported_drops(self) -> dict[str, int]:
        """Per stream, entries dropped (cap or unwritable) that the control plane has not been told of."""
        out = {s: self.dropped(s) - self.outbox.counter("drops_reported", lane(s)) for s in STREAMS}
        return {stream: count for stream, count in out.items() if count > 0}

    def drops_reported(self, counts: dict[str, int]) -> None:
        try:
            for stream, count in counts.items():
                self.outbox.count("drops_reported", lane(stream), count)
        except sqlite3.Error as exc:  # told again next time: a repeated notice, never a silent loss
            log.debug("telemetry queue %s: cannot record a reported drop: %s", self.outbox.path, exc)

    def status(self, stream: str) -> dict[str, Any]:
        st = self.outbox.status(lane(stream))
        return {"pending": st["pending"], "bytes": st["bytes"], "dropped": self.dropped(stream),
                "dropped_bytes": st["dropped_bytes"], "cap_bytes": self.caps.get(stream, 0), "sent": st["sent"],
                "refused": st["refused"], "last_error": st["last_error"]}

    # -- an older version's file --------------------------------------------------------------------------------

    def _adopt(self, legacy: Path) -> None:
        def taken(flag: str) -> bool:
            with self._writer.transaction() as db:
                return db.execute("SELECT 1 FROM telemetry_flags WHERE name = ?", (flag,)).fetchone() is not None

        def write(rows: tuple[list[Any], list[Any], list[Any]], flag: str) -> None:
            entries, streams, positions = rows
            with self._writer.transaction() as db:
                for stream in STREAMS:  # one put per stream: the caps are checked once
                    self._writer.put_texts(lane(stream), stream,
                                           [(f"[{body}]", n) for s, body, n in entries if s == stream])
                for stream, dropped, dropped_bytes, reported in streams:
                    if stream in STREAMS:
                        self._writer.count("dropped_full", lane(stream), dropped)
                        self._writer.count("dropped_bytes", lane(stream), dropped_bytes)
                        self._writer.count("drops_reported", lane(stream), reported)
                db.executemany("INSERT OR REPLACE INTO telemetry_positions(source, value) VALUES(?,?)", positions)
                db.execute("INSERT INTO telemetry_flags VALUES (?)", (flag,))
            self._writer.db.execute("PRAGMA wal_checkpoint(FULL)")  # on disk before the old file goes
            log.info("telemetry queue taken over from %s: %d undelivered entries, %d source positions", legacy,
                     sum(n for _, _, n in entries), len(positions))

        take_over(legacy, what="telemetry queue", lost="telemetry collected before this start is lost",
                  taken=taken, read=_read_legacy, write=write)


def _read_legacy(old: sqlite3.Connection) -> tuple[list[Any], list[Any], list[Any]]:
    """(entries as (stream, body, n), streams' (stream, dropped, dropped_bytes, reported), positions) of an
    older telemetry.db (the first version had no `n`: one entry a row)."""
    tables = {name for (name,) in old.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    packed = "n" in {row[1] for row in old.execute("PRAGMA table_info(entries)")}
    entries = old.execute(f"SELECT stream, body, {'n' if packed else '1'} FROM entries ORDER BY seq").fetchall()
    streams = (old.execute("SELECT stream, dropped, dropped_bytes, reported FROM streams").fetchall()
               if "streams" in tables else [])
    positions = old.execute("SELECT source, value FROM positions").fetchall() if "positions" in tables else []
    return entries, streams, positions


def _packed(texts: Iterable[str], pack: int) -> Iterator[tuple[str, int]]:
    """Entries' texts in JSON arrays of at most `pack` entries and PACK_BYTES (one larger entry alone)."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        if chunk and (len(chunk) >= pack or size + len(text) > PACK_BYTES):
            yield f"[{','.join(chunk)}]", len(chunk)
            chunk, size = [], 0
        chunk.append(text)
        size += len(text) + 1
    if chunk:
        yield f"[{','.join(chunk)}]", len(chunk)


def encode(entry: Mapping[str, Any]) -> str:
    text = json.dumps(entry, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate from outside input (a journal field): escaped, as JSON allows
        return json.dumps(entry, separators=(",", ":"))
    return text
