"""Copying one TCP connection into another without the bytes passing through Python: splice(2) through a pipe.

Each direction moves a chunk from the source socket into a pipe and from the pipe into the destination socket,
both in the kernel (`os.splice`, SPLICE_F_MOVE), driven by the event loop's readiness callbacks: a slow reader
stops the copy (the pipe holds at most one chunk), so memory stays bounded whatever the peers do. Where the
kernel refuses splice on these sockets (EINVAL), `relay()` falls back to a plain recv/send loop with large
buffers, the same bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
from collections.abc import Callable

CHUNK = 1 << 20  # 1 MiB: one pipe's worth at a time (the pipe is sized to it where pipe-max-size allows)
_BURST = 16  # chunks moved per wake-up before the loop serves others
_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_F_SETPIPE_SZ = 1031
_GONE = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ESHUTDOWN, errno.ETIMEDOUT, errno.EHOSTUNREACH)


class _Direction:
    """src → dst. `done` resolves with the byte count when src reached EOF (dst then gets a FIN) or either side
    failed (the caller then closes both).

    While dst takes what arrives, the reader stays registered and each wake-up moves several chunks (no epoll
    changes per chunk); when dst is full, reading stops until dst is writable again, so at most one pipe's worth
    waits in the kernel."""

    def __init__(self, loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket,
                 on_bytes: Callable[[int], None]) -> None:
        self.loop, self.src, self.dst, self.on_bytes = loop, src, dst, on_bytes
        self.total = 0
        self.pending = 0  # bytes in the pipe, not yet written to dst
        self.done: asyncio.Future[int] = loop.create_future()
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            import fcntl

            fcntl.fcntl(self.write_fd, _F_SETPIPE_SZ, CHUNK)
        self.eof = False

    def start(self) -> None:
        self.loop.add_reader(self.src.fileno(), self._readable)

    def _finish(self, error: BaseException | None = None) -> None:
        for remove, fd in ((self.loop.remove_reader, self.src), (self.loop.remove_writer, self.dst)):
            with contextlib.suppress(Exception):
                remove(fd.fileno())
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.read_fd = self.write_fd = -1
        if not self.done.done():
            if error is None:
                self.done.set_result(self.total)
            else:
                self.done.set_exception(error)

    def _readable(self) -> None:
        for _ in range(_BURST):  # bounded, so other connections get their turn
            try:
                n = os.splice(self.src.fileno(), self.write_fd, CHUNK, flags=_FLAGS)
            except BlockingIOError:
                return
            except OSError as exc:
                self._finish(exc)
                return
            if n == 0:
                self.eof = True
                self.loop.remove_reader(self.src.fileno())
                self._writable()
                return
            self.pending += n
            if not self._drain():
                self.loop.remove_reader(self.src.fileno())
                self.loop.add_writer(self.dst.fileno(), self._writable)
                return

    def _drain(self) -> bool:
        """Move the pipe into dst; False when dst is full (or failed) before the pipe emptied."""
        while self.pending:
            try:
                m = os.splice(self.read_fd, self.dst.fileno(), self.pending, flags=_FLAGS)
            except BlockingIOError:
                return False
            except OSError as exc:
                self._finish(exc)
                return False
            self.pending -= m
            self.total += m
            self.on_bytes(m)
        return True

    def _writable(self) -> None:
        if self.done.done():
            return
        if not self._drain():
            if not self.done.done():
                self.loop.add_writer(self.dst.fileno(), self._writable)
            return
        with contextlib.suppress(Exception):
            self.loop.remove_writer(self.dst.fileno())
        if self.eof:
            with contextlib.suppress(OSError):
                self.dst.shutdown(socket.SHUT_WR)
            self._finish()
        else:
            self.loop.add_reader(self.src.fileno(), self._readable)

    def cancel(self) -> None:
        self._finish()


async def _copy(loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket,
                on_bytes: Callable[[int], None]) -> int:
    """The fallback: recv/send with one bounded buffer."""
    total = 0
    while True:
        data = await loop.sock_recv(src, CHUNK)
        if not data:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            return total
        await loop.sock_sendall(dst, data)
        total += len(data)
        on_bytes(len(data))


def splice_works(a: socket.socket) -> bool:
    """Whether this kernel splices from this kind of socket (a zero-length splice answers without moving data)."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.splice(a.fileno(), w, 0, flags=_FLAGS)
        return True
    except BlockingIOError:
        return True
    except OSError as exc:
        return exc.errno not in (errno.EINVAL, errno.ENOSYS)
    finally:
        os.close(r)
        os.close(w)


async def relay(a: socket.socket, b: socket.socket, *, a_to_b: Callable[[int], None],
                b_to_a: Callable[[int], None]) -> tuple[int, int]:
    """Copy both ways until both directions ended (a FIN each way) or one side failed; returns (bytes a→b,
    bytes b→a). The sockets must be non-blocking; the caller closes them. Cancelling stops both directions."""
    loop = asyncio.get_running_loop()
    if hasattr(os, "splice") and splice_works(a) and splice_works(b):
        ab, ba = _Direction(loop, a, b, a_to_b), _Direction(loop, b, a, b_to_a)
        ab.start()
        ba.start()
        try:
            await _until_both_or_a_failure([ab.done, ba.done])
        finally:
            ab.cancel()
            ba.cancel()
            for f in (ab.done, ba.done):  # both may have failed: retrieve both, the caller learns nothing more
                if f.done() and not f.cancelled():
                    f.exception()
        return ab.total, ba.total
    counts = [0, 0]

    def counted(i: int, note: Callable[[int], None]) -> Callable[[int], None]:
        def add(n: int) -> None:
            counts[i] += n
            note(n)
        return add

    tasks = [asyncio.ensure_future(_copy(loop, a, b, counted(0, a_to_b))),
             asyncio.ensure_future(_copy(loop, b, a, counted(1, b_to_a)))]
    try:
        await _until_both_or_a_failure(tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return counts[0], counts[1]


async def _until_both_or_a_failure(waits: list[asyncio.Future[int]]) -> None:
    """A FIN one way leaves the other way open (half-close, as TCP allows); a reset either way ends both."""
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
    for f in done:
        if not f.cancelled() and f.exception() is not None:
            return
    if pending:
        await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
