"""How often a source may fail to log in to the SSH sessions, in a module of its own so that the sessions domain
can hold the limiter without importing the SSH server (and asyncssh) before a session needs it."""

from __future__ import annotations

import time
from collections.abc import Callable

from plexd.base.ratelimit import RateLimiter


def auth_failure_limiter(clock: Callable[[], float] = time.monotonic) -> RateLimiter:
    """Failed logins per source address: 10 at once, then one every 6 s (shared by all sessions' servers)."""
    return RateLimiter(rate=1 / 6, burst=10, clock=clock)
