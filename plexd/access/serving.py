"""A TCP listener's accept loop and its live connections, stopped together (TCP sessions, a bridge's ingress)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

log = logging.getLogger(__name__)


async def stop_serving(accepting: asyncio.Task[None] | None, listener: socket.socket | None,
                       connections: Collection[asyncio.Task[None]]) -> None:
    """No new connection is accepted, the listening socket is closed, and every connection's task is cancelled
    and awaited (each closes its own sockets)."""
    if accepting is not None:
        accepting.cancel()
        await asyncio.gather(accepting, return_exceptions=True)
    if listener is not None:
        listener.close()
    live = list(connections)
    for task in live:
        task.cancel()
    await asyncio.gather(*live, return_exceptions=True)


ACCEPT_BACKOFF = 0.5  # after a failed accept (out of descriptors): the pause before the next try


async def accept_forever(listener: socket.socket, name: str) -> AsyncIterator[tuple[socket.socket, Any]]:
    """Each connection `listener` accepts, until cancelled. A failed accept (EMFILE, ENFILE, ENOBUFS: the
    daemon is out of descriptors or memory for a moment) is logged once per streak and retried after a pause,
    as asyncio's own servers do: a listener that stopped accepting would stay listed by the kernel and look
    alive to every check while clients hang."""
    loop = asyncio.get_running_loop()
    failing = False
    while True:
        try:
            client, address = await loop.sock_accept(listener)
        except OSError as exc:
            if not failing:
                log.warning("%s: cannot accept a connection (%s); retrying every %.1f s", name,
                            exc.strerror or exc, ACCEPT_BACKOFF)
            failing = True
            await asyncio.sleep(ACCEPT_BACKOFF)
            continue
        if failing:
            log.info("%s: accepting again", name)
            failing = False
        yield client, address


@contextlib.asynccontextmanager
async def idle_timeout(limit: float) -> AsyncIterator[Callable[[], None]]:
    """Like `asyncio.timeout`, but the deadline is `limit` seconds after the last call of the yielded `touch`
    (TimeoutError once it passes). A touch is one clock read, cheap enough for every chunk spliced: the timer is
    re-armed only when it finds it fired early."""
    loop = asyncio.get_running_loop()
    last = loop.time()

    def touch() -> None:
        nonlocal last
        last = loop.time()

    async with asyncio.timeout(None) as deadline:
        def check() -> None:
            nonlocal timer
            if last + limit > loop.time():
                timer = loop.call_at(last + limit, check)
            else:
                deadline.reschedule(loop.time())  # asyncio.timeout does the cancelling (and tells it from others)

        timer = loop.call_at(last + limit, check)
        try:
            yield touch
        finally:
            timer.cancel()
