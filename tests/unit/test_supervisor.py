"""Supervision with a FakeClock: restart after a crash with 1 s doubling to 60 s (±25 %), reset after a healthy
minute, restarts counted; a FatalError ends the daemon; the test fault hook crashes a service exactly once."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from plexd.base.clock import FakeClock
from plexd.node.supervisor import FatalError, FaultPlan, InjectedFault, Supervisor


async def spin(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_crashes_are_restarted_with_growing_backoff_and_counted(caplog):
    clock, stop = FakeClock(), asyncio.Event()
    sup = Supervisor(stop, clock=clock, jitter=0.0)
    runs = []

    async def flaky():
        runs.append(clock.monotonic())
        raise RuntimeError(f"crash {len(runs)}")

    task = asyncio.create_task(sup.supervise("flaky", flaky))
    for _ in range(9):
        await spin()
        clock.advance(60)
    await spin()
    gaps = [round(b - a) for a, b in itertools.pairwise(runs)]
    assert clock.sleeps[:8] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert len(runs) >= 8 and all(g == 60 for g in gaps)  # the fake clock jumps 60 s per step
    health = sup.health["flaky"]
    assert health.restarts == len(runs) and health.state == "restarting"
    assert health.last_error.startswith("RuntimeError: crash")
    assert sum("service flaky crashed" in r.getMessage() for r in caplog.records) == len(runs)
    assert all(r.exc_info for r in caplog.records if "service flaky crashed" in r.getMessage())
    stop.set()
    await asyncio.wait_for(task, 2)


async def test_backoff_resets_after_a_healthy_minute():
    clock, stop = FakeClock(), asyncio.Event()
    sup = Supervisor(stop, clock=clock, jitter=0.0)
    lifetimes = iter([0, 0, 0, 61, 0])

    async def service():
        await clock.sleep(next(lifetimes))
        raise RuntimeError("boom")

    task = asyncio.create_task(sup.supervise("svc", service))
    for _ in range(12):
        await spin()
        clock.advance(31)
    stop.set()
    clock.advance(100)
    await asyncio.wait_for(task, 2)
    backoffs = [s for s in clock.sleeps if s not in (0, 61)]
    assert backoffs[:4] == [1, 2, 4, 1]  # the fourth run lived 61 s: healthy, so back to 1 s


async def test_a_fatal_error_sets_the_stop_event_and_is_not_restarted(caplog):
    clock, stop = FakeClock(), asyncio.Event()
    sup = Supervisor(stop, clock=clock)
    runs = []

    async def hopeless():
        runs.append(1)
        raise FatalError("identity refused")

    await asyncio.wait_for(sup.supervise("svc", hopeless), 2)
    assert runs == [1] and stop.is_set() and str(sup.fatal) == "identity refused"
    assert sup.health["svc"].state == "failed"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == ["identity refused"]


async def test_cancellation_ends_the_service_even_if_it_swallows_one_cancel():
    stop = asyncio.Event()
    sup = Supervisor(stop)
    ended = asyncio.Event()

    async def stubborn():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # swallowed once, as Python 3.11's wait_for can
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    task = asyncio.create_task(sup.supervise("stubborn", stubborn))
    await spin()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert ended.is_set()


async def test_fault_hook_crashes_each_named_service_once():
    plan = FaultPlan.from_env({"PLEXD_TEST_FAULTS": "events, heartbeat", "PLEXD_TEST_FAULT_AFTER": "0.05"})
    assert plan.services == {"events", "heartbeat"} and plan.after == 0.05
    stop = asyncio.Event()
    sup = Supervisor(stop, base=0.01, cap=0.01, faults=plan)
    starts = []

    async def events():
        starts.append(asyncio.get_running_loop().time())
        await asyncio.sleep(3600)

    task = asyncio.create_task(sup.supervise("events", events))
    while len(starts) < 2:
        await asyncio.sleep(0.01)
    health = sup.health["events"]
    assert health.restarts == 1 and health.last_error.startswith(InjectedFault.__name__)
    await asyncio.sleep(0.2)
    assert len(starts) == 2  # once only
    stop.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_no_faults_without_the_variable():
    assert FaultPlan.from_env({}).services == set()
