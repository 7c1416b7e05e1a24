"""Whether a reconcile cycle must pull the state, or the event stream has kept the desired model current.

A cycle on its interval diffs the live machine against the desired model every `reconcile.interval` (drift is
found at the same pace as ever); the pull (`GET /state`) is what an idle node would otherwise send the control
plane 60 times an hour. It is skipped only while one connection of the event stream has carried, without a gap,
every event since the last pull: a state pulled after the stream connected, plus every event after it, is the
control plane's state. Anything that could have lost an event makes the next cycle pull again:

- the stream is not connected (polling, or a pull-only platform): every cycle pulls, as before;
- a new connection since the pull (whatever was published between the two is in the replay or not);
- an event refused or skipped since the pull (its change is not in the model);
- the last pull is older than `reconcile.pull_interval` (a control plane that changed the state without an event).

Every cycle that has a reason of its own (a trigger: the stream's reconnect, a heartbeat's ``reconcile:true``,
``plexd reconcile``) pulls, and so does a dry run.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from plexd.base.clock import Clock


@dataclass(frozen=True)
class Mark:
    """Taken just before a pull: the stream's continuity then, and when."""

    continuity: Hashable | None
    at: float  # monotonic


class PullFreshness:
    def __init__(self, continuity: Callable[[], Hashable | None], clock: Clock, max_age: float) -> None:
        """`continuity()`: None while the stream is not connected; otherwise a value that changes whenever the
        model may have missed an event (`EventStream.continuity`)."""
        self._continuity = continuity
        self._clock = clock
        self.max_age = max_age
        self._last: Mark | None = None

    def mark(self) -> Mark:
        return Mark(self._continuity(), self._clock.monotonic())

    def pulled(self, mark: Mark) -> None:
        """A pull that started at `mark` was applied."""
        self._last = mark

    def due(self) -> str:
        """Why an interval cycle must pull now; "" when the model is known current without it."""
        last = self._last
        if last is None:
            return "no state pulled yet"
        now = self._continuity()
        if now is None:
            return "the event stream is not connected"
        if last.continuity is None or now != last.continuity:
            return "the event stream may have missed an event since the last pull"
        if self._clock.monotonic() - last.at >= self.max_age:
            return "the last pull is older than reconcile.pull_interval"
        return ""


class AlwaysPull:
    """No event stream to lean on (tests, `plexd reconcile --once`): every cycle pulls."""

    def mark(self) -> Mark:
        return Mark(None, 0.0)

    def pulled(self, mark: Mark) -> None:
        pass

    def due(self) -> str:
        return "always"
