"""The heap settler: what survives young collections is frozen soon after, on the event loop, so a full
collection walks only what came since; the whole heap is collected in full on its own schedule; leaving the
daemon puts the collector back as it was."""

from __future__ import annotations

import asyncio
import gc
import platform
import weakref

import pytest

from plexd.base import heap
from plexd.base.heap import HeapSettler


async def test_young_collections_lead_to_a_freeze_on_the_loop_and_leaving_unfreezes():
    loop = asyncio.get_running_loop()
    before = len(gc.callbacks)
    with HeapSettler(loop, freeze_after=2) as settler:
        assert len(gc.callbacks) == before + 1
        survivors = [[i] for i in range(1000)]  # long-lived objects, tracked by the collector
        gc.collect(1)
        assert settler.freezes == 0  # one young collection: not yet
        gc.collect(1)
        await asyncio.sleep(0)  # the freeze runs on the loop, never inside the collector's callback
        assert settler.freezes == 1 and gc.get_freeze_count() >= len(survivors)
    assert gc.get_freeze_count() == 0 and len(gc.callbacks) == before


async def test_a_settle_after_the_full_interval_collects_cycles_that_a_freeze_would_have_kept():
    class Node:
        pass

    with HeapSettler(asyncio.get_running_loop(), full_every=0.0) as settler:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
        alive = weakref.ref(a)
        gc.collect(1)
        gc.collect(1)  # now in the oldest generation: a young collect cannot reach it
        gc.freeze()  # as an earlier settle would have
        del a, b
        gc.collect(1)
        assert alive() is not None  # frozen: kept
        settler.settle()  # full: unfreeze, collect everything, freeze what is left
        assert alive() is None


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc knobs: a no-op with another C library")
def test_glibc_takes_the_settings_unless_the_operator_set_their_own(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert heap.glibc.tune() is True
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert heap.glibc.tune() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    assert heap.glibc.tune() is False


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
async def test_a_settle_hands_freed_heap_memory_back_to_the_system():
    with HeapSettler(asyncio.get_running_loop()) as settler:
        blocks = [bytes(1000) + bytes([i % 256]) for i in range(40_000)]  # ~40 MB of malloc'd blocks (> 512 B)
        kept = bytes(1000) + b"top"  # in use above them: glibc cannot just shrink its heap when they are freed
        del blocks
        before = _rss_kib()
        settler.settle()
        trim = settler.giving_back
        assert trim is not None and not trim.done()  # in a worker thread, not on the loop
        assert await trim is True
        assert before - _rss_kib() > 20_000, "the freed 40 MB stayed resident"
        assert kept


async def test_trims_come_at_most_every_trim_every_and_a_skipped_one_when_due(monkeypatch):
    monkeypatch.setattr(heap, "TRIM_EVERY", 0.5)
    with HeapSettler(asyncio.get_running_loop()) as settler:
        settler.settle()
        first = settler.giving_back
        settler.settle()
        settler.settle()  # within TRIM_EVERY of the first: one trim set for when it is due, not two, not now
        assert first is not None and settler.giving_back is first
        await first
        for _ in range(100):
            if settler.giving_back is not first:
                break
            await asyncio.sleep(0.05)
        assert settler.giving_back is not first, "the skipped trim never came"
        await settler.giving_back


async def test_leaving_cancels_a_trim_set_for_later(monkeypatch):
    monkeypatch.setattr(heap, "TRIM_EVERY", 0.2)
    with HeapSettler(asyncio.get_running_loop()) as settler:
        settler.settle()
        first = settler.giving_back
        settler.settle()  # a trim set for later
    await asyncio.sleep(0.4)
    assert settler.giving_back is first  # none after leaving
    assert first is not None
    await first
