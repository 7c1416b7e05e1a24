"""The hooks directory's inotify watch (plexd/base/dirwatch.py) on a real directory: what it sees, that a burst is
one change, that a quiet directory times out, and that it says clearly what it cannot watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import pytest

from plexd.actions.hooks import HookSet
from plexd.actions.journal import ActionJournal
from plexd.base.dirwatch import DirectoryWatch
from plexd.trust.integrity import scan_hooks


def hook_set(hooks, tmp_path) -> tuple[HookSet, list[list[str]]]:
    """A hook set over `hooks` and the list of what it announced (hook names, per announcement)."""
    published: list[list[str]] = []

    async def publish(scan):
        published.append(sorted(h.name for h in scan.hooks))

    return HookSet(str(hooks), ActionJournal(tmp_path / "uplink.db"), scan_hooks(hooks), publish), published


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


@pytest.mark.parametrize("change", ["create", "write", "chmod", "rename in", "delete", "directory deleted"])
async def test_each_kind_of_change_is_seen(tmp_path, change):
    watched = tmp_path / "d"
    watched.mkdir()
    (watched / "old").write_text("x")
    (tmp_path / "outside").write_text("y")
    with DirectoryWatch(str(watched), debounce=0.05) as watch:
        assert await watch.next_change(timeout=0.2) is False  # quiet so far
        {"create": lambda: (watched / "new").write_text("n"),
         "write": lambda: (watched / "old").write_text("changed"),
         "chmod": lambda: (watched / "old").chmod(0o700),
         "rename in": lambda: (tmp_path / "outside").rename(watched / "moved"),
         "delete": lambda: (watched / "old").unlink(),
         "directory deleted": lambda: ((watched / "old").unlink(), watched.rmdir())}[change]()
        assert await watch.next_change(timeout=5) is True


async def test_a_burst_is_one_change_and_a_subdirectory_is_not_watched(tmp_path):
    (tmp_path / "sub").mkdir()
    with DirectoryWatch(str(tmp_path), debounce=0.2) as watch:
        for i in range(50):
            (tmp_path / f"f{i}").write_text("x")
        assert await watch.next_change(timeout=5) is True
        assert await watch.next_change(timeout=0.3) is False  # all 50 went into the one change
        (tmp_path / "sub" / "deep").write_text("x")
        assert await watch.next_change(timeout=0.3) is False


async def test_a_missing_directory_is_named_and_a_closed_watch_frees_its_descriptor(tmp_path):
    with pytest.raises(OSError, match=r"cannot watch .*absent: No such file or directory"):
        DirectoryWatch(str(tmp_path / "absent"))
    before = len(os.listdir("/proc/self/fd"))
    watch = DirectoryWatch(str(tmp_path))
    await watch.next_change(timeout=0.01)
    watch.close()
    watch.close()  # twice is harmless
    assert len(os.listdir("/proc/self/fd")) == before


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
    with DirectoryWatch(str(watched), debounce=0.05) as watch:
        watched.rmdir()
        watched.mkdir()  # ext4 often hands the same inode back: the inode alone cannot tell
        assert await watch.next_change(timeout=5) is True and watch.gone
    with DirectoryWatch(str(watched), debounce=0.05) as watch:
        (watched / "new").write_text("x")
        assert await watch.next_change(timeout=5) is True and not watch.gone
    assert isinstance(ino, int)


async def test_a_file_is_not_a_directory_to_watch(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError, match="Not a directory"):
        DirectoryWatch(str(tmp_path / "f"))


async def test_hooks_in_a_directory_made_again_in_place_are_seen(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir(mode=0o755)
    hs, published = hook_set(hooks, tmp_path)
    async with watching(hs):
        await asyncio.sleep(0.3)
        hooks.rmdir()
        hooks.mkdir(mode=0o755)
        await asyncio.sleep(1.0)  # the old watch reported the directory gone; a new one is on the new directory
        add_hook(hooks, "a.sh")
        await announced(published, ["a.sh"], 3)  # not at the 5-minute re-verify
