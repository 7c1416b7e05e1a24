"""The converge engine: every domain observed, diffed and repaired, one converge at a time.

`await engine.converge(desired)` reads the live machine of every domain, plans and applies (start-up, the periodic
reconcile, `reconcile --once`); `await engine.apply_delta(desired, touched)` applies what events changed, per
domain without reading the machine where the domain can. Neither raises for what the machine or the control plane
can cause: failures come back in `ConvergeResult.errors`, the other domains still converge, and the next converge
tries again (level-triggered). Whether a converge applies, only plans, or holds the machine is not the engine's
choice: `plexd.converge.gate.Gate` decides it and passes a `Mode`.

Order: the domains apply in the order they are listed (`plexd.node.domain_list.build_engine`): the firewall before
the WireGuard device, so a new peer meets its rules; teardown runs in the reverse order.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from plexd.base.errors import PlexdError
from plexd.base.failpoint import failpoint
from plexd.converge.change import Change, Correction
from plexd.converge.domain import Domain, DomainResult
from plexd.state.desired import DesiredState

log = logging.getLogger(__name__)

class Mode(enum.Enum):
    """What a converge did with the changes it found."""

    APPLIED = "applied"  # applied them
    DRY_RUN = "dry_run"  # asked to plan only
    HELD = "held"  # an operator's hold: planned only (domains that act while held, and those that do not touch
    # the machine, applied theirs, which are counted and not listed)
    KEPT = "kept"  # the machine is kept as it is until the first state pull: planned only (same exceptions)


@dataclass(frozen=True)
class ConvergeResult:
    """What one converge did. `changes` lists only what was applied successfully, or, unless `mode` is APPLIED,
    what was planned and not applied."""

    changes: tuple[Change, ...] = ()
    errors: tuple[str, ...] = ()
    skipped_peers: tuple[tuple[str, str], ...] = ()  # (peer id, reason): invalid peers left out
    mode: Mode = Mode.APPLIED

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def held_back(self) -> bool:
        """The machine was left as it is by a hold or a keep (not by a dry run): `changes` are drift not corrected."""
        return self.mode in (Mode.HELD, Mode.KEPT)

    def corrections(self) -> list[Correction]:
        """What this converge changed, one drift-report line each."""
        return [c.correction() for c in self.changes]


class _Failed:
    """A domain's observe that raised: the reason, in place of the observed state."""

    def __init__(self, error: str) -> None:
        self.error = error


class Engine:
    """Runs the domains, one converge (full or delta) at a time, in the mode the gate chose."""

    def __init__(self, domains: Sequence[Domain]) -> None:
        names = [d.name for d in domains]
        if len(set(names)) != len(names):
            raise ValueError(f"two domains share a name: {names}")
        self.domains = tuple(domains)
        self._lock = asyncio.Lock()
        self.last_result: ConvergeResult | None = None
        # every change applied, by type (drift, updates, bring-up alike; the drift alone: Reconciler.drift_corrected)
        self.corrections: collections.Counter[str] = collections.Counter()

    def domain(self, name: str) -> Domain | None:
        return next((d for d in self.domains if d.name == name), None)

    def status(self) -> dict[str, Any]:
        """Each domain's health, by name (those that have something to say)."""
        out = {}
        for d in self.domains:
            s = d.status()
            if s is not None:
                out[d.name] = dict(s)
        return out

    async def converge(self, desired: DesiredState, mode: Mode = Mode.APPLIED) -> ConvergeResult:
        """Read, plan and apply every domain, as `mode` says (the gate decides it: `plexd.converge.gate`).
        DRY_RUN only plans. HELD and KEPT: the domains that touch the machine only plan, and the others
        (`touches_machine = False`: what the control plane is told) still apply; so do, when HELD only, those that
        say `acts_while_held` (the access sessions: revocations)."""
        async with self._lock:
            observed = await asyncio.gather(*(self._observe(d, desired) for d in self.domains))
            total = DomainResult()
            for domain, seen in zip(self.domains, observed, strict=True):
                acts = mode is Mode.APPLIED or (mode is not Mode.DRY_RUN and not domain.touches_machine) or (
                    mode is Mode.HELD and domain.acts_while_held)
                result = await self._converge_one(domain, desired, seen, not acts)
                if acts:
                    failpoint("converge.between_domains")
                if acts and mode is not Mode.APPLIED:  # done while the machine is held: counted, not listed
                    self._corrected(result.changes)
                    result = DomainResult(errors=result.errors)
                total += result
            if mode is Mode.APPLIED:
                self._corrected(total.changes)
            result = ConvergeResult(total.changes, total.errors, desired.rejected, mode)
            self.last_result = result
            return result

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None = None) -> ConvergeResult:
        """Apply what changed in `desired` since the last apply: O(change) in every domain that can; a domain that
        cannot (no baseline, the delta refused) converges in full, alone."""
        async with self._lock:
            total = DomainResult()
            for domain in self.domains:
                try:
                    delta = await domain.apply_delta(desired, touched)
                except Exception as e:  # the full converge below names it again if it persists
                    self._failure(domain, "applying an event", e)
                    delta = None
                if delta is None:
                    seen = await self._observe(domain, desired)
                    full = await self._converge_one(domain, desired, seen, False)
                    self._corrected(full.changes)
                    total += full
                else:
                    for c in delta.changes:
                        log.debug("applied: %s", c.detail)
                    total += delta
            result = ConvergeResult(total.changes, total.errors, desired.rejected)
            self.last_result = result
            return result

    async def teardown(self) -> None:
        """Every domain removes what it put on the machine, last listed first (deregistration)."""
        async with self._lock:
            for domain in reversed(self.domains):
                try:
                    await domain.teardown()
                except Exception as e:
                    self._failure(domain, "tearing down", e)

    async def _observe(self, domain: Domain, desired: DesiredState) -> Any:
        try:
            return await domain.observe(desired)
        except Exception as e:  # a bug in one domain must not stop the others
            return _Failed(self._failure(domain, "reading the machine", e))

    async def _converge_one(self, domain: Domain, desired: DesiredState, seen: Any, dry_run: bool) -> DomainResult:
        if isinstance(seen, _Failed):
            return DomainResult(errors=(seen.error,))
        try:
            planned = domain.plan(desired, seen)
        except Exception as e:
            return DomainResult(errors=(self._failure(domain, "planning", e),))
        if dry_run:
            return planned
        try:
            applied = await domain.apply(desired, planned, seen)
        except Exception as e:
            return DomainResult(errors=(*planned.errors, self._failure(domain, "applying", e)))
        return DomainResult(applied.changes, planned.errors + applied.errors)

    @staticmethod
    def _failure(domain: Domain, doing: str, e: Exception) -> str:
        """Log what a domain raised, and return its error line: a PlexdError says what the machine did, anything
        else is a bug (logged with its traceback)."""
        if isinstance(e, PlexdError):
            log.error("%s: %s", domain.name, e)
            return str(e)
        log.error("%s: %s failed", domain.name, doing, exc_info=e)
        return f"{domain.name}: internal error {doing}: {e!r}"

    def _corrected(self, changes: Sequence[Change]) -> None:
        for c in changes:
            log.info("corrected: %s", c.detail, extra={"correction": c.correction_type})
            self.corrections[c.correction_type] += 1

