"""Fair use of the node API: one token bucket per client (a uid on the socket, an address on TCP).

`rate` requests per second are refilled up to `burst`; a request that finds the bucket empty is answered 429 with
a Retry-After, a quarter second late (plexd.nodeapi.local_api), so a client flooding on one connection is slowed to a
few requests per second and costs the daemon almost nothing (measured: bench/node_api.py --rate-limit default).
The table holds MAX_CLIENTS buckets at most, kept in the order their clients were last seen: a new client first
forgets the ones that went quiet long enough to refill, else the one seen longest ago (O(1) either way; rebuilding
the table for every new address cost seconds of the event loop under a flood from many addresses). rate 0 turns
the limit off.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

MAX_CLIENTS = 4096


class RateLimiter:
    def __init__(self, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = max(burst, 1.0)
        self._clock = clock
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # client -> (tokens, at), by at
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def allow(self, client: Hashable) -> float:
        """0.0 when the request may go ahead, else the seconds until one token is back."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        tokens, at = self._buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if client not in self._buckets and len(self._buckets) >= MAX_CLIENTS:
            self._make_room(now)
        self._buckets[client] = (tokens if tokens < 1.0 else tokens - 1.0, now)
        self._buckets.move_to_end(client)
        if tokens < 1.0:
            self.refused += 1
            return (1.0 - tokens) / self.rate
        return 0.0

    def blocked(self, client: Hashable) -> bool:
        """Whether `client`'s bucket is empty now (nothing taken: a look at the door, not a request)."""
        if self.rate <= 0 or client not in self._buckets:
            return False
        tokens, at = self._buckets[client]
        return tokens + (self._clock() - at) * self.rate < 1.0

    def _make_room(self, now: float) -> None:
        """Forget the buckets that have refilled (their clients are as good as new), oldest first; if none has,
        the one seen longest ago."""
        full_after = self.burst / self.rate
        while self._buckets:
            _, at = next(iter(self._buckets.values()))
            if now - at < full_after:
                break
            self._buckets.popitem(last=False)
        if len(self._buckets) >= MAX_CLIENTS:
            self._buckets.popitem(last=False)
