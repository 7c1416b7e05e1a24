"""What actions must keep across a crash, in one SQLite database (``data_dir/actions.db``, 0600, WAL,
``synchronous=FULL``): the journal of executions and the outbox of messages for the control plane.

Exactly-once: an execution is written to the journal, together with its ``accepted`` ack in the outbox, in one
committed transaction *before* the hook starts. So a replayed ``action_request`` (a new event with the same
``execution_id``, live or after a restart) finds it and is refused ``duplicate_execution_id``; and an execution
still marked running when the daemon starts was cut short by a crash: it is finished as ``error`` with that
reason and never run again (`interrupted`). Finishing writes the result into the outbox in the same
transaction, so a result is never lost between the two.

The outbox is delivered oldest first (`plexd.actions.outbox`); an ack therefore always precedes its result.
Journal rows are kept `RETENTION` after they finish (replays come within minutes: the event window is ±5 min),
and the outbox holds at most `MAX_OUTBOX` messages; beyond that the oldest are dropped with a warning.

Why SQLite and not files: the journal entry and its ack, or the finish and its result, must commit together,
and the outbox is a queue read in order; one transaction each is what a database gives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexd.base.errors import PlexdError
from plexd.base.sqlitefile import connect_private, immediate, open_or_start_empty

log = logging.getLogger(__name__)

RETENTION = 30 * 86400.0
MAX_OUTBOX = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    execution_id TEXT PRIMARY KEY, action TEXT NOT NULL, origin TEXT NOT NULL, state TEXT NOT NULL,
    accepted_at REAL NOT NULL, finished_at REAL, status TEXT NOT NULL DEFAULT '', request TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS executions_by_state ON executions (state, finished_at);
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, execution_id TEXT NOT NULL, body TEXT NOT NULL,
    queued_at REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS announced (name TEXT PRIMARY KEY, checksum TEXT NOT NULL) WITHOUT ROWID;
"""

RUNNING, FINISHED = "running", "finished"


@dataclass(frozen=True)
class Execution:
    execution_id: str
    action: str
    origin: str  # control_plane | local
    state: str
    accepted_at: float
    finished_at: float | None
    status: str
    request: dict[str, Any]


@dataclass(frozen=True)
class Message:
    seq: int
    kind: str  # ack | result | violation
    execution_id: str
    body: dict[str, Any]
    queued_at: float
    attempts: int


class ActionJournal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.dropped = 0  # outbox messages dropped because the outbox was full
        self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        return open_or_start_empty(self.path, self._connect, "action journal",
                                   "executions from before cannot be recognised as replays")

    def _connect(self) -> sqlite3.Connection:
        # FULL: an accepted execution is on disk before the hook runs
        return connect_private(self.path, _SCHEMA, synchronous="FULL", probe_table="executions")

    def close(self) -> None:
        self._db.close()

    # -- journal ------------------------------------------------------------------------------------------------

    def known(self, execution_id: str) -> Execution | None:
        row = self._db.execute("SELECT * FROM executions WHERE execution_id=?", (execution_id,)).fetchone()
        return _execution(row) if row else None

    def accept(self, execution_id: str, action: str, origin: str, request: dict[str, Any],
               ack: dict[str, Any] | None) -> None:
        """Journal the execution as running (and queue its ack) in one transaction, before it runs."""
        now = time.time()
        with self._transaction():
            self._db.execute("INSERT INTO executions(execution_id, action, origin, state, accepted_at, request) "
                             "VALUES(?,?,?,?,?,?)", (execution_id, action, origin, RUNNING, now,
                                                     json.dumps(request, separators=(",", ":"))))
            if ack is not None:
                self._queue("ack", execution_id, ack, now)

    def finish(self, execution_id: str, status: str, result: dict[str, Any]) -> None:
        now = time.time()
        with self._transaction():
            self._db.execute("UPDATE executions SET state=?, finished_at=?, status=? WHERE execution_id=?",
                             (FINISHED, now, status, execution_id))
            self._queue("result", execution_id, result, now)

    def interrupted(self) -> list[Execution]:
        """Executions a crash cut short (running in the journal while no daemon runs them)."""
        rows = self._db.execute("SELECT * FROM executions WHERE state=? ORDER BY accepted_at", (RUNNING,))
        return [_execution(r) for r in rows]

    def prune(self, now: float | None = None) -> int:
        cutoff = (now if now is not None else time.time()) - RETENTION
        with self._transaction():
            cur = self._db.execute("DELETE FROM executions WHERE state=? AND finished_at < ?", (FINISHED, cutoff))
        return cur.rowcount

    # -- outbox -------------------------------------------------------------------------------------------------

    def queue(self, kind: str, execution_id: str, body: dict[str, Any]) -> None:
        with self._transaction():
            self._queue(kind, execution_id, body, time.time())

    def _queue(self, kind: str, execution_id: str, body: dict[str, Any], now: float) -> None:
        self._db.execute("INSERT INTO outbox(kind, execution_id, body, queued_at) VALUES(?,?,?,?)",
                         (kind, execution_id, json.dumps(body, separators=(",", ":"), ensure_ascii=False), now))
        (count,) = self._db.execute("SELECT count(*) FROM outbox").fetchone()
        if count > MAX_OUTBOX:
            excess = count - MAX_OUTBOX
            self._db.execute("DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox ORDER BY seq LIMIT ?)",
                             (excess,))
            self.dropped += excess
            log.warning("action outbox full (%d messages): dropped the %d oldest undelivered", MAX_OUTBOX, excess)

    def next_message(self) -> Message | None:
        row = self._db.execute("SELECT seq, kind, execution_id, body, queued_at, attempts FROM outbox "
                               "ORDER BY seq LIMIT 1").fetchone()
        if row is None:
            return None
        return Message(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5])

    def delivered(self, seq: int) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM outbox WHERE seq=?", (seq,))

    def attempted(self, seq: int) -> None:
        with self._transaction():
            self._db.execute("UPDATE outbox SET attempts=attempts+1 WHERE seq=?", (seq,))

    def outbox_size(self) -> int:
        return self._db.execute("SELECT count(*) FROM outbox").fetchone()[0]

    # -- announced hook checksums ---------------------------------------------------------------------------------

    def announced(self) -> dict[str, str] | None:
        """The hooks and checksums the control plane was last told about (None: never told)."""
        if not self._db.execute("PRAGMA user_version").fetchone()[0]:
            return None
        return dict(self._db.execute("SELECT name, checksum FROM announced").fetchall())

    def set_announced(self, hooks: dict[str, str]) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM announced")
            self._db.executemany("INSERT INTO announced(name, checksum) VALUES(?,?)", sorted(hooks.items()))
            self._db.execute("PRAGMA user_version=1")

    # ---------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        try:
            with immediate(self._db):
                yield
        except sqlite3.Error as err:
            raise JournalError(f"action journal: cannot write: {err}") from None


class JournalError(PlexdError):
    """The journal cannot be written (disk full, I/O error): nothing that depends on it may proceed."""


def _execution(row: tuple[Any, ...]) -> Execution:
    eid, action, origin, state, accepted_at, finished_at, status, request = row
    return Execution(eid, action, origin, state, accepted_at, finished_at, status,
                     json.loads(request) if request else {})
