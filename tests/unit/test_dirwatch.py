"""The hooks directory's watch (plexd/base/dirwatch.py, over watchfiles) on a real directory: what it sees, that a
burst is one change, that a quiet directory times out, that it says clearly what it cannot watch, and, through the
hook set, that hooks added, changed, removed and in a replaced directory are seen by the watch (not by the periodic
re-scan, an hour away in those tests). The tests watch with a short step (the same code, looking more often), but
one, at the daemon's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import pytest
from waiting import scaled, wait_for

from plexd.actions.hooks import HookSet
from plexd.actions.journal import ActionJournal
from plexd.base import dirwatch
from plexd.base.dirwatch import DirectoryWatch
from plexd.trust.integrity import scan_hooks

DAEMON_STEP = dirwatch.STEP
STEP = 0.2
SEEN = scaled(4 * STEP + 3)  # the longest a test waits for a change to be seen: a change takes one to two steps


@pytest.fixture(autouse=True)
def short_step(monkeypatch):
    monkeypatch.setattr(dirwatch, "STEP", STEP)


def hook_set(hooks, tmp_path, reverify: float = 300.0) -> tuple[HookSet, list[list[str]]]:
    """A hook set over `hooks` and the list of what it announced (hook names, per announcement)."""
    published: list[list[str]] = []

    async def publish(scan):
        published.append(sorted(h.name for h in scan.hooks))

    return HookSet(str(hooks), ActionJournal(tmp_path / "uplink.db"), scan_hooks(hooks), publish,
                   reverify=reverify), published


@contextlib.asynccontextmanager
async def watching(hs: HookSet):
    tasks = [asyncio.create_task(hs.watch()), asyncio.create_task(hs.announce())]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def announced(published: list[list[str]], names: list[str], seconds: float) -> None:
    for _ in range(int(seconds / 0.05)):
        if published and published[-1] == names:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{names} not announced within {seconds} s: {published}")


def add_hook(hooks, name: str) -> None:
    (hooks / name).write_text("#!/bin/sh\necho hi\n")
    (hooks / name).chmod(0o755)


@pytest.mark.parametrize("change", ["create", "write", "chmod", "rename in", "rename out", "delete",
                                    "directory deleted", "directory moved away"])
async def test_each_kind_of_change_is_seen(tmp_path, change):
    watched = tmp_path / "d"
    watched.mkdir()
    (watched / "old").write_text("x")
    (tmp_path / "outside").write_text("y")
    with DirectoryWatch(str(watched)) as watch:
        assert await watch.next_change(timeout=0.2) is False  # quiet so far
        {"create": lambda: (watched / "new").write_text("n"),
         "write": lambda: (watched / "old").write_text("changed"),
         "chmod": lambda: (watched / "old").chmod(0o700),
         "rename in": lambda: (tmp_path / "outside").rename(watched / "moved"),
         "rename out": lambda: (watched / "old").rename(tmp_path / "away"),
         "delete": lambda: (watched / "old").unlink(),
         "directory deleted": lambda: ((watched / "old").unlink(), watched.rmdir()),
         "directory moved away": lambda: watched.rename(tmp_path / "elsewhere")}[change]()
        assert await watch.next_change(timeout=SEEN) is True
        if change.startswith("directory"):  # seen with the entry's removal, or a step later
            await wait_for(lambda: watch.gone, SEEN, "the directory gone")
        else:
            assert not watch.gone


async def test_at_the_daemons_step_a_change_is_seen(tmp_path, monkeypatch):
    monkeypatch.setattr(dirwatch, "STEP", DAEMON_STEP)
    with DirectoryWatch(str(tmp_path)) as watch:
        assert await watch.next_change(timeout=0.2) is False
        (tmp_path / "new").write_text("x")
        assert await watch.next_change(timeout=scaled(4 * DAEMON_STEP + 3)) is True and not watch.gone


async def test_a_burst_is_one_change_and_a_subdirectory_is_not_watched(tmp_path):
    (tmp_path / "sub").mkdir()
    # a short step, so that a short quiet wait covers several of its looks
    with DirectoryWatch(str(tmp_path), debounce=0.2, step=0.05) as watch:
        for i in range(50):
            (tmp_path / f"f{i}").write_text("x")
        assert await watch.next_change(timeout=SEEN) is True
        assert await watch.next_change(timeout=0.5) is False  # all 50 went into the one change
        (tmp_path / "sub" / "deep").write_text("x")
        assert await watch.next_change(timeout=0.5) is False
        (tmp_path / "sub").chmod(0o700)  # the subdirectory itself is an entry: that is a change
        assert await watch.next_change(timeout=SEEN) is True


async def test_a_missing_directory_is_named_and_a_closed_watch_frees_its_descriptors_and_threads(tmp_path):
    with pytest.raises(OSError, match=r"cannot watch .*absent: No such file or directory"):
        DirectoryWatch(str(tmp_path / "absent"))

    def new() -> tuple[set[str], set[str]]:
        """The descriptors and threads (notify's and the waiting one) this process has now and had not before."""
        return set(os.listdir("/proc/self/fd")) - fds, set(os.listdir("/proc/self/task")) - tasks

    fds, tasks = set(os.listdir("/proc/self/fd")), set(os.listdir("/proc/self/task"))
    watch = DirectoryWatch(str(tmp_path))
    await watch.next_change(timeout=0.01)
    assert all(new())
    watch.close()
    watch.close()  # twice is harmless
    # notify's thread ends at once, the waiting one at its next step
    await wait_for(lambda: not any(new()), SEEN, "the watch's descriptors and threads gone")


async def test_without_inotify_the_listing_is_polled_and_only_a_change_rescans(tmp_path, monkeypatch, caplog):
    def no_inotify(directory, **kw):
        raise OSError(38, f"cannot watch {directory}: inotify_init1: Function not implemented")

    monkeypatch.setattr("plexd.actions.hooks.DirectoryWatch", no_inotify)
    monkeypatch.setattr("plexd.actions.hooks.POLL", 0.05)
    hooks = tmp_path / "hooks"
    hooks.mkdir(mode=0o755)
    (hooks / "bad.sh").write_text("#!/bin/sh\n")
    (hooks / "bad.sh").chmod(0o777)  # refused, with a warning at each scan
    hs, published = hook_set(hooks, tmp_path)
    with caplog.at_level(logging.WARNING):
        async with watching(hs):
            await asyncio.sleep(1.0)  # ~20 polls of an unchanged directory
            quiet_scans = hs.scans
            add_hook(hooks, "a.sh")
            await announced(published, ["a.sh"], 5)
    assert quiet_scans == 1  # the first look only: an unchanged listing is not re-scanned
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "cannot be watched" in m]) == 1
    # once per scan that saw it: the test's own, the first look and the change (not at each of ~20 polls)
    assert len([m for m in said if "bad.sh" in m]) <= 3


