"""Memo caches keyed by what the mesh holds, bounded by what the mesh needs rather than by a count fixed up front.

The converge memoizes per peer, address, endpoint and rule (`functools.lru_cache`): a full apply at 10,000 peers
would otherwise parse every key and address again. Their bounds are sized for the largest mesh (65,536 entries), so
under churn, where peers come and go with new keys and addresses, each filled at the rate peers were replaced: at
one peer a second, the soak's RSS grew ~14 MiB an hour in entries for peers long gone (tracemalloc named them).

A cache registered here is emptied once it outgrows its working set by a quarter plus SLACK entries. Its working
set is what it held when a full converge began, after the full converge that followed its last emptying had
filled it with what the mesh needed (`full_converge_begins`). Until that is measured (at the start, or for a cache
emptied and not yet refilled by a full converge) the live mesh stands in: its peers, their routes and the rules in
each chain. What is still live is computed again on its next use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

SLACK = 256  # entries a cache may hold beyond its bound before it is emptied
GROWTH = 1.25  # ... and its measured working set may grow by this much first

F = TypeVar("F", bound=Callable[..., Any])
_caches: list[Any] = []
_working: dict[int, int] = {}  # id(cache) -> its working set, as measured
_emptied: set[int] = set()  # emptied (or new) since the last full converge began
_refilled: set[int] = set()  # emptied before the last full converge began: that converge refilled them
_bound = SLACK  # the live mesh's bound as last counted: counted again only once a cache outgrows it


def bounded_by_mesh(cache: F) -> F:
    """Register an `lru_cache`-wrapped function whose keys are peers, addresses, endpoints or rules."""
    _caches.append(cache)
    _emptied.add(id(cache))  # empty: the first full converges measure what it needs
    return cache


def full_converge_begins() -> None:
    """A full converge is about to read the machine: the caches the previous one refilled hold the mesh's working
    set now (and what events added since: little), measured here."""
    global _refilled, _emptied
    for cache in _caches:
        if id(cache) in _refilled:
            _working[id(cache)] = cache.cache_info().currsize
    _refilled, _emptied = _emptied, set()


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
        _emptied.add(id(cache))
        emptied += 1
    return emptied
