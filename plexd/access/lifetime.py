"""When a session ends by itself: at `expires_at` (`ttl_expired`) or after `idle_timeout` without a byte either way
(`idle_timeout`). One watcher for every kind of session."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from plexd.state.sessions_block import Session


async def watch_lifetime(session: Session, *, now: Callable[[], float], last_activity: Callable[[], float],
                         closed: Callable[[], bool], close: Callable[[str], Awaitable[None]]) -> None:
    """Call `close(reason)` once the session has expired or been idle too long; return when it is closed."""
    idle = session.idle_timeout
    while not closed():
        t = now()
        if session.expired(t):
            await close("ttl_expired")
            return
        if idle and t - last_activity() >= idle:
            await close("idle_timeout")
            return
        await asyncio.sleep(min(1.0, max(0.05, session.expires_at - t), idle / 4 if idle else 1.0))
