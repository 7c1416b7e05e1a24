"""The converge's memo caches are kept to what the mesh needs: under churn they do not grow with every peer ever
seen (the soak's RSS growth, named by tracemalloc), and a full apply of a large mesh does not empty them."""

from __future__ import annotations

import functools

import pytest

from plexd.base import mesh_caches


@pytest.fixture
def caches(monkeypatch):
    """Two fresh registered caches, `churned` and `steady`, and nothing else registered."""
    for name, value in (("_caches", []), ("_working", {}), ("_emptied", set()), ("_refilled", set()),
                        ("_bound", mesh_caches.SLACK)):
        monkeypatch.setattr(mesh_caches, name, value)

    @mesh_caches.bounded_by_mesh
    @functools.lru_cache(maxsize=1 << 16)
    def churned(key: int) -> int:
        return key

    @mesh_caches.bounded_by_mesh
    @functools.lru_cache(maxsize=1 << 16)
    def steady(key: int) -> int:
        return key

    return churned, steady


def full_converge(*caches, keys=range(1000)) -> None:
    mesh_caches.full_converge_begins()
    for key in keys:
        for cache in caches:
            cache(key)


def test_before_a_working_set_is_measured_the_live_mesh_bounds_a_cache(caches):
    churned, steady = caches
    counted = []

    def live() -> int:
        counted.append(1)
        return 1000

    for key in range(1000):
        churned(key), steady(key)
    assert mesh_caches.trim(live) == 0 and counted == [1]  # over the first bound: counted once, nothing emptied
    assert mesh_caches.trim(live) == 0 and counted == [1]  # within the bound now: not even counted
    for key in range(1000, 1000 + mesh_caches.SLACK + 1):  # peers replaced one by one: stale entries pile up
        churned(key)
    assert mesh_caches.trim(live) == 1
    assert churned.cache_info().currsize == 0 and steady.cache_info().currsize == 1000


def test_a_measured_working_set_bounds_a_cache_by_a_quarter_more_and_is_measured_again_after_it_is_emptied(caches):
    churned, steady = caches
    full_converge(churned, steady)  # the start: fills them
    full_converge(churned, steady)  # measures what the first left: 1,000 each
    assert mesh_caches._working == {id(churned): 1000, id(steady): 1000}

    def live() -> int:  # far larger than the working set: not what bounds a measured cache
        return 100_000

    grown = 1000 + 250 + mesh_caches.SLACK
    for key in range(1000, grown):  # one peer replaced a second: stale entries, up to the bound and no further
        churned(key)
    assert mesh_caches.trim(live) == 0
    churned(grown)
    assert mesh_caches.trim(live) == 1
    assert churned.cache_info().currsize == 0 and steady.cache_info().currsize == 1000
    full_converge(churned, steady, keys=range(500, 1500))  # refills it with what the mesh needs now
    full_converge(churned, steady, keys=range(500, 1500))  # ... and measures that
    assert mesh_caches._working[id(churned)] == 1000 and churned.cache_info().currsize == 1000


def test_the_daemons_caches_are_registered():
    from plexd.mesh import mesh_plan
    from plexd.state import policy

    assert mesh_plan.peer_config in mesh_caches._caches and policy._address in mesh_caches._caches
