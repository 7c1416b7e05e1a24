"""Events refused only because this node's clock disagrees with their `issued_at`, held until it agrees.

A signed event is accepted within 5 minutes of this node's clock (docs/protocol.md §3). When the clock is stepped
(a wrong clock corrected by NTP, a VM resumed, a hand `date -s`), every event is `stale` or `future` until it is
set right, and the stream's cursor moves past each refused one, so it is never sent again: an action requested in
that time was never answered (`python -m bench chaos`, clock_ahead). Such an event is held here instead, when its
signature verifies (a forgery is refused as before, and holds nothing), and tried again as the clock moves: once
the window takes it, it goes through every check again, the nonce included, and is handled.

Bounded: at most `MAX_EVENTS` events and `MAX_BYTES` of their text, each for `HOLD_FOR` at most; past either bound
the oldest goes, logged. Held in memory only: a restart forgets them (the reconciler's pull still brings the state
they carried). Nothing is weakened: an event is accepted only by the same window, at the time it is accepted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from plexd.base import gojson
from plexd.base.clock import Clock
from plexd.controlplane.envelope import Envelope

log = logging.getLogger(__name__)

CLOCK_REASONS = frozenset({"stale", "future"})
MAX_EVENTS = 256
MAX_BYTES = 4 * 1024 * 1024
HOLD_FOR = 15 * 60.0  # seconds: longer than a step corrected by hand, short enough not to act on old news


def _name(env: Envelope) -> str:
    return env.nonce or env.event_id


@dataclass(frozen=True)
class Held:
    envelope: Envelope
    since: float  # monotonic time when it was held: the wall clock is the one that cannot be trusted here
    size: int


class ClockHold:
    def __init__(self) -> None:
        self._held: OrderedDict[str, Held] = OrderedDict()  # by nonce (or id), oldest first
        self._bytes = 0
        self.offset: float | None = None  # seconds the last held event's issued_at was from this node's clock

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, env: Envelope, size: int, clock: Clock) -> None:
        """Keep an authentic event the window refused (its nonce names it, or its id in a dialect without nonces:
        the same event twice is held once)."""
        if _name(env) in self._held:
            return
        self.offset = (gojson.parse_time(env.issued_at) - clock.now()).total_seconds()
        if not self._held:
            log.warning("this node's clock is %+.0f s from the control plane's (event %s issued_at %s): events "
                        "are held until the clock agrees; check NTP (timedatectl)", -self.offset, env.event_id,
                        env.issued_at)
        self._held[_name(env)] = Held(env, clock.monotonic(), size)
        self._bytes += size
        while len(self._held) > MAX_EVENTS or self._bytes > MAX_BYTES:
            self._drop_oldest("the hold is full")

    def take(self, clock: Clock) -> list[Held]:
        """Every held event, oldest first, to be tried again; those held past `HOLD_FOR` are dropped, logged."""
        while self._held and clock.monotonic() - next(iter(self._held.values())).since > HOLD_FOR:
            self._drop_oldest(f"held {HOLD_FOR / 60:.0f} minutes, and its issued_at is still outside the 5-minute "
                              "window of this node's clock")
        out = list(self._held.values())
        self._held.clear()
        self._bytes = 0
        return out

    def put_back(self, held: Held) -> None:
        """An event `take` gave that the window still refuses: held again, with its first `since`."""
        self._held[_name(held.envelope)] = held
        self._bytes += held.size

    def _drop_oldest(self, why: str) -> None:
        _, held = self._held.popitem(last=False)
        self._bytes -= held.size
        log.warning("event %s (%s) dropped: %s", held.envelope.event_id, held.envelope.event_type, why,
                    extra={"event_id": held.envelope.event_id, "reason": "clock_hold_dropped"})
