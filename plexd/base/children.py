"""How asyncio hears that a child process exited: from a pidfd on the loop that started it, not from a thread.

Python 3.11's default (ThreadedChildWatcher) starts a thread for every child and keeps it while the child
lives: one per live SSH session, hook or action. A pidfd (Linux 5.3) makes the exit an event on the loop
instead. Python 3.12 does this itself when the kernel has pidfds; 3.11's own PidfdChildWatcher serves only the
main thread's loop, so this one reads each pidfd on the loop running where the child was started.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)


class RunningLoopPidfdWatcher(asyncio.AbstractChildWatcher):
    """Each child's pidfd is read by the running loop that asked. A child may be held (`children_held`): once it
    exits it stays a zombie, unreaped, until released; its pid, and so its process group's id, cannot be given out
    again meanwhile (the SSH server signals a command's group until the session is done with it)."""

    def __init__(self) -> None:
        self._held: dict[int, Callable[[], None] | None] = {}  # pid -> its reaping, once it has exited

    def add_child_handler(self, pid: int, callback: Callable[..., Any], *args: Any) -> None:
        if _HOLD_NEXT.get():  # before the pidfd is read: a child that exits at once is held all the same
            self.hold(pid)
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone and reaped already (SIGCHLD ignored by someone): its status is lost
            log.warning("child %d was reaped elsewhere: its exit status is unknown", pid)
            loop.call_soon(callback, pid, 255, *args)
            return
        except OSError:  # out of descriptors: the child runs already and must still be waited for, in a thread
            self._held.pop(pid, None)  # (a thread's wait cannot be held back)
            threading.Thread(target=self._wait_in_thread, args=(loop, pid, callback, args), daemon=True,
                             name=f"waitpid-{pid}").start()
            return
        loop.add_reader(pidfd, self._exited, loop, pid, pidfd, callback, args)

    def hold(self, pid: int) -> None:
        self._held.setdefault(pid, None)

    def release(self, pid: int) -> None:
        reap = self._held.pop(pid, None)
        if reap is not None:
            reap()

    def _exited(self, loop: asyncio.AbstractEventLoop, pid: int, pidfd: int, callback: Callable[..., Any],
                args: tuple[Any, ...]) -> None:
        loop.remove_reader(pidfd)
        transport = args[0] if args else None
        if getattr(transport, "is_closing", lambda: False)():
            # asyncio is cleaning up a spawn that failed or was cancelled: it waits for this exit, and nobody
            # holds the process to release it.
            self._held.pop(pid, None)
        if pid in self._held:  # left a zombie until released
            self._held[pid] = lambda: self._reap(loop, pid, pidfd, callback, args)
            return
        self._reap(loop, pid, pidfd, callback, args)

    @staticmethod
    def _wait_in_thread(loop: asyncio.AbstractEventLoop, pid: int, callback: Callable[..., Any],
                        args: tuple[Any, ...]) -> None:
        loop.call_soon_threadsafe(callback, pid, _wait_for(pid), *args)

    @staticmethod
    def _reap(loop: asyncio.AbstractEventLoop, pid: int, pidfd: int, callback: Callable[..., Any],
              args: tuple[Any, ...]) -> None:
        try:
            returncode = _wait_for(pid)  # the pidfd is readable: the child has exited, this does not block
        finally:
            os.close(pidfd)
        callback(pid, returncode, *args)

    def remove_child_handler(self, pid: int) -> bool:
        return True  # the pidfd's reader goes when the child exits; asyncio asks only after that

    def attach_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        pass  # no loop of its own: each child's is the one running when it was started

    def is_active(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def __enter__(self) -> RunningLoopPidfdWatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def _wait_for(pid: int) -> int:
    """Reap `pid` and return its exit code as asyncio reports it; 255 when someone else reaped it."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        log.warning("child %d was reaped elsewhere: its exit status is unknown", pid)
        return 255
    return os.waitstatus_to_exitcode(status)


def signal_child(proc: asyncio.subprocess.Process, sig: int) -> None:
    """Send `sig` to an asyncio child unless it is known to have exited; quiet if it is gone.

    Not `proc.send_signal()`/`kill()`: they poll() the child first, which reaps one that exited but whose pidfd
    the loop has not read yet, and the watcher then sees no status (the exit would read 255). A child that
    exited but was not reaped is a zombie whose pid cannot be reused, so `os.kill` on it is safe."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


_HOLD_NEXT: contextvars.ContextVar[bool] = contextvars.ContextVar("plexd_hold_next_child", default=False)


@contextlib.contextmanager
def children_held() -> Iterator[None]:
    """Children started in this block (in this task) are held from their start: once exited they stay zombies,
    unreaped, until `release_reaping` (one that exits before its starter runs again included). Where the child
    watcher is not plexd's (Python 3.12+, no pidfds) they are reaped as usual."""
    token = _HOLD_NEXT.set(True)
    try:
        yield
    finally:
        _HOLD_NEXT.reset(token)


def release_reaping(pid: int) -> None:
    """Reap the child `pid` now if it exited while held (its exit status then reaches asyncio); idempotent."""
    watcher = _watcher()
    if watcher is not None:
        watcher.release(pid)


def _watcher() -> RunningLoopPidfdWatcher | None:
    if sys.version_info >= (3, 12):
        return None
    try:
        watcher = asyncio.get_child_watcher()
    except (RuntimeError, NotImplementedError):
        return None
    return watcher if isinstance(watcher, RunningLoopPidfdWatcher) else None


def watch_children_with_pidfds() -> bool:
    """Use pidfds for asyncio's child processes, in this process. False (Python's default kept) on Python
    3.12+, which chooses pidfds itself, or when the kernel cannot open one."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an older kernel, or a seccomp filter that refuses the call
        return False
    asyncio.set_child_watcher(RunningLoopPidfdWatcher())
    return True
