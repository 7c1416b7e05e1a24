"""Session activity (docs/protocol.md §A1.4) handed to whoever reports it upstream: one way for every
kind of session, so that a report that cannot be queued is logged and never takes a session down."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

Report = Callable[[str, dict[str, Any]], Awaitable[None] | None]
RecordCommand = Callable[[str, str], Awaitable[bool] | bool]  # an SSH exec runs only once this returned True
Audit = Callable[[str, dict[str, Any]], None]  # audit(event, fields), never the token


async def emit(report: Report | None, session_id: str, kind: str, body: dict[str, Any]) -> None:
    """`report(session_id, body)`, awaited when it is a coroutine; a failure is logged, never raised."""
    if report is None:
        return
    try:
        result = report(session_id, body)
        if asyncio.iscoroutine(result):
            await result
    except Exception:
        log.exception("%s session %s: reporting activity failed", kind, session_id)
