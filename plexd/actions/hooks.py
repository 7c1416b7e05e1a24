"""The hook set: scanned at start, watched with watchfiles (`plexd.base.dirwatch`, batched), re-scanned in full every
``hooks.reverify`` as well (inotify misses changes on some filesystems), and re-announced to the control plane
with ``PUT /capabilities`` whenever the set, a checksum, a sidecar or a refusal changes.

What was last announced (per hook: its checksum) is kept in the action journal, so that a request can be checked
against it after a restart too (`announced_checksum`). An announcement that fails is retried with jittered
backoff until it goes through; a newer scan supersedes an older one still waiting.

The directory may be missing, appear later, be replaced or disappear: while it is missing there are no hooks,
and its parent is polled every `POLL` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from plexd.actions.journal import ActionJournal, JournalError
from plexd.base.backoff import Backoff
from plexd.base.clock import wait_event
from plexd.base.dirwatch import DirectoryWatch
from plexd.base.errors import PlexdError
from plexd.controlplane.client_errors import ControlPlaneError
from plexd.trust.integrity import Hook, HookScan, scan_hooks

log = logging.getLogger(__name__)

POLL = 2.0

Publish = Callable[[HookScan], Awaitable[None]]  # PUT /capabilities with this scan; raises on failure


class HookSet:
    def __init__(self, directory: str, journal: ActionJournal, scan: HookScan, publish: Publish, *,
                 reverify: float = 300.0, backoff: Backoff | None = None) -> None:
        self.directory = directory
        self.journal = journal
        self.current = scan
        self._publish = publish
        self.reverify = reverify
        self.backoff = backoff or Backoff()
        self._announced = journal.announced()
        self._to_announce: HookScan | None = None
        self._announce_wake = asyncio.Event()
        self._scanning = asyncio.Lock()
        self.scans = 0
        self.announcements = 0
        self.last_announce_error = ""
        self._unwatchable = ""  # why the directory could not be watched, once said
        self._polled: tuple[tuple[Any, ...], ...] | None = None  # the listing last looked at without inotify
        self._polled_at = float("-inf")

    # -- what requests are checked against ----------------------------------------------------------------------

    def find(self, name: str) -> Hook | None:
        return self.current.find(name)

    def announced_checksum(self, name: str) -> str | None:
        """The checksum the control plane was last told for hook `name`: '' when it was not in the last
        announcement, None when nothing was ever announced (a data_dir from before the journal)."""
        return None if self._announced is None else self._announced.get(name, "")

    def checksum_problem(self, name: str, actual: str, expected: str, differs: str) -> tuple[str, str]:
        """Why hook `name`, whose file hashes to `actual` now, may not run: `differs` when that is not `expected`,
        else when it is not what was last announced. Returns (problem, the checksum it should have been), or
        ('', expected) when it may run."""
        if actual != expected:
            return differs, expected
        announced = self.announced_checksum(name)
        if announced is not None and actual != announced:
            if not announced:
                return "was never announced to the control plane", expected
            return "differs from the checksum last announced", announced
        return "", expected

    def mark_announced(self, scan: HookScan) -> None:
        """`scan` reached the control plane (a registration or a capabilities PUT)."""
        announced = {h.name: h.checksum for h in scan.hooks}
        try:
            self.journal.set_announced(announced)
        except JournalError as exc:
            log.error("%s", exc)
        self._announced = announced

    # -- scanning -----------------------------------------------------------------------------------------------

    async def rescan(self, why: str) -> list[str]:
        """Scan again; log and announce what changed. Returns the changes, one line each."""
        async with self._scanning:  # one at a time: an older scan must never land after a newer one
            return await self._rescan(why)

    async def _rescan(self, why: str) -> list[str]:
        scan = await asyncio.to_thread(scan_hooks, self.directory)
        self.scans += 1
        changes = describe_changes(self.current, scan)
        old, self.current = self.current, scan
        if changes:
            log.info("hooks changed (%s): %s", why, "; ".join(changes), extra={"component": "hooks"})
        if [h.to_wire() for h in old.hooks] != [h.to_wire() for h in scan.hooks] or self._stale(scan):
            self.request_announce(scan)
        return changes

    def _stale(self, scan: HookScan) -> bool:
        """The control plane's view differs from this scan (e.g. a change while plexd was stopped)."""
        return self._announced is not None and self._announced != {h.name: h.checksum for h in scan.hooks}

    def request_announce(self, scan: HookScan) -> None:
        self._to_announce = scan
        self._announce_wake.set()

    # -- services -----------------------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Watch the directory until cancelled (the ``hooks`` service)."""
        while True:
            try:
                identity = _identity(os.stat(self.directory))
            except OSError:
                await self._wait_for_directory()
                continue
            try:
                watch = DirectoryWatch(self.directory)
            except OSError as exc:  # no inotify instance or watch left: look at the listing on a timer instead
                if str(exc) != self._unwatchable:
                    log.warning("hooks directory %s cannot be watched (%s): looking at it every %.0f s instead",
                                self.directory, exc, POLL, extra={"component": "hooks"})
                    self._unwatchable = str(exc)
                await self._poll_once()
                continue
            with watch:  # watching before the scan: a change made while it runs is seen after it
                await self.rescan("watch started")
                await self._watch_until_replaced(watch, identity)

    async def _poll_once(self) -> None:
        """Without inotify: the directory's listing (names, inodes, sizes, times, modes) every POLL seconds, and a
        full re-scan (hashes, checks, their log lines) only when it changed, or every `reverify`."""
        listing = _listing(self.directory)
        now = time.monotonic()
        if listing != self._polled or now - self._polled_at >= self.reverify:
            self._polled, self._polled_at = listing, now
            await self.rescan("polled")
        await asyncio.sleep(POLL)

    async def _watch_until_replaced(self, watch: DirectoryWatch, identity: tuple[int, int]) -> None:
        while True:
            changed = await watch.next_change(timeout=self.reverify)
            try:
                # gone: deleted or moved, even if a new one took its place with the same inode (ext4 reuses them)
                replaced = watch.gone or _identity(os.stat(self.directory)) != identity
            except OSError:
                replaced = True
            await self.rescan("files changed" if changed else "periodic re-verify")
            if replaced:  # this watch no longer sees the directory
                if not os.path.isdir(self.directory):
                    log.warning("hooks directory %s disappeared: no hooks until it comes back", self.directory,
                                extra={"component": "hooks"})
                return

    async def _wait_for_directory(self) -> None:
        if self.current.hooks or self.current.refused:
            await self.rescan("directory missing")
        while not os.path.isdir(self.directory):
            await asyncio.sleep(POLL)
        log.info("hooks directory %s appeared", self.directory, extra={"component": "hooks"})

    async def announce(self) -> None:
        """Deliver the newest scan waiting to be announced, retrying until it is (the ``capabilities`` service)."""
        while True:
            await self._announce_wake.wait()
            self._announce_wake.clear()
            scan = self._to_announce
            if scan is None:
                continue
            delay = await self._announce_once(scan)
            if delay is None:
                continue
            if not await wait_event(self._announce_wake, delay):  # a newer scan, or the backoff, whichever first
                self._announce_wake.set()

    async def _announce_once(self, scan: HookScan) -> float | None:
        """PUT `scan`; None when it went through, else how long to wait before the next try."""
        try:
            await self._publish(scan)
        except ControlPlaneError as exc:
            self.last_announce_error = str(exc)
            delay = self.backoff.next_delay()
            log.warning("capabilities announcement failed: %s; retrying in %.1fs", exc, delay)
            return delay
        except PlexdError as exc:  # re-registration impossible (no token): keep running, say why, retry later
            self.last_announce_error = str(exc)
            log.error("%s", exc)
            return self.backoff.cap
        if self._to_announce is scan:
            self._to_announce = None
        self.mark_announced(scan)
        self.announcements += 1
        self.last_announce_error = ""
        self.backoff.reset()
        log.info("capabilities announced", extra={"hooks": len(scan.hooks)})
        return None

    def status(self) -> dict[str, Any]:
        return {"directory": self.directory, "hooks": len(self.current.hooks), "refused": len(self.current.refused),
                "scans": self.scans, "announcements": self.announcements,
                "announce_pending": self._to_announce is not None, "last_announce_error": self.last_announce_error}


