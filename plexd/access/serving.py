"""A TCP listener's accept loop and its live connections, stopped together (TCP sessions, a bridge's ingress)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Collection


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
