"""The converge's memo caches are kept to what the mesh needs: under churn they do not grow with every peer ever
seen (the soak's RSS growth, named by tracemalloc), and a full apply of a large mesh does not empty them."""

from __future__ import annotations

import functools

import pytest

from plexd.base import mesh_caches


@pytest.fixture
def caches(monkeypatch):
    """Two fresh registered caches, `churned` and `steady`, and nothing else registered."""
    for name, value in (("_caches", []), ("_working", {}), ("_unmeasured", set()), ("_bound", mesh_caches.SLACK)):
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
    """What a full converge does to the caches: fills them with what the mesh needs, then they are measured."""
    for key in keys:
        for cache in caches:
            cache(key)
    mesh_caches.full_converge_done()


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
    full_converge(churned, steady)  # the start: fills them, and measures what it left: 1,000 each
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
    assert id(churned) not in mesh_caches._working  # the live mesh bounds it until it is measured again
    full_converge(churned, steady, keys=range(500, 1500))  # refills it with what the mesh needs now, and measures
    assert mesh_caches._working[id(churned)] == 1000 and churned.cache_info().currsize == 1000


@pytest.mark.parametrize("first", [range(0), range(100)], ids=["an empty model first", "a small mesh first"])
def test_a_mesh_that_grew_is_measured_again_once_and_then_left_alone(caches, first):
    # A reconcile: a full converge, then the pull's change of the model (a trim), then a second full converge the
    # gate skips (the pull changed nothing). Measured small at first, a grown mesh's caches are emptied once,
    # measured after the next converge, and not emptied again: no emptying (and recomputing) every reconcile.
    churned, steady = caches
    full_converge(churned, steady, keys=first)

    def live() -> int:
        return 1000

    emptied = []
    for _ in range(4):
        full_converge(churned, steady)  # the drift phase: the mesh needs 1,000 keys now
        emptied.append(mesh_caches.trim(live))  # the pull changed the model; its converge is skipped
    assert emptied == [2, 0, 0, 0]
    assert mesh_caches._working == {id(churned): 1000, id(steady): 1000}


def test_the_daemons_caches_are_registered():
    from plexd.mesh import mesh_plan
    from plexd.state import policy

    assert mesh_plan.peer_config in mesh_caches._caches and policy._address in mesh_caches._caches
