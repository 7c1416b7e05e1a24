"""Latency is measured for a share of the peers per collection, in turn (telemetry.metrics.latency_peers): every
peer comes round, none twice before all have had their turn, and a small mesh is measured whole every time."""

from __future__ import annotations

import json

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


async def test_a_new_desired_state_is_probed_from_its_own_peers(tmp_path):
    """The probe order is kept per desired state (sorting 1,000 peers at every collection cost more than the
    probes): a new state's peers are the ones probed, at once. Real ICMP echoes to loopback addresses."""
    from dataclasses import replace

    from plexd.config.settings import TelemetryConfig
    from plexd.controlplane.uplink import UplinkOutbox
    from plexd.state.model import Peer
    from plexd.telemetry.service import Telemetry

    async def nothing(*_):
        return None

    def mesh(*names: str) -> dict[str, Peer]:
        return {name: Peer(id=name, public_key=f"{name}=", mesh_ip=f"127.0.0.{i + 2}") for i, name in enumerate(names)}

    cfg = TelemetryConfig()
    cfg = replace(cfg, metrics=replace(cfg.metrics, latency_peers=2, latency_timeout=1.0))
    box = UplinkOutbox(tmp_path / "uplink.db", nothing)
    state = {"peers": mesh("a", "b", "c")}
    telemetry = Telemetry(cfg, box, "host", nothing, read_counters=nothing, desired_peers=lambda: state["peers"])

    async def probed() -> dict[str, int]:
        before = {e.seq for e in box.pending("telemetry_metrics")}
        await telemetry.collect_metrics()
        points = [p for e in box.pending("telemetry_metrics") if e.seq not in before for p in json.loads(e.text)]
        return {p["peer_id"]: p["data"]["rtt_nano"] for p in points if p["group"] == "latency"}

    first, second = await probed(), await probed()
    assert (list(first), list(second)) == (["a", "b"], ["c", "a"])  # in turn, wrapping around
    assert all(rtt > 0 for rtt in (*first.values(), *second.values()))  # loopback answers
    state["peers"] = mesh("x", "y")
    assert set(await probed()) == {"x", "y"}
    telemetry.queue.close()
