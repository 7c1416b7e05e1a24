"""Keeping Python's cyclic garbage collector out of the event path.

With 5,000 peers the daemon holds about a million long-lived objects (the desired model, the device as last read,
the mirror). A full (generation 2) collection walks all of them: 30-60 ms during which no event is applied, a few
times a minute after the state grew (bench/event_latency.py --peers 5000: they were its maximum and most of its
p99). Python runs one when enough objects were promoted since the last: what survives a few young collections is
therefore frozen (`gc.freeze`) soon after, on the event loop, so a later full collection walks only what came since.

What a freeze keeps is never collected as a cycle while frozen (reference counting still frees the rest), so the
young garbage is collected first, and once an hour the heap is unfrozen and collected in full.

Memory freed is handed back to the system after a settle too (glibc's `malloc_trim`): a state pull, a device read
or a telemetry collection frees most of what it allocated, but glibc keeps the freed pages, and keeps a heap
("arena") per thread that allocated at the same time as another. A trim walks every free block (1-5 ms on a
fragmented heap) holding the heap's lock, so it runs at most every TRIM_EVERY seconds (a skipped one when due) and
in a worker thread: the loop goes on meanwhile, except that an allocation glibc cannot serve from its per-thread
cache waits for the walk to end.
Measured with bench/idle_cost.py: idle RSS 60-62 MiB → 57.0 at 1,000 peers and 94-106 → 86-88 at 10,000 with
one arena, a fixed mmap threshold (large transient buffers — a 350 KB device reply — mapped and unmapped rather
than left in a heap) and the trims.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import time
from typing import Any

FREEZE_AFTER = 4  # young (generation 1) collections between freezes; Python goes full after 10 at the most
FULL_EVERY = 3600.0  # seconds between collections of the whole heap
FULL_EVERY_ENV = "PLEXD_TEST_GC_FULL_EVERY"  # a bench's knob (bench/soak.py): seconds, in place of FULL_EVERY
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # <malloc.h>
MMAP_THRESHOLD = 128 << 10  # glibc's initial value, kept: it otherwise rises to the largest block freed so far
# One heap for every thread: the per-thread heaps held mostly freed memory (~9 MiB at 1,000 peers). Threads that
# allocate with the GIL released (sqlite3, libnftables) share its lock; glibc's per-thread cache serves most small
# blocks without it.
ARENAS = 1
TRIM_EVERY = 30.0  # seconds between trims at the most (a burst of events settles many times a second)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class _Glibc:
    """glibc's malloc knobs, when the C library is glibc (each call a no-op elsewhere)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None)
        self._mallopt = getattr(libc, "mallopt", None)
        self._trim = getattr(libc, "malloc_trim", None)
        self._mallinfo2 = getattr(libc, "mallinfo2", None)
        if self._mallinfo2 is not None:
            self._mallinfo2.argtypes, self._mallinfo2.restype = [], _MallInfo2
        if self._mallopt is not None:
            self._mallopt.argtypes, self._mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        if self._trim is not None:
            self._trim.argtypes, self._trim.restype = [ctypes.c_size_t], ctypes.c_int

    def tune(self) -> bool:
        """Fewer heaps, large blocks mapped; True when glibc took both. Process-wide and for good (glibc cannot say
        what was set before), and only heaps made afterwards are limited: called before the daemon's threads start.
        An operator's own MALLOC_ARENA_MAX / GLIBC_TUNABLES malloc settings win: then nothing is changed."""
        if self._mallopt is None or "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc" in os.environ.get(
                "GLIBC_TUNABLES", ""):
            return False
        return bool(self._mallopt(M_ARENA_MAX, ARENAS)) & bool(self._mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))

    def stats(self) -> dict[str, float] | None:
        """glibc's own count (mallinfo2), in MiB: what its heaps hold in use and free (of which `top` could go back
        to the system at once), and what it mapped for large blocks. In use growing is a leak (blocks in a thread's
        cache count as in use); free minus top growing is fragmentation. It walks the free lists holding the heap's
        lock: for a status now and then, not a hot path. None without glibc 2.33 or later."""
        if self._mallinfo2 is None:
            return None
        info = self._mallinfo2()
        mib = 1 / (1 << 20)
        return {"heap": round(info.arena * mib, 2), "in_use": round(info.uordblks * mib, 2),
                "free": round(info.fordblks * mib, 2), "top": round(info.keepcost * mib, 2),
                "mapped": round(info.hblkhd * mib, 2)}

    def give_back(self) -> bool:
        """Return the free pages of every heap to the system (True when any was)."""
        return bool(self._trim(0)) if self._trim is not None else False


glibc = _Glibc()


def _full_every() -> float:
    try:
        return float(os.environ.get(FULL_EVERY_ENV, FULL_EVERY))
    except ValueError:
        return FULL_EVERY


def gc_stats() -> dict[str, int]:
    """What the collector holds: objects frozen (not collected as cycles until the next full collection) and
    the collections of each generation so far. Cheap: no walk of the heap."""
    collections = {f"collections_{i}": gen["collections"] for i, gen in enumerate(gc.get_stats())}
    return {"frozen": gc.get_freeze_count(), **collections}


class HeapSettler:
    """Installed for the daemon's lifetime (a context manager): freezes what survived young collections."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, freeze_after: int = FREEZE_AFTER,
                 full_every: float | None = None) -> None:
        self._loop = loop
        self.freeze_after, self.full_every = freeze_after, full_every if full_every is not None else _full_every()
        self._young = 0
        self._scheduled = False
        self._full_at = time.monotonic()
        self._installed = False
        self.freezes = 0
        self._trimmed_at = -TRIM_EVERY
        self._trim_pending: asyncio.Handle | None = None
        self.giving_back: asyncio.Future[bool] | None = None  # the latest trim, for tests to wait on

    def __enter__(self) -> HeapSettler:
        glibc.tune()
        gc.callbacks.append(self._collected)
        self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._installed = False  # a settle already on its way does nothing
        if self._trim_pending is not None:
            self._trim_pending.cancel()
        gc.callbacks.remove(self._collected)
        gc.unfreeze()

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        """gc's callback, in whichever thread collected: count, and ask the loop to settle (never from here)."""
        if phase != "stop" or info["generation"] != 1 or self._scheduled:
            return
        self._young += 1
        if self._young >= self.freeze_after:
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self.settle)
            except RuntimeError:  # the loop is closed: the daemon is leaving
                pass

    def settle(self) -> None:
        if not self._installed:
            return
        now = time.monotonic()
        if now - self._full_at >= self.full_every:
            gc.unfreeze()
            gc.collect()
            self._full_at = now
        else:
            gc.collect(1)  # the young generations: garbage made since the last freeze, cheap
        gc.freeze()
        self.freezes += 1
        self._young, self._scheduled = 0, False
        self._give_back_when_due(now)

    def _give_back_when_due(self, now: float) -> None:
        """What the collections (and the work before them) freed, back to the system: now, or when due."""
        if self._trim_pending is not None:
            return  # one is already set for when it is due
        wait = self._trimmed_at + TRIM_EVERY - now
        if wait > 0:
            self._trim_pending = self._loop.call_later(wait, self._give_back)
        else:
            self._give_back()

    def _give_back(self) -> None:
        self._trim_pending = None
        if not self._installed:
            return
        self._trimmed_at = time.monotonic()
        self.giving_back = self._loop.run_in_executor(None, glibc.give_back)