def describe_changes(old: HookScan, new: HookScan) -> list[str]:
    before = {h.name: h for h in old.hooks}
    after = {h.name: h for h in new.hooks}
    lines = [f"{name} added" for name in sorted(after.keys() - before.keys())]
    lines += [f"{name} removed" for name in sorted(before.keys() - after.keys())]
    for name in sorted(before.keys() & after.keys()):
        if before[name].checksum != after[name].checksum:
            lines.append(f"{name} changed (sha256 {before[name].checksum[:12]}… → {after[name].checksum[:12]}…)")
        elif before[name].to_wire() != after[name].to_wire():
            lines.append(f"{name}: sidecar changed")
    refused_before = {r.name: r.reason for r in old.refused}
    lines += [f"{r.name} refused: {r.reason}" for r in new.refused if refused_before.get(r.name) != r.reason]
    return lines


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _listing(directory: str) -> tuple[tuple[Any, ...], ...] | None:
    """What the directory holds, cheaply: per entry its name and (following a symlink, as a hook may be one) its
    inode, size, modification time, mode and owner. None when it cannot be read."""
    try:
        with os.scandir(directory) as entries:
            out = []
            for entry in entries:
                try:
                    st = entry.stat()
                    out.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid))
                except OSError:
                    out.append((entry.name,))
            return tuple(sorted(out))
    except OSError:
        return None
