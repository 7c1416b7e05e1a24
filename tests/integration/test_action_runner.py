"""The hook runner and the hook watcher with real processes and a real directory: separate capped streams (a
hook printing 100 MiB), the whole process group killed on timeout and cancel (a child that ignores SIGTERM),
signals, files that cannot run; the inotify watcher seeing edits, a broken sidecar, and the directory vanishing and
coming back."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest
from process_helpers import alive

from plexd.actions.hooks import HookSet
from plexd.actions.journal import ActionJournal
from plexd.actions.runner import TRUNCATED, run_process
from plexd.trust.integrity import scan_hooks

pytestmark = pytest.mark.root  # hooks must be root-owned


def hook(directory: Path, name: str, body: str) -> str:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


async def gone(pid: int) -> bool:
    for _ in range(50):
        if not alive(pid):
            return True
        await asyncio.sleep(0.05)
    return False


async def run(path: str, **kw):
    args = {"timeout": 10, "cap": 1 << 20, "kill_grace": 0.3, **kw}
    return await run_process(path, {"PATH": "/usr/bin:/bin"}, **args)


async def test_streams_are_separate_and_capped_while_the_hook_keeps_running(tmp_path):
    path = hook(tmp_path, "loud", "head -c 104857600 /dev/zero | tr '\\0' x\necho err >&2\necho tail-done >&2\n"
                                  "exit 4\n")
    seen = []
    out = await run(path, on_output=lambda stream, data: seen.append((stream, len(data))))
    assert out.status == "failed" and out.exit_code == 4
    assert out.stdout == "x" * (1 << 20) + TRUNCATED and out.stderr == "err\ntail-done\n"
    assert sum(n for s, n in seen if s == "stdout") == 1 << 20


async def test_timeout_kills_the_whole_group_including_a_child_that_ignores_sigterm(tmp_path):
    path = hook(tmp_path, "forker", f"sh -c 'trap \"\" TERM; echo $$ > {tmp_path}/child; exec sleep 300' &\n"
                                    "sleep 300\n")
    started = time.monotonic()
    out = await run(path, timeout=1)
    assert out.status == "timeout" and out.exit_code == -1
    assert time.monotonic() - started < 5
    assert await gone(int((tmp_path / "child").read_text()))


async def test_cancel_ends_the_hook_as_cancelled(tmp_path):
    path = hook(tmp_path, "long", f"echo started\ntouch {tmp_path}/running\nsleep 300\n")
    cancel = asyncio.Event()
    task = asyncio.create_task(run(path, cancel=cancel))
    async with asyncio.timeout(10):  # the hook has written its line before it is cancelled
        while not (tmp_path / "running").exists():
            await asyncio.sleep(0.01)
    cancel.set()
    out = await task
    assert out.status == "cancelled" and out.stdout == "started\n"


async def test_a_hook_killed_by_a_signal_and_one_that_cannot_run(tmp_path):
    out = await run(hook(tmp_path, "selfkill", "kill -9 $$\n"))
    assert (out.status, out.exit_code, out.signal) == ("failed", -1, 9)
    bad = tmp_path / "nointerp"
    bad.write_text("#!/no/such/interpreter\n")
    bad.chmod(0o755)
    out = await run(str(bad))
    assert out.status == "error" and out.exit_code == 1 and "cannot execute" in out.stderr


async def test_leftovers_holding_the_pipes_are_killed_after_the_hook_exits(tmp_path):
    path = hook(tmp_path, "leaves", f"sleep 300 &\necho $! > {tmp_path}/bg\necho bye\n")
    started = time.monotonic()
    out = await run(path)
    assert out.status == "success" and out.stdout == "bye\n" and time.monotonic() - started < 5
    assert await gone(int((tmp_path / "bg").read_text()))


async def test_the_watcher_sees_edits_broken_sidecars_and_a_vanishing_directory(tmp_path, monkeypatch):
    monkeypatch.setattr("plexd.actions.hooks.POLL", 0.1)
    monkeypatch.setattr("plexd.base.dirwatch.STEP", 0.2)  # the watch looks more often than the daemon's 5 s
    hooks = tmp_path / "hooks"
    hooks.mkdir(mode=0o755)
    hook(hooks, "a.sh", "echo a\n")
    published = []

    async def publish(scan):
        published.append(sorted(h.name for h in scan.hooks))

    journal = ActionJournal(tmp_path / "uplink.db")
    hs = HookSet(str(hooks), journal, scan_hooks(hooks), publish, reverify=60)
    hs.mark_announced(hs.current)
    tasks = [asyncio.create_task(hs.watch()), asyncio.create_task(hs.announce())]

    async def until(pred, what):
        for _ in range(100):
            if pred():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; published {published}")

    try:
        await asyncio.sleep(0.5)
        hook(hooks, "b.sh", "echo b\n")
        await until(lambda: published and published[-1] == ["a.sh", "b.sh"], "b.sh announced")
        (hooks / "b.sh.json").write_text("{not json")
        await until(lambda: any("sidecar b.sh.json ignored" in w for w in hs.current.warnings), "the warning")
        assert hs.find("b.sh") is not None  # a broken sidecar leaves the hook usable, without its fields
        (hooks / "b.sh").chmod(0o775)
        await until(lambda: [r.name for r in hs.current.refused] == ["b.sh"], "b.sh refused")
        assert "writable by group or other" in hs.current.refused[0].reason
        shutil.rmtree(hooks)
        await until(lambda: published[-1] == [], "no hooks announced")
        hooks.mkdir(mode=0o755)
        hook(hooks, "c.sh", "echo c\n")
        await until(lambda: published[-1] == ["c.sh"], "the new directory watched")
        assert journal.announced() == {"c.sh": hs.find("c.sh").checksum}
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert json.dumps(hs.status())
