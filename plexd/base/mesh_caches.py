"""Memo caches keyed by what the mesh holds, bounded by the mesh's size rather than by a count fixed up front.

The converge memoizes per peer, address, endpoint and rule (`functools.lru_cache`): a full apply at 10,000 peers
would otherwise parse every key and address again. Their bounds are sized for the largest mesh (65,536 entries), so
under churn, where peers come and go with new keys and addresses, each filled at the rate peers were replaced:
at one peer a second, the soak's RSS grew ~14 MiB an hour in entries for peers long gone. A cache registered here
is emptied once it holds more than the live mesh needs (`trim`, after each change of the desired model); what is
still live is computed again on its next use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

SLACK = 256  # entries a cache may hold beyond the live count before it is emptied

F = TypeVar("F", bound=Callable[..., Any])
_caches: list[Any] = []
_bound = SLACK  # the last bound computed: the live count is counted again only once a cache outgrows it


def bounded_by_mesh(cache: F) -> F:
    """Register an `lru_cache`-wrapped function whose keys are peers, addresses, endpoints or rules."""
    _caches.append(cache)
    return cache


def trim(live: Callable[[], int]) -> int:
    """Empty each registered cache holding more entries than `live()` (what the mesh holds: peers, their routes,
    rules in each chain) plus SLACK; returns how many were emptied. Cheap when nothing outgrew the last bound."""
    global _bound
    sizes = [(cache, cache.cache_info().currsize) for cache in _caches]
    if not sizes or max(size for _, size in sizes) <= _bound:
        return 0
    _bound = live() + SLACK
    emptied = 0
    for cache, size in sizes:
        if size > _bound:
            cache.cache_clear()
            emptied += 1
    return emptied
