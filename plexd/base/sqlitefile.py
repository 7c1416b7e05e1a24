"""Opening plexd's SQLite files (the event ledger, the uplink outbox) so that a damaged one never stops the
daemon: a file SQLite cannot read is moved aside (``<name>.corrupt``, with its WAL and shared-memory files
removed) and an empty one started, with one log line saying what that costs. And taking over the file of an older
version once (`take_over`)."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from plexd.base.errors import PlexdError

log = logging.getLogger(__name__)

T = TypeVar("T")


def open_or_start_empty(path: Path, connect: Callable[[], sqlite3.Connection], what: str,
                        consequence: str) -> sqlite3.Connection:
    """`connect()` to `path` (created 0700 in its directory); if it is unreadable, move it aside, log `what`
    and `consequence`, and connect to a fresh file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        return connect()
    except sqlite3.OperationalError:
        raise  # locked by another process, a read-only or full disk: the file is fine, moving it would lose it
    except sqlite3.DatabaseError as exc:
        aside = move_aside(path, ".corrupt")
        log.warning("%s %s unreadable (%s); moved to %s, starting empty: %s", what, path, exc, aside, consequence)
        return connect()


def move_aside(path: Path, suffix: str) -> Path:
    """Rename a SQLite file to `path` + `suffix` and remove its WAL and shared-memory files; the new path."""
    aside = path.with_name(path.name + suffix)
    path.replace(aside)
    remove_sidecars(path)
    return aside


def remove_sidecars(path: Path) -> None:
    """The WAL and shared-memory files of a SQLite file that is gone or moved."""
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)


# Pages a connection keeps in memory (KiB): SQLite's default is 2 MiB per connection, which a queue that appends
# at its tail and reads at its head never needs (the OS page cache holds the file anyway); the daemon keeps a few.
CACHE_KIB = 256


def connect_private(path: Path, schema: str, *, synchronous: str, probe_table: str) -> sqlite3.Connection:
    """A 0600 SQLite file in WAL mode, autocommit, with `schema` applied. Reading `probe_table` makes a garbage
    file fail here (for `open_or_start_empty`) rather than at its first use."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        db.executescript(schema)
        db.execute(f"SELECT count(*) FROM {probe_table}").fetchone()
    except sqlite3.DatabaseError:
        db.close()  # the file goes aside next: no connection left holding it
        raise
    return db


@contextlib.contextmanager
def immediate(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: BEGIN IMMEDIATE, COMMIT when the block ends, ROLLBACK when it (or the commit) fails.
    The error goes on; a rollback SQLite already did itself (after SQLITE_FULL, say) is not attempted twice."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):  # the original error is the one worth reporting
                db.execute("ROLLBACK")
        raise


def take_over(legacy: Path, *, what: str, lost: str, taken: Callable[[str], bool],
              read: Callable[[sqlite3.Connection], T], write: Callable[[T, str], None]) -> None:
    """Move an older version's SQLite file into the current one, once: `read(old)` its rows, then `write(rows,
    flag)` them in one transaction that also records `flag` (this very file: inode, size, mtime), so a crash
    before the old file is removed does not take it over twice (`taken(flag)`). The old file is then removed. An
    unreadable one is moved aside (``.unreadable``; `lost` says what that costs); a write that fails leaves it
    for the next start."""
    try:
        flag = _identity(legacy)
    except OSError:
        return
    if not taken(flag):
        try:
            old = sqlite3.connect(legacy)
            try:
                rows = read(old)
            finally:
                old.close()
            flag = _identity(legacy)  # closing it may have folded its WAL in: the file as it now stays
        except (sqlite3.Error, ValueError, OSError) as exc:
            try:
                aside: Path | str = move_aside(legacy, ".unreadable")
            except OSError as error:
                aside = f"nowhere ({error.strerror})"
            log.warning("old %s %s not taken over (%s); moved to %s: %s", what, legacy, exc, aside, lost)
            return
        try:
            write(rows, flag)
        except (sqlite3.Error, PlexdError) as exc:  # this file cannot be written now: the old one stays
            log.error("old %s %s not taken over yet: %s", what, legacy, exc)
            return
    legacy.unlink(missing_ok=True)
    remove_sidecars(legacy)


def _identity(path: Path) -> str:
    stat = path.stat()
    return f"adopted {path.name} {stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}"
