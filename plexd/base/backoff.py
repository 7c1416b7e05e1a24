"""Exponential backoff with uniform ±jitter (1 s x2 → 60 s, ±25 % by default), shared by every retry loop."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    def __init__(
        self,
        base: float = 1.0,
        cap: float = 60.0,
        factor: float = 2.0,
        jitter: float = 0.25,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not (0 < base <= cap) or factor < 1 or not (0 <= jitter < 1):
            raise ValueError("backoff needs 0 < base <= cap, factor >= 1, 0 <= jitter < 1")
        self.base, self.cap, self.factor, self.jitter = base, cap, factor, jitter
        self._rand = rand
        self._current = base

    @property
    def current(self) -> float:
        """The un-jittered delay the next `next_delay()` is based on."""
        return self._current

    def jittered(self, delay: float) -> float:
        """`delay` with this backoff's uniform ±jitter applied."""
        return delay * (1 + self.jitter * (2 * self._rand() - 1))

    def after_hint(self, hint: float | None) -> float:
        """The wait before retrying what a server turned away (429, 503): without a Retry-After, the next jittered,
        growing delay; with one, never earlier than it says (nor than that delay) but spread over half as long
        again, so the clients it turned away in one second do not all come back in one second (the Go agent
        waits exactly the hint, or the un-jittered current delay without growing it: a fleet in lock-step)."""
        delay = self.next_delay()
        if hint is None:
            return delay
        return max(hint, delay) * (1 + 0.5 * self._rand())  # the hint is a floor: a "1" forever still backs off

    def next_delay(self) -> float:
        """Return the jittered delay for this attempt and grow the base for the next one."""
        delay = self.jittered(self._current)
        self._current = min(self._current * self.factor, self.cap)
        return delay

    def reset(self) -> None:
        self._current = self.base
