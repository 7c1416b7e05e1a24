"""How long tests wait, in one place: every window a test waits for the machine (a handshake, a reconcile, a
daemon's start) is multiplied by LOAD_FACTOR, so a loaded or slow machine gets longer windows everywhere at once
(`PLEXD_TEST_LOAD_FACTOR=2 make test` under stress) instead of each test growing its own timeouts. Waits are on
observable conditions; the factor only says how long to keep looking before giving up with the evidence."""

from __future__ import annotations

import os

try:
    LOAD_FACTOR = max(1.0, float(os.environ.get("PLEXD_TEST_LOAD_FACTOR", "1")))
except ValueError:
    LOAD_FACTOR = 1.0


def scaled(seconds: float) -> float:
    """`seconds` stretched by the load factor."""
    return seconds * LOAD_FACTOR
