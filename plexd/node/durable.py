"""Group commit of what the event path must keep: the desired-state mirror first, then the event ledger.

Events change the desired model and note their cursor and nonce in the ledger, all in memory and O(1). At most
once per `delay` (1 s) this writes both, off the event loop: the mirror (the model as it stands, serialised in a
worker thread: the model is immutable) and then, in one SQLite transaction, exactly the ledger notes taken at the
same moment as that model. So a committed cursor never acknowledges an event whose effect is not in the mirror
on disk (the guarantee is spelled out in `plexd.controlplane.ledger` and the README). Nothing is written while
nothing changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from plexd.controlplane.ledger import Batch, EventLedger
from plexd.desired import DesiredState
from plexd.node.mesh import save_mirror

log = logging.getLogger(__name__)


class GroupCommit:
    """One writer at a time, always the newest model and notes: a write never overtakes a later one."""

    def __init__(self, data_dir: Path, ledger: EventLedger, delay: float = 1.0) -> None:
        self.data_dir = data_dir
        self.ledger = ledger
        self.delay = delay
        self._desired: DesiredState | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task[None] | None = None
        self._again = False
        self.flushes = 0
        ledger.on_pending = self._soon

    def desired_changed(self, desired: DesiredState) -> None:
        self._desired = desired
        self._soon()

    def persist_now(self) -> None:
        """Write without waiting for the group window (after a state pull)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._start()

    def _soon(self) -> None:
        if self._timer is not None:
            return
        try:
            self._timer = asyncio.get_running_loop().call_later(self.delay, self._start)
        except RuntimeError:  # no loop (a synchronous caller): write now
            self._write(*self._take())

    def _start(self) -> None:
        self._timer = None
        if self._writing is not None and not self._writing.done():
            self._again = True  # the running write ends by starting the next, with whatever arrived meanwhile
            return
        desired, batch = self._take()
        if desired is not None or batch is not None:
            self._writing = asyncio.get_running_loop().create_task(self._write_off_loop(desired, batch))

    def _take(self) -> tuple[DesiredState | None, Batch | None]:
        """The model and the ledger notes as of this instant (on the loop: no event is half-way between them)."""
        desired, self._desired = self._desired, None
        return desired, self.ledger.take()

    async def _write_off_loop(self, desired: DesiredState | None, batch: Batch | None) -> None:
        try:
            ok = await asyncio.to_thread(self._write, desired, batch)
        except BaseException:
            ok = False
            raise
        finally:
            if not ok:
                self._give_back(desired, batch)
                self._soon()
            if self._again:
                self._again = False
                asyncio.get_running_loop().call_soon(self._start)

    def _give_back(self, desired: DesiredState | None, batch: Batch | None) -> None:
        if self._desired is None:
            self._desired = desired
        if batch is not None:
            self.ledger.give_back(batch)

    def _write(self, desired: DesiredState | None, batch: Batch | None) -> bool:
        if desired is not None and not save_mirror(self.data_dir, desired):
            return False  # the effects are not on disk: acknowledge nothing yet
        self.flushes += 1
        return self.ledger.write(batch, time.time())

    async def close(self) -> None:
        """Finish the write in flight and write what is left (at shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        self._again = False
        desired, batch = self._take()
        if not await asyncio.to_thread(self._write, desired, batch):
            self._give_back(desired, batch)
