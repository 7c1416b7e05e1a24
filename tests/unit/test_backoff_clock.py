"""Jittered backoff bounds and the fake clock used by every timing test."""

import asyncio

import pytest

from plexd.base.backoff import Backoff
from plexd.base.clock import FakeClock


def test_backoff_doubles_to_cap_without_jitter():
    b = Backoff(jitter=0)
    assert [b.next_delay() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    b.reset()
    assert b.next_delay() == 1


@pytest.mark.parametrize("r", [0.0, 0.5, 0.999999])
def test_backoff_jitter_bounds(r):
    b = Backoff(rand=lambda: r)
    for expected in [1, 2, 4, 8, 16, 32, 60, 60]:
        d = b.next_delay()
        assert expected * 0.75 <= d <= expected * 1.25


def test_backoff_validates_arguments():
    with pytest.raises(ValueError):
        Backoff(base=0)


async def test_fake_clock_wakes_sleepers_in_order():
    clock = FakeClock()
    woke = []

    async def sleeper(n, s):
        await clock.sleep(s)
        woke.append(n)

    tasks = [asyncio.create_task(sleeper(n, s)) for n, s in [("a", 5), ("b", 1)]]
    await asyncio.sleep(0)
    clock.advance(1)
    await asyncio.sleep(0)
    assert woke == ["b"]
    clock.advance(4)
    await asyncio.gather(*tasks)
    assert woke == ["b", "a"] and clock.sleeps == [5, 1]
