"""The devplane's load shedding of event-stream opens (a token bucket sized to the fleet): the rate it admits at,
and Retry-After values spread over the time it takes to admit everyone waiting. Pure; a fake clock."""

from __future__ import annotations

import random

from plexd.devplane.admission import StreamAdmission


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_storm_is_admitted_at_five_percent_of_the_fleet_per_second_and_told_to_spread():
    clock = Clock()
    gate = StreamAdmission(lambda: 1000, clock=clock, rand=random.Random(1).random)
    admitted_per_second = []
    retry_afters = []
    for second in range(5):
        clock.now = float(second)
        admitted = 0
        for _ in range(1000 if second == 0 else 100):  # the whole fleet at once, then stragglers
            ra = gate.admit()
            if ra is None:
                admitted += 1
            else:
                retry_afters.append(ra)
        admitted_per_second.append(admitted)
    assert admitted_per_second[0] <= 25  # the burst: half a second's worth
    assert all(n <= 50 for n in admitted_per_second)  # 5 % of 1,000 per second
    assert min(retry_afters) >= 1 and max(retry_afters) >= 20  # spread over the ~20 s it takes to admit 1,000
    assert len(set(retry_afters)) > 15


def test_a_quiet_control_plane_admits_at_once():
    clock = Clock()
    gate = StreamAdmission(lambda: 3, clock=clock)
    for i in range(10):
        clock.now = i * 0.5
        assert gate.admit() is None
