"""Injectable time, so backoff, staleness windows and intervals are tested without sleeping.

Production code takes a `Clock` and calls `now()` (wall time, for timestamps and signature windows),
`monotonic()` (for intervals) and `await sleep(seconds)`. Tests pass a `FakeClock` and advance it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from datetime import UTC, datetime, timedelta


class Clock:
    """The real clock."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock(Clock):
    """A clock that only moves when told to. `sleep()` waits until `advance()` passes its deadline."""

    def __init__(self, start: datetime | None = None) -> None:
        self._wall = start or datetime(2025, 1, 15, 10, 30, tzinfo=UTC)
        self._mono = 1000.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self.sleeps: list[float] = []  # every requested sleep, in order, for assertions

    def now(self) -> datetime:
        return self._wall

    def monotonic(self) -> float:
        return self._mono

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._mono + max(0.0, seconds), next(self._seq), fut))
        await fut

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self._mono += seconds
        self._wall += timedelta(seconds=seconds)
        while self._sleepers and self._sleepers[0][0] <= self._mono:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    def step_wall(self, seconds: float) -> None:
        """Step the wall clock alone, as NTP or `date -s` does: monotonic time and the sleepers do not move."""
        self._wall += timedelta(seconds=seconds)

    @property
    def pending_sleepers(self) -> int:
        return sum(1 for _, _, f in self._sleepers if not f.done())


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for `event`, at most `timeout` seconds; True when it was set. Unlike `asyncio.wait_for` on Python 3.11,
    a cancellation that arrives as the event is set is never swallowed (a service being stopped stays stopped)."""
    try:
        async with asyncio.timeout(max(0.0, timeout)):
            await event.wait()
    except TimeoutError:
        return False
    return True
