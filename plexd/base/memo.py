"""Memoising by an object's identity, for arguments too big to hash on every call.

An event's model shares its policies tuple (and so its compiled policy) with the model before it; hashing 1,000
rules per event would cost more than the event's whole apply. Each entry holds its object, so the object stays
alive and its `id()` cannot be reused for another one while the entry exists.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class ByIdentity(Generic[V]):
    """At most a few entries (cleared whole when full: only the current version repeats)."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._entries: dict[tuple[int, Hashable], tuple[Any, V]] = {}

    def get(self, obj: Any, extra: Hashable, make: Callable[[], V]) -> V:
        """The value for (`obj` itself, `extra`), made by `make()` the first time."""
        key = (id(obj), extra)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        value = make()
        if len(self._entries) > self._size:
            self._entries.clear()
        self._entries[key] = (obj, value)
        return value
