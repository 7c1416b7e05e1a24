"""Opening plexd's SQLite files (the event ledger, the action journal) so that a damaged one never stops the
daemon: a file SQLite cannot read is moved aside (``<name>.corrupt``, with its WAL and shared-memory files
removed) and an empty one started, with one log line saying what that costs."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def open_or_start_empty(path: Path, connect: Callable[[], sqlite3.Connection], what: str,
                        consequence: str) -> sqlite3.Connection:
    """`connect()` to `path` (created 0700 in its directory); if it is unreadable, move it aside, log `what`
    and `consequence`, and connect to a fresh file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        return connect()
    except sqlite3.DatabaseError as exc:
        aside = path.with_name(path.name + ".corrupt")
        path.replace(aside)
        for suffix in ("-wal", "-shm"):
            path.with_name(path.name + suffix).unlink(missing_ok=True)
        log.warning("%s %s unreadable (%s); moved to %s, starting empty: %s", what, path, exc, aside, consequence)
        return connect()
