"""Memo caches keyed by what the mesh holds, bounded by what the mesh needs rather than by a count fixed up front.

The converge memoizes per peer, address, endpoint and rule (`functools.lru_cache`): a full apply at 10,000 peers
would otherwise parse every key and address again. Their bounds are sized for the largest mesh (65,536 entries), so
under churn, where peers come and go with new keys and addresses, each filled at the rate peers were replaced: at
one peer a second, the soak's RSS grew ~14 MiB an hour in entries for peers long gone (tracemalloc named them).

A cache registered here is emptied once it outgrows its working set by a quarter plus SLACK entries. Its working
set is what it holds right after the first full converge since it was last emptied (`full_converge_done`): what
the mesh needed then. Until that is measured (at the start, or once emptied) the live mesh stands in: its peers,
their routes and the rules in each chain. What is still live is computed again on its next use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

SLACK = 256  # entries a cache may hold beyond its bound before it is emptied
GROWTH = 1.25  # ... and its measured working set may grow by this much first

F = TypeVar("F", bound=Callable[..., Any])
_caches: list[Any] = []
_working: dict[int, int] = {}  # id(cache) -> its working set, as measured
_unmeasured: set[int] = set()  # new or emptied since the last full converge: measured after the next one
_bound = SLACK  # the live mesh's bound as last counted: counted again only once a cache outgrows it


def bounded_by_mesh(cache: F) -> F:
    """Register an `lru_cache`-wrapped function whose keys are peers, addresses, endpoints or rules."""
    _caches.append(cache)
    _unmeasured.add(id(cache))
    return cache


def full_converge_done() -> None:
    """A full converge read the machine and planned every domain: the caches emptied before it hold what the mesh
    needs now, measured here."""
    for cache in _caches:
        if id(cache) in _unmeasured:
            _working[id(cache)] = cache.cache_info().currsize
    _unmeasured.clear()


def trim(live: Callable[[], int]) -> int:
    """Empty each registered cache that outgrew its bound (see the module's docstring); `live()` counts what the
    mesh holds, only when a cache without a measured working set outgrew the last count. Returns how many were
    emptied. Cheap: a size per cache."""
    global _bound
    emptied = 0
    for cache in _caches:
        size = cache.cache_info().currsize
        working = _working.get(id(cache))
        if working is not None:
            if size <= working * GROWTH + SLACK:
                continue
        elif size <= _bound or size <= (_bound := live() + SLACK):
            continue
        cache.cache_clear()
        _working.pop(id(cache), None)  # measured again after the next full converge; the live mesh until then
        _unmeasured.add(id(cache))
        emptied += 1
    return emptied
