"""What the event path must keep across a crash, in one SQLite database in WAL mode (`data_dir/events.db`): the
stream's replay cursor, the nonces of accepted events, and the mirror of the desired model (for an offline start).

Why not files: rewriting and fsyncing a nonce file of up to 100,000 entries, and a mirror of every peer, on every
event made each event cost O(mesh). Here an event only notes its cursor and nonce in memory (O(1)); a commit
(`plexd.node.durable`, at most once a second) writes, in one transaction, the peers that changed since the last
commit, the rest of the model, and exactly the cursor and nonces noted up to the moment that model was taken.

So after a crash at any moment the cursor never points past an event whose effect is not on disk: both are in the
same transaction. The control plane replays the events after the cursor; their nonces were not committed either,
so they are accepted again (every event sets a value: applying one twice is harmless). An event at or before the
cursor has its nonce stored, so a replay of it is refused after the restart too.

The files of earlier versions (`nonces.json`, `last_event_id`, `state/desired.json`) are imported once and
removed. A database SQLite cannot read is moved aside (`events.db.corrupt`) with a warning and the daemon starts
with an empty one: replays are then bounded by the 5-minute window check alone until new nonces accumulate, and
the first state pull brings the model back.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plexd.base import gojson
from plexd.base.failpoint import failpoint
from plexd.base.sqlitefile import connect_private, immediate, open_or_start_empty
from plexd.config import datadir

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nonces (nonce TEXT PRIMARY KEY, issued_at REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS nonces_by_time ON nonces (issued_at);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS peers (id TEXT PRIMARY KEY, doc TEXT NOT NULL) WITHOUT ROWID;
"""


NONCE_TTL_SECONDS = 300.0  # signing.NONCE_TTL: a nonce older than the staleness window can never be needed


@dataclass(frozen=True)
class Batch:
    cursor: str | None
    nonces: list[tuple[str, float]]


@dataclass(frozen=True)
class MirrorChange:
    """The desired model's mirror, as the rows that change: `head` is the model without its peers (JSON)."""

    head: str
    upserts: list[tuple[str, str]]  # peer id, peer JSON
    deletes: list[str]
    full: bool = False  # every row replaced (the first write of a run)


