"""How long tests wait, in one place: every window a test waits for the machine (a handshake, a reconcile, a
daemon's start) is multiplied by LOAD_FACTOR, so a loaded or slow machine gets longer windows everywhere at once
(`PLEXD_TEST_LOAD_FACTOR=2 make test` under stress) instead of each test growing its own timeouts. Waits are on
observable conditions; the factor only says how long to keep looking before giving up with the evidence."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator

try:
    LOAD_FACTOR = max(1.0, float(os.environ.get("PLEXD_TEST_LOAD_FACTOR", "1")))
except ValueError:
    LOAD_FACTOR = 1.0


def scaled(seconds: float) -> float:
    """`seconds` stretched by the load factor."""
    return seconds * LOAD_FACTOR


# How often a wait for the machine looks again. Each look spawns a tool (`wg show`, `ip`) in a lab node: on the
# kernel tier's emulated CPU a spawn costs ~0.2 s of CPU, so looking every 0.1 s there starved the daemons under
# test. Stretched by the load factor too.
POLL = 0.1 * LOAD_FACTOR
POLL_MAX = 4 * POLL


def pauses() -> Iterator[float]:
    """The pauses between a wait's looks: POLL at first, a quarter longer after each look, up to POLL_MAX. A short
    wait still looks often; a long one (a daemon's start on the kernel tier's emulated CPU, where each look's spawn
    costs what the daemons need) spawns a third as often."""
    pause = POLL
    while True:
        yield pause
        pause = min(pause * 1.25, POLL_MAX)


async def wait_for(pred: Callable[[], object], timeout: float = 15.0, what: str = "condition", *,
                   interval: float = 0.02) -> None:
    """Poll `pred()` until true; fail naming `what` after `timeout` seconds (stretched by the load factor)."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit:.0f}s waiting for {what}")
        await asyncio.sleep(interval)
