"""The daemon's one desired model, and the order of events against state pulls.

Events edit the model (`edit`); the reconciler replaces it with a full state pull (`replace_from_pull`). A pull
is a snapshot of the control plane taken at some moment while the request was in flight, so an event that was
applied while a pull was in flight may announce a change the snapshot does not hold yet: applying the snapshot
as is would undo the event (a new peer removed again until the next reconcile).

We order the two by a sequence number rather than by re-pulling: every event edit gets the next number and is
kept in a short journal; a pull remembers the number current when it started (`mark`), and when its state is
applied, the edits made since are replayed on top of it. Replaying is right whatever the snapshot saw: an edit
the snapshot already holds is a no-op (every edit sets a value, none increments one), and a later event for the
same object arrives after the replay and wins as it would have anyway. No extra requests, no loop under an event
storm, and a deterministic rule the tests can drive. Should more edits arrive during one pull than the journal
holds, the pull is not applied (`StalePull`) and the caller pulls again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from plexd.base.errors import PlexdError
from plexd.state.desired import DesiredState

Edit = Callable[[DesiredState], DesiredState]
JOURNAL_SIZE = 1024


class StalePull(PlexdError):
    """More events were applied during a pull than the journal can replay: pull again."""


@dataclass(frozen=True)
class Journaled:
    seq: int
    label: str
    edit: Edit


class DesiredStore:
    def __init__(self, initial: DesiredState, on_changed: Callable[[DesiredState], None] | None = None,
                 journal_size: int = JOURNAL_SIZE) -> None:
        self._value = initial
        self._listeners = [on_changed] if on_changed is not None else []  # e.g. the mirror's group commit
        self._seq = 0
        self._journal: deque[Journaled] = deque(maxlen=journal_size)
        # Per reader (the apply, the mirror): peer ids the edits since its last `take_touched()` changed; None:
        # unknown (a pull or a replace), scan.
        self._touched: dict[str, set[str] | None] = {}

    def subscribe(self, listener: Callable[[DesiredState], None]) -> None:
        """`listener(model)` after every change of the model."""
        self._listeners.append(listener)

    @property
    def value(self) -> DesiredState:
        return self._value

    def get(self) -> DesiredState:
        return self._value

    @property
    def seq(self) -> int:
        return self._seq

    def _set(self, value: DesiredState) -> None:
        self._value = value
        for listener in self._listeners:
            listener(value)

    def edit(self, change: Edit, label: str = "", peers: Iterable[str] | None = None) -> DesiredState:
        """Apply an event's change now, and journal it for any pull in flight. `peers`: the ids of the peers the
        change can touch (None: any), so that applying it needs no scan of every peer."""
        self._seq += 1
        self._journal.append(Journaled(self._seq, label, change))
        ids = None if peers is None else set(peers)
        for reader, touched in self._touched.items():
            if ids is None:
                self._touched[reader] = None
            elif touched is not None:
                touched.update(ids)
        self._set(change(self._value))
        return self._value

    def take_touched(self, reader: str = "apply") -> set[str] | None:
        """The peer ids changed since this reader's last call (None when unknown: the first call, or a pull or a
        replace since), and start counting again."""
        touched = self._touched.get(reader)
        self._touched[reader] = set()
        return touched

    def _forget_touched(self) -> None:
        for reader in self._touched:
            self._touched[reader] = None

    def mark(self) -> int:
        """Call just before a state pull is requested; pass the result to `replace_from_pull`."""
        return self._seq

    def replace_from_pull(self, rebuild: Edit, since: int) -> list[str]:
        """Replace the model by `rebuild(current)` (a state pull) and replay every edit made after `since`.

        Returns the labels of the replayed edits. Raises StalePull (and changes nothing) when edits made after
        `since` have already left the journal."""
        replay = [j for j in self._journal if j.seq > since]
        lost = self._seq - since - len(replay)
        if lost > 0:
            raise StalePull(f"{self._seq - since} events arrived during the state pull; "
                            f"only the last {len(replay)} could be replayed")
        new = rebuild(self._value)
        for j in replay:
            new = j.edit(new)
        # Entries up to `since` are no use to a later pull (pulls are serialised by the reconciler).
        while self._journal and self._journal[0].seq <= since:
            self._journal.popleft()
        self._forget_touched()
        self._set(new)
        return [j.label for j in replay]

    def replace(self, value: DesiredState) -> None:
        """Set the model outright (start-up, tests): not an event, not journaled."""
        self._forget_touched()
        self._set(value)
