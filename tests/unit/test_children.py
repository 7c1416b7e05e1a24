"""asyncio hears of child exits through pidfds: no thread per live child (the daemon's SSH sessions, hooks)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import pytest

from plexd.base.children import RunningLoopPidfdWatcher, signal_child, watch_children_with_pidfds

ON_311 = pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12+ chooses pidfds itself; nothing to set")


@pytest.fixture
def pidfd_watcher():
    """plexd's watcher installed as `plexd up` installs it; Python's own put back after."""
    previous = asyncio.get_child_watcher()
    assert watch_children_with_pidfds() is True
    yield
    asyncio.set_child_watcher(previous)


@ON_311
async def test_a_live_child_costs_no_thread_and_its_exit_status_still_arrives(pidfd_watcher):
    assert isinstance(asyncio.get_child_watcher(), RunningLoopPidfdWatcher)
    threads = threading.active_count()
    proc = await asyncio.create_subprocess_exec("sh", "-c", "read line; exit 3", stdin=asyncio.subprocess.PIPE)
    assert threading.active_count() == threads  # Python 3.11's default starts one here and keeps it
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    assert await asyncio.wait_for(proc.wait(), 10) == 3


@ON_311
def test_a_loop_in_another_thread_hears_of_its_own_childs_exit(pidfd_watcher):
    # 3.11's PidfdChildWatcher serves only the main thread's loop; this one serves whichever loop spawned
    results: list[int] = []

    async def spawn() -> int:
        proc = await asyncio.create_subprocess_exec("sh", "-c", "exit 5")
        return await asyncio.wait_for(proc.wait(), 10)

    worker = threading.Thread(target=lambda: results.append(asyncio.run(spawn())))
    worker.start()
    worker.join(20)
    assert results == [5]


async def test_a_child_reaped_by_someone_else_is_reported_with_255_and_nothing_hangs():
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[int, int]] = loop.create_future()
    pid = os.spawnvp(os.P_NOWAIT, "sh", ["sh", "-c", "exit 4"])
    RunningLoopPidfdWatcher().add_child_handler(pid, lambda p, rc: done.set_result((p, rc)))
    os.waitpid(pid, 0)  # another part of the process reaps it first
    assert await asyncio.wait_for(done, 10) == (pid, 255)


@ON_311
async def test_signalling_a_child_that_exited_unnoticed_keeps_its_exit_status(pidfd_watcher):
    # proc.send_signal() would poll() and reap the child before the loop read its pidfd: the status read 255
    proc = await asyncio.create_subprocess_exec("sh", "-c", "exit 7")
    time.sleep(0.3)  # the loop is busy elsewhere while the child exits
    signal_child(proc, signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 10) == 7
    signal_child(proc, signal.SIGTERM)  # known to have exited: nothing is sent, nothing raised


@ON_311
async def test_a_child_started_when_no_pidfd_can_be_opened_is_still_waited_for(pidfd_watcher, monkeypatch):
    # Out of descriptors at the wrong moment: the child runs already, so its exit must still be heard (in a
    # thread), not lost with the child left unsupervised.
    def no_descriptor(pid: int) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "pidfd_open", no_descriptor)
    proc = await asyncio.create_subprocess_exec("sh", "-c", "exit 6")
    assert await asyncio.wait_for(proc.wait(), 10) == 6


@ON_311
async def test_a_child_held_from_its_start_stays_unreaped_until_released_even_if_it_exits_at_once(pidfd_watcher):
    # The SSH server signals a command's process group by its leader's pid; the leader must not be reaped (and
    # its number given out again) while the server may still do so, however fast it exits.
    from plexd.base.children import children_held, release_reaping

    with children_held():
        proc = await asyncio.create_subprocess_exec("sh", "-c", "exit 3")
    await asyncio.sleep(0.3)  # it has exited; unheld, the watcher would have reaped it by now
    with open(f"/proc/{proc.pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    assert proc.returncode is None
    release_reaping(proc.pid)
    assert await asyncio.wait_for(proc.wait(), 10) == 3
    other = await asyncio.create_subprocess_exec("sh", "-c", "exit 4")  # outside the block: reaped as usual
    assert await asyncio.wait_for(other.wait(), 10) == 4


@ON_311
async def test_a_held_spawn_cancelled_midway_is_cleaned_up_not_left_waiting_on_its_hold(pidfd_watcher):
    # asyncio kills and waits for a child whose spawn was cancelled (a daemon stopping); held, that wait never
    # ended, and nobody had the process to release it.
    from plexd.base.children import _watcher, children_held


    async def spawn():
        with children_held():
            return await asyncio.create_subprocess_exec(
                "sleep", "30", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)

    task = asyncio.create_task(spawn())
    watcher = _watcher()
    assert watcher is not None
    for _ in range(50):
        await asyncio.sleep(0)
        if watcher._held:
            break
    assert watcher._held and not task.done()  # registered and held, its pipes not yet connected
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert done and watcher._held == {}
