"""The converge gate: the one place that decides how the machine is brought to the desired model.

Every converge of the daemon goes through one `Gate`, which decides, under one lock:

    full or delta   an event's apply is a delta (`Engine.apply_delta`) unless the gate must read the machine first:
                    held, machine kept, or the protected addresses not read yet; then it plans or applies in full
    dry run         asked for: plan only (`Mode.DRY_RUN`)
    hold            an operator holds the reconcile (`plexd reconcile hold`): plan only (`Mode.HELD`)
    keep            before the first state pull, a device that survived the last plexd is kept as it is
                    (`Mode.KEPT`); without one, the mirror brings the interface up
    skip            a state pull that changed nothing after a full converge to that very model: no second read

The engine does what the gate decided (`Engine.converge(desired, mode)`); what is specific to the mesh (reading
the protected addresses, noting refused peers) is the gate's `Guard`, which `plexd.node.mesh` provides.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

from plexd.converge.coalesce import Requests
from plexd.converge.engine import ConvergeResult, Engine, Mode
from plexd.converge.hold import ReconcileHold
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore

Timed = Callable[[str, float], None]  # (full | events, seconds): what the metrics endpoint observes


class Guard(Protocol):
    """What the model's owner does around the gate's applies (`plexd.node.mesh.MeshHandle`)."""

    @property
    def ready_for_delta(self) -> bool:
        """False until what a full converge reads first (the protected addresses) has been read."""
        ...

    async def before_full(self) -> None:
        """Before every full converge, in the gate's turn: bring the model's own inputs up to date."""
        ...

    def after_apply(self, desired: DesiredState) -> None:
        """After an event's apply went live: note what it refused."""
        ...

    def after_full(self) -> None:
        """After a full converge that ran (not one skipped): the machine was read and every domain planned."""
        ...

    async def machine_left_up(self) -> bool:
        """Whether a device the last plexd left is up (then it is kept until the first state pull)."""
        ...


class Gate:
    """One converge at a time, full or delta, applied, planned, held or kept: decided here, done by the engine."""

    def __init__(self, engine: Engine, store: DesiredStore, guard: Guard, *, requests: Requests,
                 hold: ReconcileHold, known: bool = True,
                 before_first: Callable[[], Awaitable[None]] | None = None) -> None:
        self.engine = engine
        self.store = store
        self.hold = hold
        self.requests = requests
        self._guard = guard
        self._lock = asyncio.Lock()
        # False until the first state pull: a device already up (left by the last plexd) is kept as it is rather
        # than converged to a mirror that may be older than it.
        self._known = asyncio.Event()
        if known:
            self._known.set()
        self._before_first = before_first  # the NAT discovery's hand-over of the listen port, awaited once
        self._fresh: DesiredState | None = None  # the model the last full converge left the machine matching
        self._pull_changed_nothing = False
        self.busy_since: float | None = None  # monotonic start of the converge holding the lock
        self._timed_by: list[Timed] = []

    # -- what the rest of the daemon asks --------------------------------------------------------------------

    @property
    def known(self) -> bool:
        """Whether the control plane's state has been applied (until then an existing device is left alone)."""
        return self._known.is_set()

    def mark_known(self) -> None:
        self._known.set()

    async def wait_known(self) -> None:
        await self._known.wait()

    @property
    def pending(self) -> int:
        """Event applies requested and not yet served."""
        return self.requests.pending

    def on_timed(self, observer: Timed) -> None:
        """`observer(kind, seconds)` after every converge (the metrics endpoint's histogram)."""
        self._timed_by.append(observer)

    def stuck_for(self) -> float:
        """How long the converge now running has been at it (0 when none runs): the watchdog's other half."""
        return time.monotonic() - self.busy_since if self.busy_since is not None else 0.0

    def pulled(self) -> None:
        """A state pull was applied: if it left the model as the last full converge had it, the converge that
        follows it has nothing to do."""
        self._pull_changed_nothing = self._fresh is not None and self._fresh == self.store.value

    async def serve_requests(self) -> None:
        """The service that answers events' requests for an apply (coalesced: `plexd.converge.coalesce`)."""
        await self.requests.serve(self.apply_events)

    # -- the decisions ----------------------------------------------------------------------------------------

    def mode(self, *, dry_run: bool, device_kept: bool) -> Mode:
        """What a converge does now with what it finds."""
        if dry_run:
            return Mode.DRY_RUN
        if device_kept:  # before a hold: while kept, not even what acts while held touches the machine
            return Mode.KEPT
        return Mode.HELD if self.hold.current() is not None else Mode.APPLIED

    async def converge(self, *, dry_run: bool = False) -> ConvergeResult:
        """Read, plan and apply every domain, as the gate decides (see the module's docstring)."""
        async with self._lock:
            with self._timed("full"):
                return await self._full(dry_run)

    async def plan(self, model: DesiredState) -> ConvergeResult:
        """What converging to `model` would change, the store's model untouched (a dry run's pull)."""
        async with self._lock:
            with self._timed("full"):
                return await self.engine.converge(model, Mode.DRY_RUN)

    async def apply_events(self) -> ConvergeResult:
        """Apply what events changed in the model: only the touched peers and routes, unless the machine must be
        read first (held, kept, protected addresses unknown): then in full, like any converge."""
        async with self._lock:
            # A refresh's pull went through `pulled()`, but this apply does not read the machine: the next full
            # converge must not take the pull as one whose changes a full converge already made.
            self._pull_changed_nothing = False
            with self._timed("events"):
                # Held: plan in full, and leave the touched peers for the apply after the hold (taken now, they
                # were lost: the next event's delta moved the baseline past them and a removed peer stayed).
                if not self._guard.ready_for_delta or not self.known or self.hold.current() is not None:
                    return await self._full(False)
                touched = self.store.take_touched()
                desired = self.store.value
                result = await self.engine.apply_delta(desired, touched)
                self._guard.after_apply(desired)  # after the change is live: noting walks a new policy's rules
                return result

    async def _full(self, dry_run: bool) -> ConvergeResult:
        if self._before_first is not None:
            wait, self._before_first = self._before_first, None
            await wait()
        await self._guard.before_full()
        skip, self._pull_changed_nothing = self._pull_changed_nothing, False
        if skip and not dry_run and self._fresh == self.store.value and self.hold.current() is None:
            # The drift phase of this reconcile read the machine and converged it to this very model, and the
            # state pull changed nothing: reading the machine again would only cost.
            return ConvergeResult()
        model = self.store.value
        kept = not dry_run and not self.known and await self._guard.machine_left_up()
        result = await self.engine.converge(model, self.mode(dry_run=dry_run, device_kept=kept))
        self._fresh = model if result.mode is Mode.APPLIED and result.ok else None
        self._guard.after_full()
        return result

    @contextlib.contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        self.busy_since = start = time.monotonic()
        try:
            yield
        finally:
            self.busy_since = None
            for observer in self._timed_by:
                observer(kind, time.monotonic() - start)
