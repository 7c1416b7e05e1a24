"""Converge requests that coalesce: events ask for an apply without waiting for it.

While an apply runs, any number of further requests lead to exactly one more, which applies them all in one
transaction: a burst of events costs a few applies, not one each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from plexd.converge.engine import ConvergeResult

log = logging.getLogger(__name__)

SHOWN_REASONS = 3  # the log names the first few requests of a burst and counts the rest


class Requests:
    """Made before what asks and what serves (the NAT service asks, the gate serves)."""

    def __init__(self) -> None:
        self._wanted = asyncio.Event()
        self._reasons: list[str] = []
        self._count = 0

    @property
    def pending(self) -> int:
        """Requests not served yet (they will be, by one apply)."""
        return self._count

    def request(self, reason: str) -> None:
        self._count += 1
        if len(self._reasons) < SHOWN_REASONS:
            self._reasons.append(reason)
        self._wanted.set()

    async def serve(self, apply: Callable[[], Awaitable[ConvergeResult]]) -> None:
        """The service that answers the requests with `apply` (supervised like every other); runs until cancelled."""
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            count, reasons = self._count, self._reasons
            self._count, self._reasons = 0, []
            why = ", ".join(reasons) + (f" and {count - len(reasons)} more event(s)" if count > len(reasons) else "")
            result = await apply()
            for err in result.errors:
                log.warning("converge after %s: %s", why, err)
