"""One node's open event stream, for either dialect: the replayed backlog, then live events, keepalive comments,
and the stream faults (`silent`, `close_after_events`). The dialect only decides how an event is framed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from plexd.devplane.events import StreamEvent


class _Stream:
    """The SSE response plus the subscriber's cleanup, which must run however the response ends."""

    def __init__(self, response: Response, cleanup: Any) -> None:
        self.response = response
        self.cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.cleanup()


def event_stream(dep: Any, node_id: str, after: int | None, backlog: Callable[[], list[StreamEvent]], *,
                 keepalive: float, render: Callable[[StreamEvent], bytes], keepalive_comment: str,
                 headers: dict[str, str]) -> Response:
    """The stream of `node_id`: `backlog()` first, then what is published to it (events at or before `after`, the
    client's cursor, are not sent again). Subscribed before the backlog is read, so nothing falls in between."""
    sub = dep.hub.subscribe(node_id)
    replay = backlog()
    current = dep.hub.seq
    faults = dict(dep.faults)
    close_after = int(faults.get("close_after_events") or 0)
    silent = bool(faults.get("silent"))

    async def stream() -> AsyncIterator[bytes]:
        if silent:  # accept, then say nothing at all (for the agent's idle watchdog)
            await asyncio.Event().wait()
        sent = 0
        last_seq = min(after or 0, current)  # a cursor from the future (e.g. an older db) must not hide new events
        for event in replay:
            last_seq = event.seq
            yield render(event)
            sent += 1
            if close_after and sent >= close_after:
                return
        while True:
            event = await sub.queue.get()
            if event is None:
                return
            if event.seq <= last_seq:
                continue
            last_seq = event.seq
            yield render(event)
            sent += 1
            if close_after and sent >= close_after:
                return

    response = EventSourceResponse(
        stream(),
        ping=0 if silent else keepalive,
        sep="\n",
        ping_message_factory=lambda: ServerSentEvent(comment=keepalive_comment, sep="\n"),
        headers=headers,
    )
    return _Stream(response, lambda: dep.hub.unsubscribe(sub))  # type: ignore[return-value]
