"""What actions must keep across a crash: the journal of executions, in the uplink outbox's SQLite file
(``data_dir/uplink.db``, 0600, WAL, ``synchronous=FULL``), whose ``actions`` lane carries the messages for the
control plane.

Exactly-once: an execution is written to the journal, together with its ``accepted`` ack in the outbox, in one
committed transaction *before* the hook starts. So a replayed ``action_request`` (a new event with the same
``execution_id``, live or after a restart) finds it and is refused ``duplicate_execution_id``; and an execution
still marked running when the daemon starts was cut short by a crash: it is finished as ``error`` with that
reason and never run again (`interrupted`). Finishing writes the result into the outbox in the same
transaction, so a result is never lost between the two.

The lane is delivered oldest first (`plexd.actions.outbox`); an ack therefore always precedes its result.
Journal rows are kept `RETENTION` after they finish (replays come within minutes: the event window is ±5 min);
the outbox's caps bound the messages (the oldest dropped and counted).

Why SQLite and not files: the journal entry and its ack, or the finish and its result, must commit together,
and the outbox is a queue read in order; one transaction each is what a database gives. Versions before the
uplink outbox kept both in ``data_dir/actions.db``; `ActionJournal` takes such a file over once (`adopt`).
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
from plexd.base.sqlitefile import immediate, take_over
from plexd.controlplane.uplink import Entry, NoSender, UplinkOutbox

log = logging.getLogger(__name__)

RETENTION = 30 * 86400.0
LANE = "actions"  # the uplink outbox's lane of acks, results and integrity violations

_SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    execution_id TEXT PRIMARY KEY, action TEXT NOT NULL, origin TEXT NOT NULL, state TEXT NOT NULL,
    accepted_at REAL NOT NULL, finished_at REAL, status TEXT NOT NULL DEFAULT '', request TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS executions_by_state ON executions (state, finished_at);
CREATE TABLE IF NOT EXISTS announced (name TEXT PRIMARY KEY, checksum TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS journal_flags (name TEXT PRIMARY KEY) WITHOUT ROWID;
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

    @classmethod
    def of(cls, entry: Entry) -> Message:
        return cls(entry.seq, entry.kind, entry.body["execution_id"], entry.body["body"])


class ActionJournal:
    def __init__(self, store: UplinkOutbox | str | Path, *, adopt: Path | None = None) -> None:
        """`store`: the daemon's uplink outbox, or a path for a journal with an outbox of its own (tests, tools).
        `adopt`: an ``actions.db`` of an older version, taken over and removed."""
        self._owns_store = not isinstance(store, UplinkOutbox)
        self.uplink = store if isinstance(store, UplinkOutbox) else UplinkOutbox(store, _no_default_lane)
        self._db = self.uplink.db
        try:
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as err:
            raise JournalError(f"action journal: cannot write: {err}") from None
        if adopt is not None and adopt.exists():
            self._adopt(adopt)

    def close(self) -> None:
        """The daemon's journal lives in the uplink outbox's file, which whoever made the outbox closes."""
        if self._owns_store:
            self.uplink.close()

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
                self._queue("ack", execution_id, ack)

    def finish(self, execution_id: str, status: str, result: dict[str, Any]) -> None:
        now = time.time()
        with self._transaction():
            self._db.execute("UPDATE executions SET state=?, finished_at=?, status=? WHERE execution_id=?",
                             (FINISHED, now, status, execution_id))
            self._queue("result", execution_id, result)

    def settle(self, execution_id: str, action: str, origin: str, request: dict[str, Any], status: str, kind: str,
               body: dict[str, Any]) -> bool:
        """Journal an execution answered without being run here (refused, or lost before this node ran it) as
        finished, with its one message (`kind`: ack or result), in one transaction; so a control plane that lists it
        again gets no second answer. False, and nothing queued, when it is journaled already."""
        now = time.time()
        with self._transaction():
            cur = self._db.execute("INSERT OR IGNORE INTO executions(execution_id, action, origin, state, accepted_at, "
                                   "finished_at, status, request) VALUES(?,?,?,?,?,?,?,?)",
                                   (execution_id, action, origin, FINISHED, now, now, status,
                                    json.dumps(request, separators=(",", ":"))))
            if cur.rowcount != 1:
                return False
            self._queue(kind, execution_id, body)
        return True

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
            self._queue(kind, execution_id, body)

    def _queue(self, kind: str, execution_id: str, body: dict[str, Any]) -> None:
        self.uplink.put(kind, {"execution_id": execution_id, "body": body}, lane=LANE)

    def messages(self) -> list[Message]:
        """The messages not delivered yet, oldest first."""
        return [Message.of(e) for e in self.uplink.pending(LANE)]

    def outbox_size(self) -> int:
        return self.uplink.size(LANE)

    # -- announced hook checksums ---------------------------------------------------------------------------------

    def announced(self) -> dict[str, str] | None:
        """The hooks and checksums the control plane was last told about (None: never told)."""
        if self._db.execute("SELECT 1 FROM journal_flags WHERE name = 'announced'").fetchone() is None:
            return None
        return dict(self._db.execute("SELECT name, checksum FROM announced").fetchall())

    def set_announced(self, hooks: dict[str, str]) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM announced")
            self._db.executemany("INSERT INTO announced(name, checksum) VALUES(?,?)", sorted(hooks.items()))
            self._db.execute("INSERT OR IGNORE INTO journal_flags VALUES ('announced')")

    # ---------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        try:
            with immediate(self._db):
                yield
        except sqlite3.Error as err:
            raise JournalError(f"action journal: cannot write: {err}") from None

    def _adopt(self, legacy: Path) -> None:
        """Executions, announced checksums and undelivered messages of an older version's actions.db, moved into
        this file once (`plexd.base.sqlitefile.take_over`)."""
        def taken(flag: str) -> bool:
            return self._db.execute("SELECT 1 FROM journal_flags WHERE name = ?", (flag,)).fetchone() is not None

        def write(rows: tuple[list[Any], list[Any] | None, list[tuple[str, str, Any]]], flag: str) -> None:
            executions, announced, messages = rows
            with self._transaction():
                self._db.executemany("INSERT OR IGNORE INTO executions VALUES (?,?,?,?,?,?,?,?)", executions)
                if announced is not None:
                    self._db.executemany("INSERT OR REPLACE INTO announced VALUES (?, ?)", announced)
                    self._db.execute("INSERT OR IGNORE INTO journal_flags VALUES ('announced')")
                for kind, execution_id, body in messages:
                    self._queue(kind, execution_id, body)
                self._db.execute("INSERT INTO journal_flags VALUES (?)", (flag,))
            log.info("action journal taken over from %s: %d executions, %d undelivered messages", legacy,
                     len(executions), len(messages))

        take_over(legacy, what="action journal", lost="executions from before cannot be recognised as replays",
                  taken=taken, read=_read_legacy, write=write)


def _read_legacy(old: sqlite3.Connection) -> tuple[list[Any], list[Any] | None, list[tuple[str, str, Any]]]:
    """(executions, announced checksums or None when never announced, messages) of an older actions.db."""
    executions = old.execute("SELECT * FROM executions").fetchall()
    announced = old.execute("SELECT name, checksum FROM announced").fetchall()
    ever = old.execute("PRAGMA user_version").fetchone()[0]
    messages = [(kind, eid, json.loads(body)) for kind, eid, body in
                old.execute("SELECT kind, execution_id, body FROM outbox ORDER BY seq")]
    return executions, announced if ever else None, messages


async def _no_default_lane(kind: str, body: dict[str, Any]) -> None:
    raise NoSender(kind)  # a journal on its own path: the actions lane is added by `Outbox`


class JournalError(PlexdError):
    """The journal cannot be written (disk full, I/O error): nothing that depends on it may proceed."""


def _execution(row: tuple[Any, ...]) -> Execution:
    eid, action, origin, state, accepted_at, finished_at, status, request = row
    return Execution(eid, action, origin, state, accepted_at, finished_at, status,
                     json.loads(request) if request else {})
