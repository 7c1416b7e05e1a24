"""`plexd reconcile hold`: corrections paused for a bounded window, kept by the converge gate.

While a hold lasts, every converge only plans (the gate passes `Mode.HELD`), whoever asks: the periodic
reconcile, `reconcile --once` through the daemon, an event. The reconciler reports what it did not correct as held. Not
persisted: a restart ends it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from plexd.base.clock import Clock

log = logging.getLogger(__name__)

MAX_HOLD = 24 * 3600.0


@dataclass(frozen=True)
class Hold:
    until: float  # unix time
    reason: str
    since: float

    def to_json(self) -> dict[str, Any]:
        return {"until": _iso(self.until), "since": _iso(self.since), "reason": self.reason,
                "remaining_seconds": max(0, round(self.until - time.time()))}


class ReconcileHold:
    """`plexd reconcile hold`: corrections paused for a bounded window (not persisted: a restart ends it)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or Clock()
        self._hold: Hold | None = None
        self._on_expiry: list[Callable[[], None]] = []

    def on_expiry(self, then: Callable[[], None]) -> None:
        """`then()` when a hold runs out: what a release does by hand (a reconcile)."""
        self._on_expiry.append(then)

    def set(self, seconds: float, reason: str) -> Hold:
        if not 0 < seconds <= MAX_HOLD:
            raise ValueError(f"a hold lasts more than 0 s and at most 24h, not {seconds:g} s")
        now = self._clock.now().timestamp()
        self._hold = Hold(now + seconds, reason, now)
        log.warning("reconcile held until %s by an operator: %s", _iso(self._hold.until), reason or "(no reason)")
        return self._hold

    def release(self) -> Hold | None:
        old, self._hold = self.current(), None
        if old is not None:
            log.info("reconcile hold released")
        return old

    def current(self) -> Hold | None:
        if self._hold is not None and self._clock.now().timestamp() >= self._hold.until:
            log.info("reconcile hold expired")
            self._hold = None
            for then in self._on_expiry:
                then()
        return self._hold


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