class EventLedger:
    """Cursor, nonces and the desired-state mirror: loaded once at start; cursor and nonces noted per event in
    memory, everything committed in groups (`plexd.node.durable`)."""

    def __init__(self, path: Path | str, *, max_nonces: int = 100_000) -> None:
        self.path = Path(path)
        self.max_nonces = max_nonces
        self._sweep_notes_at = max_nonces
        self.on_pending: Callable[[], None] | None = None  # called when the first note after a commit arrives
        self._db_lock = threading.Lock()  # write() may run in a worker thread while `stored()` is asked
        self._cursor: str | None = None
        self._cursor_dirty = False
        self._new_nonces: dict[str, float] = {}
        self.commits = 0
        self._db = self._open()
        self._loaded_nonces = self._load()

    # -- opening ----------------------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        return open_or_start_empty(self.path, self._connect, "event bookkeeping",
                                   "replays are bounded by the 5-minute window until nonces accumulate")

    def _connect(self) -> sqlite3.Connection:
        fresh = not self.path.exists()
        # FULL: a commit is on disk when it returns (one fsync per group); a torn file fails here, not later
        db = connect_private(self.path, _SCHEMA, synchronous="FULL", probe_table="nonces")
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                side.chmod(0o600)
        if fresh:
            self._import_legacy(db)
        return db

    def _import_legacy(self, db: sqlite3.Connection) -> None:
        """Bring over the cursor and nonces of a plexd that kept them in files, then remove those files."""
        data_dir = self.path.parent
        cursor_file, nonce_file = data_dir / datadir.LAST_EVENT_ID, data_dir / datadir.NONCES
        rows: list[tuple[str, float]] = []
        cursor = ""
        try:
            cursor = cursor_file.read_text().strip()
        except (OSError, UnicodeDecodeError):
            pass
        try:
            raw = json.loads(nonce_file.read_text())
            if isinstance(raw, dict):
                rows = [(str(n), gojson.parse_time(t).timestamp()) for n, t in raw.items() if isinstance(t, str)]
        except (OSError, ValueError):
            pass
        mirror_file = data_dir / datadir.DESIRED_MIRROR
        mirror: MirrorChange | None = None
        try:
            doc = json.loads(mirror_file.read_text())
            peers = doc["state"].pop("peers", None) or []
            mirror = MirrorChange(json.dumps(doc, separators=(",", ":")),
                                  [(str(p["id"]), json.dumps(p, separators=(",", ":"))) for p in peers], [], True)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        if not cursor and not rows and mirror is None:
            return
        with immediate(db):
            db.executemany("INSERT OR IGNORE INTO nonces VALUES (?, ?)", rows)
            if cursor:
                db.execute("INSERT OR REPLACE INTO meta VALUES ('cursor', ?)", (cursor,))
            if mirror is not None:
                _write_mirror(db, mirror)
        for old in (cursor_file, nonce_file, mirror_file):
            old.unlink(missing_ok=True)
        log.info("event bookkeeping and the desired-state mirror moved into %s (%d nonces)", self.path, len(rows))

    def _load(self) -> list[tuple[str, float]]:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'cursor'").fetchone()
        self._cursor = row[0] if row else None
        return self._db.execute("SELECT nonce, issued_at FROM nonces ORDER BY issued_at").fetchall()

    # -- the event path: O(1) notes ---------------------------------------------------------------------------

    @property
    def cursor(self) -> str | None:
        return self._cursor

    def take_loaded_nonces(self) -> list[tuple[str, float]]:
        """The stored nonces, oldest first (once: the nonce store keeps them in memory from then on)."""
        out, self._loaded_nonces = self._loaded_nonces, []
        return out

    def note(self, event_id: str | None, nonce: str | None = None, issued_at: float = 0.0) -> None:
        """An event is done (its effect applied to the desired model): its cursor and nonce, to commit together."""
        first = not self.pending
        if nonce:
            self._new_nonces[nonce] = issued_at
            if len(self._new_nonces) > self._sweep_notes_at:  # commits failing for long (disk full)
                self._drop_expired_notes(issued_at)
                self._sweep_notes_at = len(self._new_nonces) + self.max_nonces  # amortised: not a scan per note
        if event_id:
            self._cursor, self._cursor_dirty = event_id, True
        if first and self.pending and self.on_pending is not None:
            self.on_pending()

    def _drop_expired_notes(self, newest: float) -> None:
        """Notes that can no longer matter: issued more than two windows before the newest accepted one (which was
        at most one window ahead of the clock), so expired. Unexpired notes are never dropped: the nonce store
        refuses events past its cap instead, which bounds them."""
        cutoff = newest - 2 * NONCE_TTL_SECONDS
        self._new_nonces = {n: t for n, t in self._new_nonces.items() if t >= cutoff}

    @property
    def pending(self) -> bool:
        return self._cursor_dirty or bool(self._new_nonces)

    # -- group commit -----------------------------------------------------------------------------------------

    def take(self) -> Batch | None:
        """What was noted since the last take, to `write` (call it on the loop, at the moment the effects of
        those events are captured for the mirror)."""
        if not self.pending:
            return None
        batch = Batch(self._cursor if self._cursor_dirty else None, list(self._new_nonces.items()))
        self._cursor_dirty, self._new_nonces = False, {}
        self._sweep_notes_at = self.max_nonces
        return batch

    def write(self, batch: Batch | None, now: float, mirror: MirrorChange | None = None) -> bool:
        """Commit a batch and the mirror's changed rows in one transaction (blocking: may run in a worker thread).
        Nonces issued before `now - NONCE_TTL` leave the table; no other. False (logged) if it failed."""
        if batch is None and mirror is None:
            return True
        batch = batch or Batch(None, [])
        try:
            with self._db_lock, immediate(self._db):
                if mirror is not None:
                    _write_mirror(self._db, mirror)
                self._db.executemany("INSERT OR IGNORE INTO nonces VALUES (?, ?)", batch.nonces)
                if batch.cursor is not None:
                    self._db.execute("INSERT OR REPLACE INTO meta VALUES ('cursor', ?)", (batch.cursor,))
                # expired nonces only: an unexpired one is never dropped (the nonce store caps their number by
                # refusing events instead), so a committed event cannot be replayed after a restart
                self._db.execute("DELETE FROM nonces WHERE issued_at < ?", (now - NONCE_TTL_SECONDS,))
                failpoint("mirror.commit")  # every statement run, the COMMIT not yet
            self.commits += 1
            return True
        except sqlite3.Error as exc:
            log.warning("cannot commit event bookkeeping to %s: %s", self.path, exc)
            return False

    def give_back(self, batch: Batch) -> None:
        """A batch that could not be written: noted again, under any newer notes (nothing acknowledged is lost)."""
        for nonce, issued in batch.nonces:
            self._new_nonces.setdefault(nonce, issued)
        if batch.cursor is not None and not self._cursor_dirty:
            self._cursor_dirty = True

    def commit(self, now: float) -> None:
        """Take and write now (start-up, shutdown, tests)."""
        batch = self.take()
        if batch is not None and not self.write(batch, now):
            self.give_back(batch)

    def mirror(self) -> dict | None:
        """The mirrored desired model as `DesiredState.to_json()` wrote it, or None when there is none."""
        with self._db_lock:
            return _read_mirror(self._db)

    def stored(self) -> tuple[str | None, set[str]]:
        """What is on disk now (for tests): the committed cursor and nonces."""
        with self._db_lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'cursor'").fetchone()
            return (row[0] if row else None), {r[0] for r in self._db.execute("SELECT nonce FROM nonces")}

    def close(self, now: float) -> None:
        self.commit(now)
        with self._db_lock:
            self._db.close()


def _write_mirror(db: sqlite3.Connection, change: MirrorChange) -> None:
    if change.full:
        db.execute("DELETE FROM peers")
    db.executemany("INSERT OR REPLACE INTO peers VALUES (?, ?)", change.upserts)
    db.executemany("DELETE FROM peers WHERE id = ?", [(pid,) for pid in change.deletes])
    db.execute("INSERT OR REPLACE INTO meta VALUES ('desired', ?)", (change.head,))


def _read_mirror(db: sqlite3.Connection) -> dict | None:
    row = db.execute("SELECT value FROM meta WHERE key = 'desired'").fetchone()
    if row is None:
        return None
    doc = json.loads(row[0])
    doc.setdefault("state", {})["peers"] = [json.loads(r[0]) for r in db.execute("SELECT doc FROM peers")]
    return doc


def read_mirror(data_dir: Path | str) -> dict | None:
    """The mirror, read-only, for commands that run beside (or without) the daemon (`plexd peers`,
    `reconcile --once`); None when there is none or it cannot be read (logged)."""
    path = Path(data_dir) / datadir.EVENT_LEDGER
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return _read_mirror(db)
        finally:
            db.close()
    except (sqlite3.Error, ValueError) as exc:
        log.warning("cannot read the desired-state mirror in %s: %s", path, exc)
        return None
