"""`Slot`: one typed place for a part that a part built before it must reach, filled once by the composition root.

The composition root (`plexd.node.assembly`) builds parts in dependency order; a true circle (a built-in action
reads the whole node's status, and the node holds the action dispatcher) is closed by a slot, never by a lambda
that names a variable assigned later. Reading an empty slot is a bug, and says which slot.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from plexd.base.errors import PlexdError

T = TypeVar("T")


class EmptySlot(PlexdError):
    """A slot was read before the composition root filled it."""


class Slot(Generic[T]):
    def __init__(self, name: str) -> None:
        self.name = name
        self._value: T | None = None

    def fill(self, value: T) -> T:
        if self._value is not None:
            raise ValueError(f"the {self.name} slot is filled already")
        self._value = value
        return value

    def get(self) -> T:
        if self._value is None:
            raise EmptySlot(f"the {self.name} slot was read before the assembly filled it")
        return self._value
