"""Changes in one directory, from watchfiles: its `RustNotify` (the notify crate's inotify watch, which gathers
what happens in a thread of its own), waited on in one thread here and handed to the event loop.

    with DirectoryWatch("/etc/plexd/hooks.d") as watch:
        while True:
            changed = await watch.next_change(timeout=300)   # False: nothing within the timeout

The watch covers the directory's entries (created, written, renamed in or out, deleted, chmod-ed), not
subdirectories, and the directory itself being deleted or moved away (`gone`: the watch is dead, make a new one).
An unmount says nothing (notify drops it): the caller's periodic look at the directory's identity catches it.

Why `RustNotify` rather than `awatch`: awatch creates its watch inside the generator, so a missing directory is
only said at the first wait and a change made before that wait is never seen; here the watch exists when the
constructor returns, so the caller can watch first and scan after without a gap. It is the object awatch drives,
with the same `watch(debounce, step, timeout, stop_event)` (in watchfiles' API reference), without anyio's
worker threads, and the timeout is ours (`next_change`) instead of a return to Python every `rust_timeout`.

What it costs while idle: notify's thread waits in epoll; the waiting thread wakes every STEP to take the GIL and
look at its stop event and at what notify gathered (70-100 µs a wake), and never returns to Python while nothing
happens. Measured, an asyncio process that only watches an idle directory for 120 s (CPU-s a minute, resident MiB):
no watch 0.00016 and 20.9; the inotify-on-the-loop watch this replaced 0.00014 and 21.5; this one at a 1 s step
0.0045, 2 s 0.0023, 5 s 0.0012 (chosen), 10 s 0.00065, all 23.0 (`awatch` at 1 s: 0.0044 and 24.9). An idle daemon
at 1,000 peers spent 0.145 with the inotify watch: a 5 s step adds under 1 % to it.
What the step costs in latency: changes are handed over at the first step that finds nothing new since the one
before, so one to two steps (5-10 s) after them (`plexd hooks reload` looks at once); a burst still growing after
`debounce` is handed over at the next step and the rest comes as another change. `close` ends the inotify watch
at once and the waiting thread at its next step. That thread is a daemon: an exiting process never waits for it,
closed or not (the PyO3 that watchfiles 1.3 is built with parks a thread that wakes while the interpreter is
finalized, rather than ending it under Rust's frames).
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import threading

from watchfiles import Change
from watchfiles._rust_notify import RustNotify

STEP = 5.0  # seconds between the waiting thread's looks: see above
DEBOUNCE = 10.0  # a burst is handed over this long after it began at the latest (at the next step)
POLL_DELAY = 2.0  # a kernel without inotify (ENOSYS): notify looks at the directory this often instead


class DirectoryWatch:
    def __init__(self, directory: str, *, debounce: float = DEBOUNCE, step: float | None = None) -> None:
        """Raises OSError when the directory cannot be watched (missing, not a directory, no inotify left)."""
        self.directory = os.path.abspath(directory)  # how notify names the directory itself in its changes
        self.debounce = debounce
        self.step = STEP if step is None else step
        try:
            if not stat.S_ISDIR(os.stat(directory).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            self._notify = RustNotify([self.directory], False, False, int(POLL_DELAY * 1000), False, False)
        except (OSError, RuntimeError) as exc:  # RuntimeError: watchfiles' own, e.g. no inotify instance left
            why = f"cannot watch {directory}: {getattr(exc, 'strerror', None) or exc}{_hint(str(exc))}"
            raise (OSError(exc.errno, why) if getattr(exc, "errno", None) else OSError(why)) from exc
        self._stop = threading.Event()  # looked at by the waiting thread at each step
        self._ready = asyncio.Event()
        self._thread: threading.Thread | None = None
        # The directory itself was deleted or moved away: this watch sees nothing any more, even if a directory of
        # the same name (on ext4 often with the same inode) comes back. Watch again.
        self.gone = False

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._notify.close()  # twice is harmless

    async def next_change(self, timeout: float | None = None) -> bool:
        """Wait for the next change (True), or `timeout` seconds without one (False)."""
        if self._thread is None:  # what came before this was gathered by notify meanwhile
            self._thread = threading.Thread(target=self._wait, args=(asyncio.get_running_loop(),),
                                            name=f"watch {self.directory}", daemon=True)
            self._thread.start()
        try:
            async with asyncio.timeout(timeout):
                await self._ready.wait()
        except TimeoutError:
            return False
        self._ready.clear()
        return True

    def _wait(self, loop: asyncio.AbstractEventLoop) -> None:
        """The waiting thread: each batch of changes to the loop, until closed (or notify fails: None)."""
        while not self._stop.is_set():
            try:
                changes = self._notify.watch(int(self.debounce * 1000), int(self.step * 1000), 0, self._stop)
            except RuntimeError:  # notify failed, or was closed under the wait
                changes = None
            if isinstance(changes, str) or self._stop.is_set():  # 'stop' (no timeout asked; signals go to main)
                return
            try:
                loop.call_soon_threadsafe(self._took, changes)
            except RuntimeError:  # the loop is closed
                return
            if changes is None:
                return

    def _took(self, changes: set[tuple[int, str]] | None) -> None:
        if changes is None or any(path == self.directory and kind != Change.modified for kind, path in changes):
            self.gone = True
        self._ready.set()


def _hint(error: str) -> str:
    if "MaxFilesWatch" in error:
        return " (raise fs.inotify.max_user_watches)"
    if "os error 24" in error:
        return " (raise fs.inotify.max_user_instances)"
    return ""
