"""Report sync (§1.12): report changes carried to `POST /report` until the control plane acknowledges them.

The changes are the `reports` lane of the uplink outbox (`plexd.controlplane.uplink`, data_dir/uplink.db): one
entry per key, not per change, and each key's current entry is read at send time (or the key is listed as deleted
when it no longer exists), so any number of writes to one key cost one entry upstream (coalesced). What was not
acknowledged is sent after a restart too (the Go agent keeps it in memory). A change waits `debounce` (5 s) for
others to join it, and a batch holds at most `MAX_BATCH_KEYS` keys. A failed send is retried by the outbox's one
policy (jittered backoff, the server's Retry-After) for as long as it takes; a 4xx other than 401/408/429 is the
control plane refusing the batch itself: retrying it cannot succeed, so it is dropped with a logged reason naming
the keys (the Go agent retries a 409 every 5 s forever).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from plexd.base.backoff import Backoff
from plexd.controlplane.uplink import Entry, UplinkOutbox
from plexd.nodeapi.cache import STATE_DIR
from plexd.nodeapi.keys import report_key_problem
from plexd.nodeapi.reports import ReportStore

log = logging.getLogger(__name__)

LANE = "reports"
LEGACY_QUEUE_FILE = "report-queue.json"  # where versions before the uplink outbox kept the queue
DEBOUNCE = 5.0
MAX_BATCH_KEYS = 100  # keys per POST: a backlog goes in several requests of bounded size

Send = Callable[[Sequence[dict[str, Any]], Sequence[str]], Awaitable[None]]


class ReportSync:
    def __init__(self, store: ReportStore, send: Send, uplink: UplinkOutbox, *, debounce: float = DEBOUNCE,
                 backoff: Backoff | None = None) -> None:
        self.store = store
        self.send = send
        self.uplink = uplink
        uplink.add_lane(LANE, self._send_batch, batch=MAX_BATCH_KEYS, debounce=debounce,
                        backoff=backoff or Backoff(base=1.0, cap=60.0, jitter=0.25))
        self.sent_batches = 0
        self.last_sent_at: float | None = None
        self._unqueued: set[str] = set()

    def load(self, data_dir: str | Path) -> int:
        """Take over the queue file an older version left (its keys join the lane); the lane's own entries are on
        disk already. Returns how many changes wait for the control plane."""
        legacy = Path(data_dir) / STATE_DIR / LEGACY_QUEUE_FILE
        try:
            doc = json.loads(legacy.read_bytes())
            keys = doc["pending"] if isinstance(doc, dict) else None
            if not isinstance(keys, list):
                raise ValueError("no 'pending' list")
        except FileNotFoundError:
            keys = []
        except (OSError, ValueError, KeyError) as exc:
            log.warning("report queue %s unreadable (%s); every report entry is queued again", legacy, exc)
            keys = [e["key"] for e in self.store.index()]
        for key in keys:
            if isinstance(key, str) and not report_key_problem(key):
                self.changed(key)
        legacy.unlink(missing_ok=True)
        if self.pending:
            log.info("%d report change(s) from the last run are queued for the control plane", self.pending)
        return self.pending

    def changed(self, key: str) -> None:
        """A report entry was written or deleted (ReportStore.subscribe): its key is queued, once. A key the outbox
        cannot take now (disk full, the daemon closing) is kept here and queued with the next change."""
        self._unqueued.add(key)
        try:
            for waiting in sorted(self._unqueued):
                self.uplink.put("report", {}, lane=LANE, key=waiting)  # the key says it all
                self._unqueued.discard(waiting)
        except sqlite3.Error as exc:
            log.error("report change of %r not queued for the control plane (%s); %d change(s) wait to be queued",
                      key, exc, len(self._unqueued))

    @property
    def pending(self) -> int:
        return self.uplink.size(LANE) + len(self._unqueued)

    async def _send_batch(self, batch: Sequence[Entry]) -> None:
        entries, deleted = [], []
        for key in (e.key for e in batch if e.key is not None):
            entry = self.store.get(key)
            if entry is None:
                deleted.append(key)
            else:
                entries.append(entry.to_wire())
        await self.send(entries, deleted)
        self.sent_batches += 1
        self.last_sent_at = time.time()
        log.debug("report sync: %d entries, %d deletions acknowledged", len(entries), len(deleted))

    def status(self) -> dict[str, Any]:
        lane = self.uplink.status(LANE)
        return {"pending": self.pending, "sent_batches": self.sent_batches,
                "dropped_batches": self.uplink.counter("refused_batches", LANE),
                "dropped": lane["refused"] + lane["dropped_full"],
                "last_sent_at": round(self.last_sent_at, 1) if self.last_sent_at else None,
                "last_error": lane["last_error"]}