async def test_a_directory_deleted_and_made_again_in_place_is_seen_as_gone(tmp_path):
    watched = tmp_path / "d"
    watched.mkdir()
    ino = watched.stat().st_ino
    with DirectoryWatch(str(watched)) as watch:
        watched.rmdir()
        watched.mkdir()  # ext4 often hands the same inode back: the inode alone cannot tell
        assert await watch.next_change(timeout=SEEN) is True and watch.gone
    with DirectoryWatch(str(watched)) as watch:
        (watched / "new").write_text("x")
        assert await watch.next_change(timeout=SEEN) is True and not watch.gone
    assert isinstance(ino, int)


async def test_a_file_is_not_a_directory_to_watch(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError, match="Not a directory"):
        DirectoryWatch(str(tmp_path / "f"))


async def test_hooks_in_a_directory_made_again_in_place_are_seen(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir(mode=0o755)
    hs, published = hook_set(hooks, tmp_path, reverify=3600)
    async with watching(hs):
        await wait_for(lambda: hs.scans >= 1, SEEN, "the first watch")
        hooks.rmdir()
        hooks.mkdir(mode=0o755)
        # the old watch reported the directory gone (a scan), a new one is on the new directory (a scan)
        await wait_for(lambda: hs.scans >= 3, SEEN, "the new directory watched")
        add_hook(hooks, "a.sh")
        await announced(published, ["a.sh"], SEEN)  # not at the re-verify, an hour away


async def test_hooks_added_changed_removed_and_in_a_replaced_directory_are_seen_by_the_watch(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir(mode=0o755)
    hs, published = hook_set(hooks, tmp_path, reverify=3600)

    def checksum(name: str) -> str | None:
        hook = hs.find(name)
        return hook.checksum if hook else None

    async with watching(hs):
        await wait_for(lambda: hs.scans >= 1, SEEN, "the first watch")
        add_hook(hooks, "a.sh")
        await wait_for(lambda: checksum("a.sh"), SEEN, "a.sh added")
        first = checksum("a.sh")
        (hooks / "a.sh").write_text("#!/bin/sh\necho changed\n")
        await wait_for(lambda: checksum("a.sh") not in (None, first), SEEN, "a.sh changed")
        (hooks / "a.sh").unlink()
        await wait_for(lambda: checksum("a.sh") is None, SEEN, "a.sh removed")
        await announced(published, [], SEEN)

        # replaced as a package or a configuration tool does: a new directory renamed over the old one
        new = tmp_path / "hooks.new"
        new.mkdir(mode=0o755)
        add_hook(new, "b.sh")
        scans = hs.scans
        hooks.rename(tmp_path / "hooks.old")
        new.rename(hooks)
        # the old watch reported its directory moved away (a scan), a new one is on the replacing one (a scan)
        await wait_for(lambda: hs.scans >= scans + 2, SEEN, "the replacing directory watched")
        assert checksum("b.sh")
        add_hook(hooks, "c.sh")
        await wait_for(lambda: checksum("c.sh"), SEEN, "c.sh added to the replacing directory")
        await announced(published, ["b.sh", "c.sh"], SEEN)
