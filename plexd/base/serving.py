"""A TCP listener's socket, its accept loop and its live connections, stopped together (the access sessions, a
bridge's ingress)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import socket
import struct
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


SO_ATTACH_FILTER = 26
_SKF_AD_IFINDEX = -0x1000 + 8  # classic BPF's ancillary load: the index of the interface the packet came in on
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_RET_K = 0x20, 0x15, 0x06
_BPF_INSN = struct.Struct("=HBBI")  # struct sock_filter: code, jt, jf, k


def mesh_listener(host: str, device: str | None, backlog: int = 64) -> tuple[socket.socket, int]:
    """A listening socket on `host`:0 (the kernel picks the port) that takes connections arriving on `device` only,
    and that device's index (0: not limited to one, the tests' listeners on loopback with `device` None).

    A session's listener binds the node's mesh IP, but Linux answers for a local address on any interface (the
    weak host model), and the firewall's rules all match the mesh interface: a LAN neighbour routing the mesh IP
    through this node, a container in the host's network namespace or a local user (whose connection comes in on
    `lo`) would reach the session around the policy. So the kernel itself filters, in every policy mode: a socket
    filter drops every packet that did not come in on the mesh interface, the SYN on the listener and the rest on
    each connection (which inherits the filter). Dropped, not reset: a mesh interface recreated later (a restarted
    wireguard-go) has another index, and its connections wait, retransmitting, until `only_from` moves the filter
    (the sessions domain does, keeping the port). Not SO_BINDTODEVICE: a socket bound to the old index would answer
    the new interface's packets with resets. OSError (nothing bound) when the filter cannot be attached: the
    session does not open rather than open unenforced."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    index = 0
    try:
        if device is not None:
            try:
                index = socket.if_nametoindex(device)
                only_from(sock, index)
            except OSError as exc:
                raise OSError(f"cannot limit the listener to the mesh interface {device} ({exc.strerror or exc}), "
                              "so it would answer on every interface") from None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock, index


def only_from(sock: Any, index: int) -> None:
    """Attach (or replace) a classic BPF filter that passes only packets that came in on interface `index`."""
    program = b"".join(_BPF_INSN.pack(*insn) for insn in (
        (_BPF_LD_W_ABS, 0, 0, _SKF_AD_IFINDEX & 0xFFFFFFFF),
        (_BPF_JEQ_K, 0, 1, index),
        (_BPF_RET_K, 0, 0, 0xFFFFFFFF),  # the whole packet
        (_BPF_RET_K, 0, 0, 0)))  # dropped
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("@HP", len(program) // _BPF_INSN.size, ctypes.addressof(buffer))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


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
