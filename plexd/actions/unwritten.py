"""Journal writes that failed (data_dir full, or read-only), kept in memory and tried again until they land.

An action's rejection, its result and an integrity violation reach the control plane through the journal's outbox.
When the journal could not be written they were dropped, which broke two promises: every request is answered, and
every accepted action has its one result (`python -m bench chaos`, the disk_full fault: a request refused while the
disk was full was never acknowledged). They wait here instead, oldest first, and are written as soon as the journal
takes writes again; only a daemon stopped meanwhile loses them, and says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from plexd.actions.journal import JournalError

log = logging.getLogger(__name__)

RETRY_EVERY = 5.0
MAX_KEPT = 1000  # one per request or result: a full disk that lasts is no reason to grow without end


class UnwrittenJournal:
    """`keep(what, write)`: `write` failed with JournalError; call it again later, until it does not."""

    def __init__(self, retry_every: float = RETRY_EVERY, max_kept: int = MAX_KEPT) -> None:
        self.retry_every = retry_every
        self.max_kept = max_kept
        self._kept: list[tuple[str, Callable[[], None]]] = []
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, what: str, write: Callable[[], None], error: JournalError) -> None:
        if len(self._kept) >= self.max_kept:
            lost, _ = self._kept.pop(0)
            self.dropped += 1
            log.error("%d journal writes wait already; the oldest is dropped: %s", self.max_kept, lost)
        self._kept.append((what, write))
        log.error("%s; %s is kept and written when the journal can be written again", error, what)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._retry(), name="plexd-journal-retry")

    def write_kept(self) -> bool:
        """Write what waits, oldest first, until one fails; True when nothing waits any more."""
        while self._kept:
            what, write = self._kept[0]
            try:
                write()
            except JournalError:
                return False
            self._kept.pop(0)
            log.info("%s written to the journal at last", what)
        return True

    async def _retry(self) -> None:
        await asyncio.sleep(self.retry_every)  # it failed just now
        while not self.write_kept():
            await asyncio.sleep(self.retry_every)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if not self.write_kept():
            log.error("plexd stops with %d journal writes it could not make (%s): lost",
                      len(self._kept), ", ".join(what for what, _ in self._kept[:5]))
