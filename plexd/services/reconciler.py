"""The consistency fallback: pull the full state, converge the live machine to it, report what was corrected (§4).

Level-triggered, like a Kubernetes controller: the first cycle runs at start, then one every `interval`, plus
triggers (stream reconnect, heartbeat ``reconcile:true``, ``policy_updated``) that are coalesced — any number of
triggers during a cycle cause exactly one more cycle. Each cycle: `gate.converge()` against the desired model we
already had (what it corrects is drift) → `source.fetch()` → `source.apply(pulled)` (replaces the desired model;
may return changes of its own) → `gate.converge()` again (updates, not drift) → ``POST /drift`` only when drift
was corrected. The two parts are typed: a `StateSource` (`plexd.node.mesh.StatePull`) and a `Converger` (the
converge gate, `plexd.converge.gate.Gate`); a converge's ``.changes`` carry ``.correction_type`` and
``.detail``. The first cycle after start only brings the machine up: what it corrects is not drift. A drift
report goes through the uplink outbox (`plexd.controlplane.uplink`): in the daemon it is on disk before it is
sent, so one the control plane could not take is delivered once it is back, after a restart too; each cycle
tries what is queued again, and the outbox's own service retries on its backoff in between.

`refresh(reason)` is the light cycle, for an event that says the state changed without carrying the change
(``policy_updated``): pull the state and apply it like events (`apply_events`: each domain diffs against what
its last apply left, no machine read, no drift phase). A full cycle pending at the same time covers it; a pull
that fails or is overtaken by events turns into a full cycle.

Both hand each pulled state, before it is applied, to whoever asked with `on_pull` (not a dry run's): the action
dispatcher takes the actions a state lists there, on every pull, whether or not the state applies.

A cycle on its interval skips the pull while the event stream has kept the model current
(`plexd.services.pull_freshness`): phase 1 still diffs the live machine, and the control plane is spared a
request a minute. Every triggered cycle pulls.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from plexd.base import gojson
from plexd.base.backoff import Backoff
from plexd.base.clock import Clock
from plexd.controlplane.uplink import Poster, UplinkOutbox, by_kind
from plexd.converge.change import Change, Correction
from plexd.services.pull_freshness import Mark, always_pull
from plexd.state.desired_store import StalePull

log = logging.getLogger(__name__)

DRIFT = "drift"  # the outbox kind of drift reports


def drift_uplink(path: Path, post_drift: Callable[[dict[str, Any]], Awaitable[None]],
                 backoff: Backoff | None = None, **others: Poster) -> UplinkOutbox:
    """The durable outbox (data_dir/uplink.db) that carries drift reports to the control plane, and the other
    kinds of report in `others` (kind -> how it is posted)."""
    return UplinkOutbox(path, by_kind({DRIFT: post_drift, **others}), backoff=backoff)


@dataclass
class CycleResult:
    ok: bool
    corrections: list[Correction] = field(default_factory=list)  # drift (reported); the whole plan in a dry run
    updates: list[Correction] = field(default_factory=list)  # changes the pulled state asked for (not drift)
    error: str = ""
    reasons: tuple[str, ...] = ()
    dry_run: bool = False
    report: dict[str, Any] | None = None
    reported: bool = False  # the drift report reached the control plane
    held: list[Correction] = field(default_factory=list)  # not corrected: an operator holds the reconciler
    refused: list[Correction] = field(default_factory=list)  # asked for by the control plane, refused (reported)
    at: float = 0.0  # unix time the cycle ended
    ended: float = 0.0  # monotonic time the cycle ended: its age holds across a step of the wall clock
    pulled: bool = True  # the state was pulled (False: the event stream had kept the model current)

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """`now` (monotonic) adds `age_seconds`: how long ago the cycle ended, true whatever the wall clock did."""
        age = {} if now is None else {"age_seconds": round(max(0.0, now - self.ended), 1)}
        return {"at": self.at, **age, "reasons": list(self.reasons), "ok": self.ok, "dry_run": self.dry_run,
                "error": self.error, "corrections": [c.to_wire() for c in self.corrections],
                "updates": [c.to_wire() for c in self.updates], "held": [c.to_wire() for c in self.held],
                "refused": [c.to_wire() for c in self.refused],
                "drift_reported": self.reported, "state_pulled": self.pulled}


class Outcome(Protocol):
    """What a converge returns (`plexd.converge.engine.ConvergeResult`): the changes it made, or only planned when
    `held_back` (an operator's hold, or a live device kept until the first pull) or in a dry run."""

    @property
    def changes(self) -> Sequence[Change]: ...

    @property
    def held_back(self) -> bool: ...


S = TypeVar("S")  # what a state source's fetch returns and its apply takes (plexd.node.mesh.PulledState)


class StateSource(Protocol[S]):
    """Where the desired state comes from and goes (`plexd.node.mesh.StatePull`)."""

    async def fetch(self) -> S:
        """Pull the state (GET /state)."""
        ...

    def apply(self, pulled: S) -> Iterable[Correction] | None:
        """Replace the desired model with the pulled state; may report changes of its own."""
        ...

    async def plan(self, pulled: S) -> Outcome:
        """The pulled state planned on a model of its own (a dry run): nothing kept."""
        ...

    def take_refusals(self) -> list[Correction]:
        """Peers, routes and rules the control plane asked for and the node refused, not reported yet."""
        ...

    async def between_pulls(self) -> bool:
        """In a cycle that skips the pull: what the model takes from this machine read again; True when the model
        changed."""
        ...


class Converger(Protocol):
    """What converges the machine (`plexd.converge.gate.Gate`)."""

    async def converge(self, *, dry_run: bool = False) -> Outcome: ...

    async def apply_events(self) -> Outcome:
        """The event path: what events changed in the model, applied."""
        ...

    @property
    def pending(self) -> int:
        """Event applies requested and not yet served."""
        ...


def corrections_of(changes: Iterable[Change | Correction] | None) -> list[Correction]:
    return [c if isinstance(c, Correction) else c.correction() for c in changes or ()]


class Reconciler(Generic[S]):
    def __init__(self, source: StateSource[S], gate: Converger,
                 post_drift: Callable[[dict[str, Any]], Awaitable[None]], *, clock: Clock | None = None,
                 interval: float = 60.0, outbox: UplinkOutbox | None = None) -> None:
        """`outbox`: the daemon's durable one; None: one in memory around `post_drift`. `freshness` (set by the
        daemon's assembly, beside its event stream): when an interval cycle may skip the pull; until then, never."""
        self._source = source
        self._gate = gate
        self._clock = clock or Clock()
        self.interval = max(1.0, interval)
        self._wake = asyncio.Event()
        self._reasons: list[str] = []
        self._refresh_reasons: list[str] = []
        self.refreshes = 0
        self._lock = asyncio.Lock()
        self._outbox = outbox if outbox is not None else UplinkOutbox(None, lambda kind, body: post_drift(body))
        self.freshness = always_pull(self._clock)
        self.pulls_skipped = 0
        self.pulled_at: float | None = None  # monotonic: when the last pull that was applied ended
        self.started = asyncio.Event()  # the start's converge from the stored state was tried: READY=1 may go
        # Drift corrected (what the drift reports name), by type: not the start's bring-up, the control plane's
        # updates or the event path's changes, which the engine's own count of applied changes includes
        self.drift_corrected: collections.Counter[str] = collections.Counter()
        self.cycles = 0
        self.failures = 0
        self.last: CycleResult | None = None
        self._takers: list[Callable[[S], Awaitable[None]]] = []

    def on_pull(self, take: Callable[[S], Awaitable[None]]) -> None:
        """`take(pulled)` for every state pulled to be applied, before it is; what it raises is logged."""
        self._takers.append(take)

    async def _hand_out(self, pulled: S, why: str) -> None:
        for take in self._takers:
            try:
                await take(pulled)
            except Exception:
                log.exception("reconcile (%s): handing out the pulled state failed", why)

    def trigger(self, reason: str = "triggered") -> None:
        """Ask for a cycle as soon as possible; coalesced with any other pending trigger."""
        self.freshness.invalidate()  # if that cycle's pull fails, the next one pulls
        self._reasons.append(reason)
        self._wake.set()

    def refresh(self, reason: str) -> None:
        """Ask for the state to be pulled and applied through the event path (coalesced like `trigger`)."""
        self.freshness.invalidate()
        self._refresh_reasons.append(reason)
        self._wake.set()

    def stale(self, reason: str) -> None:
        """The model may lack something the control plane has (`reason`): the next cycle pulls, even on its
        interval with the event stream connected."""
        log.debug("the next reconcile pulls the state: %s", reason)
        self.freshness.invalidate()

    def _pulled(self, mark: Mark) -> None:
        self.freshness.pulled(mark)
        self.pulled_at = self._clock.monotonic()

    async def run(self) -> None:
        """First cycle now, then every interval or on trigger, until cancelled."""
        # The first phase-1 converge brings the interface and the last known peers up (also offline): that is
        # start-up, not drift. A restart of this service (after a crash) is not a start.
        if self.cycles == 0:
            await self.run_once(reasons=("start",), startup=True)
        else:
            self.started.set()  # crashed before its first converge finished: READY=1 must not wait forever
            self.trigger("reconciler restarted")
        while True:
            reasons, light = await self._wait_next()
            if light:
                await self.refresh_once(reasons)
            else:
                await self.run_once(reasons=reasons)

    async def _wait_next(self) -> tuple[tuple[str, ...], bool]:
        """The reasons for the next cycle, and whether only `refresh` asked for it (the light cycle)."""
        if not self._wake.is_set():
            sleeper = asyncio.ensure_future(self._clock.sleep(self.interval))
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (sleeper, waker):
                    task.cancel()
                await asyncio.wait({sleeper, waker})  # never swallow our own cancellation
        self._wake.clear()
        full, light = tuple(dict.fromkeys(self._reasons)), tuple(dict.fromkeys(self._refresh_reasons))
        self._reasons.clear()
        self._refresh_reasons.clear()
        if light and not full:
            return light, True
        return (*full, *light) or ("interval",), False

    async def refresh_once(self, reasons: tuple[str, ...]) -> None:
        """The light cycle: pull, replace the model, apply through the event path. Never reports drift (it reads
        nothing of the machine); whatever goes wrong asks for a full cycle instead."""
        why = ", ".join(reasons)
        async with self._lock:
            self.refreshes += 1
            try:
                mark = self.freshness.mark()
                state = await self._source.fetch()
                await self._hand_out(state, why)
                updates = corrections_of(self._source.apply(state))
                result = await self._gate.apply_events()
                updates += corrections_of(result.changes)
                self._pulled(mark)
            except StalePull as exc:
                log.warning("state refresh (%s) overtaken by events, reconciling: %s", why, exc)
                self.trigger("state pull overtaken by events")
                return
            except Exception as exc:
                log.warning("state refresh (%s) failed, reconciling in full: %s", why, exc)
                self.trigger(f"{why}: the state refresh failed")
                return
        if updates:
            log.info("state refresh (%s) applied %d update(s): %s", why, len(updates),
                     "; ".join(f"{c.type}: {c.detail}" for c in updates))

    async def run_once(self, dry_run: bool = False, reasons: tuple[str, ...] = ("once",),
                       startup: bool = False, drift_phase: bool = True) -> CycleResult:
        """One cycle. With `dry_run`, nothing on the machine is changed and no drift is reported.
        `drift_phase=False` skips phase 1, for a caller that has no earlier desired model to hold the machine to."""
        async with self._lock:
            result = await self._cycle(dry_run or not drift_phase, reasons, startup, apply=not dry_run)
        result.at, result.ended = self._clock.now().timestamp(), self._clock.monotonic()
        self.last = result
        return result

    async def _cycle(self, skip_phase1: bool, reasons: tuple[str, ...], startup: bool = False,
                     apply: bool = True) -> CycleResult:
        """Drift first, then the new state.

        1. apply the events already in the model, then converge the machine to the desired model we already had:
           whatever that corrects is drift (someone or something changed the machine), and is reported — even
           when the control plane is unreachable;
        2. replace the model with the pulled state and converge again: those changes are updates the control
           plane asked for (a new peer, a rotated key), logged but not reported as drift.
        The Go agent reports every difference from its last snapshot, so its first cycle after each start
        reports the whole mesh as drift; this does not. A dry run only plans (no phase 1, nothing applied).
        """
        self.cycles += 1
        why = ", ".join(reasons)
        drift, held, error = (await self._drift_phase(startup, why)) if not skip_phase1 else ([], [], "")
        if startup:
            self.started.set()
        pull = not apply or reasons != ("interval",) or bool(self.freshness.due())
        if pull:
            updates, held_now, pull_error = await self._pull_phase(not apply, why)
        else:
            self.pulls_skipped += 1
            updates, held_now, pull_error = await self._local_phase(why)
        error = error or pull_error
        if error:
            self.failures += 1
        if not apply:  # the plan: everything that would change
            return CycleResult(ok=not error, corrections=updates, error=error, reasons=reasons, dry_run=True)
        # What the control plane asked for and we refused (a route into the tunnel, a stolen mesh address) is
        # reported with the drift: it is the control plane's to fix.
        out = CycleResult(ok=not error, corrections=drift, updates=updates, error=error, reasons=reasons,
                          held=held + held_now, refused=self._source.take_refusals(), pulled=pull)
        self._log(out, why)
        await self._report(out)
        return out

    async def _drift_phase(self, startup: bool, why: str) -> tuple[list[Correction], list[Correction], str]:
        """Phase 1: (drift corrected, drift held, error)."""
        try:
            if not startup and self._gate.pending:
                # Events edited into the model but not applied yet (their apply is queued behind this cycle) are
                # the control plane's news, not drift: apply them on their own path first. Only then: a domain
                # without a delta of its own converges in full on that path, and would repair drift without it
                # being reported.
                await self._gate.apply_events()
            result = await self._gate.converge()
        except Exception as exc:
            log.exception("reconcile (%s): converge failed", why)
            return [], [], f"converge failed: {exc}"
        drift = corrections_of(result.changes)
        if startup:  # bringing the mesh up (or, with a live device kept, planning it) is not drift
            if drift and not result.held_back:
                log.info("brought the mesh up from the stored state: %s",
                         "; ".join(f"{c.type}: {c.detail}" for c in drift))
            return [], [], ""
        if result.held_back:  # held by an operator: planned, not applied
            return [], drift, ""
        return drift, [], ""

    async def _pull_phase(self, dry_run: bool, why: str) -> tuple[list[Correction], list[Correction], str]:
        """Phase 2: (updates applied or, in a dry run, planned; updates held; error)."""
        mark = self.freshness.mark()
        try:
            state = await self._source.fetch()
        except Exception as exc:
            log.warning("reconcile (%s): fetching the state failed: %s", why, exc)
            return [], [], f"fetching the state failed: {exc}"
        if not dry_run:
            await self._hand_out(state, why)
        updates: list[Correction] = []
        try:
            if dry_run:
                # Not applied to the daemon's model: the next cycle would take the pulled changes, never
                # converged, for drift, and report them
                result = await self._source.plan(state)
            else:
                updates = corrections_of(self._source.apply(state))
                result = await self._gate.converge()
        except StalePull as exc:
            # Not applied (that would undo events); the model stays the events' own. Pull again at once.
            log.warning("reconcile (%s): state pull overtaken by events, pulling again: %s", why, exc)
            self.trigger("state pull overtaken by events")
            return [], [], f"state pull overtaken by events: {exc}"
        except Exception as exc:
            log.exception("reconcile (%s): converge failed", why)
            return updates, [], f"converge failed: {exc}"
        if not dry_run:
            self._pulled(mark)
        if result.held_back:
            return updates, corrections_of(result.changes), ""
        return updates + corrections_of(result.changes), [], ""

    async def _local_phase(self, why: str) -> tuple[list[Correction], list[Correction], str]:
        """Phase 2 without a pull: what the node reads of its own machine for the model (the route guard's
        protected addresses, which each pull reads too) brought up to date, and converged when it changed."""
        try:
            if not await self._source.between_pulls():
                return [], [], ""
            result = await self._gate.converge()
        except Exception as exc:
            log.exception("reconcile (%s): converge failed", why)
            return [], [], f"converge failed: {exc}"
        changes = corrections_of(result.changes)
        return ([], changes, "") if result.held_back else (changes, [], "")

    def _log(self, out: CycleResult, why: str) -> None:
        if out.held:
            log.warning("reconcile (%s) held: %d item(s) not corrected: %s", why, len(out.held),
                        "; ".join(str(c) for c in out.held))
        if out.updates:
            log.info("reconcile (%s) applied %d update(s) from the state: %s", why, len(out.updates),
                     "; ".join(f"{c.type}: {c.detail}" for c in out.updates))
        if out.corrections:
            log.warning("reconcile (%s) corrected %d drift(s): %s", why, len(out.corrections),
                        "; ".join(f"{c.type}: {c.detail}" for c in out.corrections))
            self.drift_corrected.update(c.type for c in out.corrections)

    async def _report(self, out: CycleResult) -> None:
        """Drift and refusals, through the uplink's drift lane (on disk before it is sent)."""
        seq: int | None = None
        if out.corrections or out.refused:
            out.report = {
                # Go marshals time.Now() in the local zone here; any RFC 3339 zone is valid on the wire.
                "timestamp": gojson.format_time(self._clock.now().astimezone()),
                "corrections": [c.to_wire() for c in [*out.corrections, *out.refused]],
            }
            seq = self._outbox.put(DRIFT, out.report)
        if not out.error or out.corrections or out.refused:
            taken = await self._outbox.deliver(DRIFT)  # its own lane: the others go on their own schedule
            out.reported = seq is not None and seq in taken
