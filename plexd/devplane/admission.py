"""Load shedding for event-stream opens: a control plane that comes back after a restart or an outage is met by
its whole fleet at once. Opens are admitted at a steady rate (a token bucket sized to the fleet: 5 % of the
registered nodes per second, at least `min_rate`); the rest get `503` with a `Retry-After` drawn across the time
it will take to admit everyone waiting, so they come back spread out instead of in the same second again.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable


class StreamAdmission:
    def __init__(self, fleet_size: Callable[[], int], *, share_per_second: float = 0.05, min_rate: float = 20.0,
                 clock: Callable[[], float] = time.monotonic, rand: Callable[[], float] = random.random) -> None:
        self._fleet_size = fleet_size
        self._share = share_per_second
        self._min_rate = min_rate
        self._clock = clock
        self._rand = rand
        self._rate = min_rate
        self._tokens = self._burst()
        self._last = clock()
        self._rate_checked = -math.inf
        self._waiting = 0.0  # refusals, decaying by half each second: roughly the clients still to admit
        self.admitted = 0
        self.refused = 0

    def _burst(self) -> float:
        return max(1.0, self._rate / 2)

    def _refill(self, now: float) -> None:
        if now - self._rate_checked >= 5.0:  # the fleet changes slowly: look again every few seconds
            self._rate = max(self._min_rate, self._share * self._fleet_size())
            self._rate_checked = now
        elapsed = max(0.0, now - self._last)
        self._last = now
        self._tokens = min(self._burst(), self._tokens + elapsed * self._rate)
        self._waiting *= 0.5 ** elapsed

    def admit(self) -> int | None:
        """None: open the stream. Otherwise the Retry-After (whole seconds) to send with a 503."""
        now = self._clock()
        self._refill(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self.admitted += 1
            return None
        self.refused += 1
        self._waiting += 1.0
        window = max(2.0, 2 * self._waiting / self._rate)  # the time it takes to admit those waiting, and more
        return max(1, math.ceil(self._rand() * window))
