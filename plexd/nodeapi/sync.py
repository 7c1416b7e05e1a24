"""Report sync (§1.12): report changes carried to `POST /report` until the control plane acknowledges them.

The queue is a set of keys, not of changes: at send time each key's current entry is sent, or the key is listed
as deleted when it no longer exists, so any number of writes to one key cost one entry upstream (coalesced). The
queue is written to data_dir/state/report-queue.json on every change, so what was not acknowledged is sent after
a restart too (the Go agent keeps it in memory). A change waits `debounce` (5 s) for others to join it; a failed
send is retried by the one retry policy (`plexd.controlplane.retry`: jittered backoff, the server's Retry-After)
for as long as it takes. A 4xx other than 401/408/429 is the control plane refusing the batch itself: retrying it
cannot succeed, so it is dropped with a logged reason (the Go agent retries a 409 every 5 s forever).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from plexd.base.atomicfile import write_atomic
from plexd.base.backoff import Backoff
from plexd.base.errors import PlexdError
from plexd.controlplane.errors import ControlPlaneError
from plexd.controlplane.retry import retry_verdict
from plexd.nodeapi.cache import DIR_MODE, FILE_MODE, STATE_DIR
from plexd.nodeapi.keys import report_key_problem
from plexd.nodeapi.reports import ReportStore

log = logging.getLogger(__name__)

QUEUE_FILE = "report-queue.json"
DEBOUNCE = 5.0
MAX_BATCH_KEYS = 100  # keys per POST: a backlog goes in several requests of bounded size

Send = Callable[[Sequence[dict[str, Any]], Sequence[str]], Awaitable[None]]


class ReportSync:
    def __init__(self, store: ReportStore, send: Send, data_dir: str | Path, *, debounce: float = DEBOUNCE,
                 backoff: Backoff | None = None, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.store = store
        self.send = send
        self.path = Path(data_dir) / STATE_DIR / QUEUE_FILE
        self.debounce = debounce
        self.backoff = backoff or Backoff(base=1.0, cap=60.0, jitter=0.25)
        self._sleep = sleep
        self._pending: dict[str, int] = {}  # key -> change number (a key changed again while sending stays queued)
        self._changes = 0
        self._wake = asyncio.Event()
        self.sent_batches = 0
        self.dropped_batches = 0
        self.last_error = ""
        self.last_sent_at: float | None = None
        self._retry_in = 0.0  # after a failed batch: the retry policy's delay

    # -- the queue ----------------------------------------------------------------------------------------------

    def load(self) -> int:
        """The keys a previous run did not get acknowledged."""
        try:
            doc = json.loads(self.path.read_bytes())
            keys = doc["pending"] if isinstance(doc, dict) else None
            if not isinstance(keys, list):
                raise ValueError("no 'pending' list")
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError) as exc:
            log.warning("report queue %s unreadable (%s); every report entry is queued again", self.path, exc)
            keys = [e["key"] for e in self.store.index()]
        for key in keys:
            if isinstance(key, str) and not report_key_problem(key):
                self._note(key)
        if self._pending:
            log.info("%d report change(s) from the last run are queued for the control plane", len(self._pending))
        return len(self._pending)

    def changed(self, key: str) -> None:
        """A report entry was written or deleted (ReportStore.on_change)."""
        self._note(key)
        self._save()

    def _note(self, key: str) -> None:
        self._changes += 1
        self._pending[key] = self._changes
        self._wake.set()

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"version": 1, "pending": list(self._pending)}).encode(), FILE_MODE)
        except OSError as exc:
            log.error("report queue %s not written (%s): changes not yet sent would be lost by a restart", self.path,
                      exc.strerror or exc)

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- the service --------------------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            await self._sleep(self.debounce)  # let a burst of writes join one batch
            self._wake.clear()
            while self._pending:
                if not await self._send_one_batch():
                    await self._sleep(self._retry_in)

    async def _send_one_batch(self) -> bool:
        batch = dict(list(self._pending.items())[:MAX_BATCH_KEYS])
        entries, deleted = [], []
        for key in batch:
            entry = self.store.get(key)
            if entry is None:
                deleted.append(key)
            else:
                entries.append(entry.to_wire())
        try:
            await self.send(entries, deleted)
        except ControlPlaneError as exc:
            verdict = retry_verdict(exc, self.backoff)
            if not verdict.retry:
                log.error("report sync: the control plane refused a batch of %d entries and %d deletions (%s); "
                          "dropped, keys: %s", len(entries), len(deleted), exc, ", ".join(sorted(batch))[:500])
                self.dropped_batches += 1
                self._acknowledged(batch)
                return True
            self._failed(exc)
            self._retry_in = verdict.delay
            return False
        except PlexdError as exc:  # re-registration impossible: keep the queue, retry later
            self._failed(exc)
            self._retry_in = self.backoff.next_delay()
            return False
        if self.last_error:
            log.info("report sync: delivered again after an outage")
        self.last_error = ""
        self.backoff.reset()
        self.sent_batches += 1
        self.last_sent_at = time.time()
        log.debug("report sync: %d entries, %d deletions acknowledged", len(entries), len(deleted))
        self._acknowledged(batch)
        return True

    def _failed(self, exc: Exception) -> None:
        if not self.last_error:  # once per outage, not once per retry
            log.warning("report sync failed (%s); %d change(s) stay queued and are retried", exc, len(self._pending))
        self.last_error = str(exc)

    def _acknowledged(self, batch: dict[str, int]) -> None:
        for key, number in batch.items():
            if self._pending.get(key) == number:  # not changed again while the batch was on its way
                del self._pending[key]
        self._save()

    def status(self) -> dict[str, Any]:
        return {"pending": self.pending, "sent_batches": self.sent_batches, "dropped_batches": self.dropped_batches,
                "last_sent_at": round(self.last_sent_at, 1) if self.last_sent_at else None,
                "last_error": self.last_error}
