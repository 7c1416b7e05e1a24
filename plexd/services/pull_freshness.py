"""Whether a reconcile cycle must pull the state, or the event stream has kept the desired model current.

A cycle on its interval diffs the live machine against the desired model every `reconcile.interval` (drift is
found at the same pace as ever); the pull (`GET /state`) is what an idle node would otherwise send the control
plane 60 times an hour. It is skipped only while one connection of the event stream has carried, without a gap,
every event since the last pull: a state pulled after the stream connected, plus every event after it, is the
control plane's state. Anything that could have lost a change makes the next cycle pull again:

- the stream is not connected (polling, or a pull-only platform): every cycle pulls, as before;
- a new connection, or another node id, since the pull;
- an event refused, skipped, held for the clock, or accepted without its whole effect (`EventStream.gaps`);
- someone asked for a pull (`invalidate`: a trigger, an event that only says "pull", an action put off until the
  state offers it again), until a pull that started after the asking succeeds: a failed one leaves it due;
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
    """Taken just before a pull: the stream's continuity then, the asking generation, and when."""

    continuity: Hashable | None
    generation: int
    at: float  # monotonic


class PullFreshness:
    def __init__(self, continuity: Callable[[], Hashable | None], clock: Clock, max_age: float) -> None:
        """`continuity()`: None while the stream is not connected; otherwise a value that changes whenever the
        model may have missed an event (`EventStream.continuity`)."""
        self._continuity = continuity
        self._clock = clock
        self.max_age = max_age
        self._generation = 0
        self._last: Mark | None = None

    def mark(self) -> Mark:
        return Mark(self._continuity(), self._generation, self._clock.monotonic())

    def pulled(self, mark: Mark) -> None:
        """A pull that started at `mark` was applied."""
        self._last = mark

    def invalidate(self) -> None:
        """The next interval cycle pulls, unless a pull that starts after this call succeeds first."""
        self._generation += 1

    def due(self) -> str:
        """Why an interval cycle must pull now; "" when the model is known current without it."""
        last = self._last
        if last is None:
            return "no state pulled yet"
        if last.generation != self._generation:
            return "a pull was asked for since the last one"
        now = self._continuity()
        if now is None:
            return "the event stream is not connected"
        if last.continuity is None or now != last.continuity:
            return "the event stream may have missed an event since the last pull"
        if self._clock.monotonic() - last.at >= self.max_age:
            return "the last pull is older than reconcile.pull_interval"
        return ""


def always_pull(clock: Clock) -> PullFreshness:
    """No event stream to lean on (tests, `plexd reconcile --once`): never connected, so every cycle pulls."""
    return PullFreshness(lambda: None, clock, 0.0)
