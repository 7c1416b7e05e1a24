"""Group commit of what the event path must keep: the desired-state mirror and the event ledger, together.

Events change the desired model and note their cursor and nonce in the ledger, all in memory and O(1). At most
once per `delay` (1 s) this writes, off the event loop and in one SQLite transaction, the peers that changed
since the last write (found by identity: an edit replaces what it changes), the rest of the model, and exactly
the ledger notes taken at the same moment as that model. So a committed cursor never acknowledges an event whose
effect is not on disk (the guarantee is spelled out in `plexd.controlplane.ledger` and the README). A commit
costs what changed, not the mesh; nothing is written while nothing changes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace

from plexd.controlplane.ledger import Batch, EventLedger, MirrorChange
from plexd.mesh.delta import touched_peers
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore

log = logging.getLogger(__name__)

MIRROR = "mirror"  # the reader name of the mirror in the store's touched-peer sets


class GroupCommit:
    """One writer at a time, always the newest model and notes: a write never overtakes a later one."""

    def __init__(self, ledger: EventLedger, store: DesiredStore | None = None, delay: float = 1.0) -> None:
        """`store`: the desired model whose changes are mirrored (None: the ledger's notes alone)."""
        self.ledger = ledger
        self._store = store
        self._scan_next = False  # a write failed: the ids it took are lost, so the next write scans
        self.delay = delay
        self._desired: DesiredState | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task[None] | None = None
        self._again = False
        self._written: DesiredState | None = None  # the model of the last successful write (writer only)
        self._written_head = ""
        ledger.on_pending = self._soon
        if store is not None:
            store.subscribe(self.desired_changed)

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
        desired, batch, touched = self._take()
        if desired is not None or batch is not None:
            self._writing = asyncio.get_running_loop().create_task(self._write_off_loop(desired, batch, touched))

    def _take(self) -> tuple[DesiredState | None, Batch | None, set[str] | None]:
        """The model, the ledger notes and the changed peer ids as of this instant (on the loop: no event is
        half-way between them)."""
        desired, self._desired = self._desired, None
        # the peer ids changed since the last take (None: unknown, scan)
        touched = self._store.take_touched(MIRROR) if self._store is not None else None
        if self._scan_next:
            touched, self._scan_next = None, False
        return desired, self.ledger.take(), touched

    async def _write_off_loop(self, desired: DesiredState | None, batch: Batch | None,
                              touched: set[str] | None) -> None:
        ok = False
        try:
            ok = await asyncio.to_thread(self._write, desired, batch, touched)
        finally:
            if not ok:
                self._give_back(desired, batch)
                self._soon()
            if self._again:
                self._again = False
                asyncio.get_running_loop().call_soon(self._start)

    def _give_back(self, desired: DesiredState | None, batch: Batch | None) -> None:
        self._scan_next = True
        if self._desired is None:
            self._desired = desired
        if batch is not None:
            self.ledger.give_back(batch)

    def _write(self, desired: DesiredState | None, batch: Batch | None, touched: set[str] | None = None) -> bool:
        mirror = mirror_change(self._written, desired, touched) if desired is not None else None
        if mirror is not None and not mirror.full and not mirror.upserts and not mirror.deletes and (
                mirror.head == self._written_head):
            mirror = None  # a state pull that changed nothing: nothing to write
        if not self.ledger.write(batch, time.time(), mirror):
            return False
        if desired is not None:
            self._written = desired
        if mirror is not None:
            self._written_head = mirror.head
        return True

    async def close(self) -> None:
        """Finish the write in flight and write what is left (at shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        self._again = False
        desired, batch, touched = self._take()
        if not await asyncio.to_thread(self._write, desired, batch, touched):
            self._give_back(desired, batch)


def mirror_change(old: DesiredState | None, new: DesiredState, touched: set[str] | None = None) -> MirrorChange:
    """The rows that turn the mirror of `old` into the mirror of `new` (all of them when there is no `old`).
    `touched`: the peer ids that may differ (a superset is fine); None: compare every peer."""
    head = _dumps(replace(new, peers={}).to_json())
    if old is None:
        return MirrorChange(head, [(pid, _dumps(p.to_wire())) for pid, p in new.peers.items()], [], full=True)
    upserts, deletes = [], []
    changed = touched_peers(old, new) if touched is None else [
        pid for pid in sorted(touched) if old.peers.get(pid) is not new.peers.get(pid)]
    for pid in changed:
        peer = new.peers.get(pid)
        if peer is None:
            deletes.append(pid)
        else:
            upserts.append((pid, _dumps(peer.to_wire())))
    return MirrorChange(head, upserts, deletes)


def _dumps(doc: object) -> str:
    return json.dumps(doc, separators=(",", ":"))
