"""Latency is measured for a share of the peers per collection, in turn (telemetry.metrics.latency_peers): every
peer comes round, none twice before all have had their turn, and a small mesh is measured whole every time."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from plexd.telemetry.service import take_turn


def test_peers_take_turns_and_wrap_around():
    peers = ["a", "b", "c", "d", "e"]
    chosen, turn = take_turn(peers, 2, 0)
    assert chosen == ["a", "b"] and turn == 2
    chosen, turn = take_turn(peers, 2, turn)
    assert chosen == ["c", "d"] and turn == 4
    chosen, turn = take_turn(peers, 2, turn)
    assert chosen == ["e", "a"] and turn == 1
    assert take_turn(peers, 10, 3) == (peers, 0)  # all fit: all, every time
    assert take_turn(peers, 0, 3) == ([], 0)  # latency off
    assert take_turn([], 4, 7) == ([], 0)
    assert take_turn(["a", "b"], 1, 9) == (["b"], 0)  # a turn left over from a larger mesh still lands inside


@given(st.integers(1, 60), st.integers(1, 20), st.integers(0, 100))
def test_every_peer_comes_round_once_per_cycle(n, budget, start):
    peers = list(range(n))
    seen: list[int] = []
    turn = start
    rounds = -(-n // budget)  # ceil
    for _ in range(rounds):
        chosen, turn = take_turn(peers, budget, turn)
        assert len(chosen) == min(n, budget) and len(set(chosen)) == len(chosen)
        seen += chosen
    assert set(seen) == set(peers)
