"""The converge's memo caches are kept to what the mesh holds: under churn they do not grow with every peer ever
seen (the soak's RSS growth), and a full apply of a large mesh does not empty them."""

from __future__ import annotations

import functools

from plexd.base import mesh_caches


def test_a_cache_that_outgrows_the_mesh_is_emptied_and_one_within_it_is_kept(monkeypatch):
    monkeypatch.setattr(mesh_caches, "_caches", [])
    monkeypatch.setattr(mesh_caches, "_bound", mesh_caches.SLACK)

    @mesh_caches.bounded_by_mesh
    @functools.lru_cache(maxsize=1 << 16)
    def churned(key: int) -> int:
        return key

    @mesh_caches.bounded_by_mesh
    @functools.lru_cache(maxsize=1 << 16)
    def steady(key: int) -> int:
        return key

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


def test_the_daemons_caches_are_registered():
    from plexd.mesh import mesh_plan
    from plexd.state import policy

    assert mesh_plan.peer_config in mesh_caches._caches and policy._address in mesh_caches._caches
