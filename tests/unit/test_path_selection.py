"""Path selection (plexd.services.paths), driven by a device read the test sets and clocks it moves: direct until
the direct path shows no handshake for 10 s, then the relay; back to direct when the other side comes through
directly, or after a probe a minute later whose packets arrive directly; a failed probe back on the relay. The
decision lands in the desired model, where the device's endpoint comes from. (Real wireguard-go paths through a
real relay: tests/e2e/test_bridge_lab.py.)"""

from __future__ import annotations

import base64

import pytest
from nacl.public import PrivateKey

from plexd.machine.wireguard import DeviceConfig, PeerConfig
from plexd.services.paths import DIRECT, PROBING, RELAY, PathSelector
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore
from plexd.state.model import Peer


def key() -> str:
    return base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()


DIRECT_EP, RELAY_EP = "198.51.100.7:51820", "203.0.113.1:51821"


class Harness:
    def __init__(self) -> None:
        self.peer = Peer("n_b", key(), "10.100.0.2", DIRECT_EP, fallback_endpoint=RELAY_EP)
        self.plain = Peer("n_c", key(), "10.100.0.3", "198.51.100.9:51820")
        base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420,
                                    private_key=base64.b64encode(bytes(PrivateKey.generate())).decode(),
                                    mesh_ip="10.100.0.1")
        self.store = DesiredStore(base.with_peers([self.peer, self.plain]))
        # 35 s into a probe interval (1_699_999_980 is a whole number of minutes): outside the probe window
        self.mono, self.wall = 1000.0, 1_699_999_980.0 + 35
        self.live = {"endpoint": DIRECT_EP, "handshake": 0.0, "rx": 0, "tx": 0}
        self.converges: list[str] = []
        self.selector = PathSelector(self.store, self.device, self.converges.append,
                                     monotonic=lambda: self.mono, wall=lambda: self.wall)

    async def device(self) -> DeviceConfig:
        peers = {self.peer.public_key: PeerConfig(self.peer.public_key, self.live["endpoint"],
                                                  last_handshake=self.live["handshake"], rx=self.live["rx"],
                                                  tx=self.live["tx"]),
                 self.plain.public_key: PeerConfig(self.plain.public_key, self.plain.endpoint)}
        return DeviceConfig(peers=peers)

    async def after(self, seconds: float) -> str:
        self.mono += seconds
        self.wall += seconds
        await self.selector.tick()
        return self.selector.paths["n_b"].path

    def configured(self) -> str:
        return self.store.value.shown_peer("n_b").endpoint

    def handshake_now(self) -> None:
        self.live["handshake"] = self.wall


@pytest.fixture
def h():
    return Harness()


async def probing_after_a_minute_on_the_relay(h: Harness) -> None:
    """Relayed (no handshake on the direct path), then probing 2 s into the second minute after that."""
    await h.after(0)
    await h.after(11)
    h.live["endpoint"] = RELAY_EP
    h.handshake_now()
    assert await h.after(76) == PROBING


async def test_no_handshake_on_the_direct_path_moves_the_peer_to_the_relay_after_10_s(h):
    assert await h.after(0) == DIRECT and h.configured() == DIRECT_EP
    assert await h.after(9) == DIRECT
    assert await h.after(2) == RELAY
    assert h.configured() == RELAY_EP and h.store.value.relayed == {"n_b"}
    assert h.converges == ["path selection (n_b)"]
    assert set(h.selector.paths) == {"n_b"}  # a peer without a fallback is never looked at
    assert h.selector.status()["n_b"]["switches"] == 1


async def test_a_working_direct_path_stays(h):
    h.handshake_now()
    for _ in range(10):
        h.handshake_now()
        assert await h.after(30) == DIRECT
    assert h.converges == []


async def test_a_probe_whose_packets_arrive_directly_takes_the_peer_back(h):
    await h.after(0)
    assert await h.after(11) == RELAY  # 46 s into the minute
    h.live["endpoint"] = RELAY_EP
    h.handshake_now()  # relayed: the handshake goes through the relay
    assert await h.after(16) == RELAY  # 2 s into the next minute, but on the relay for less than a minute
    assert await h.after(40) == RELAY  # 42 s: not in a probe window
    h.handshake_now()
    assert await h.after(20) == PROBING and h.configured() == DIRECT_EP  # 2 s into the next: every node tries
    h.live["endpoint"] = DIRECT_EP  # the other side's packets come directly, so the device keeps the endpoint
    h.live["rx"] += 148
    assert await h.after(10) == PROBING  # the window lasts 30 s, whatever happens in it
    assert await h.after(20) == DIRECT and h.configured() == DIRECT_EP
    assert h.selector.status()["n_b"]["switches"] == 2  # to the relay, and back (the probe itself is not one)


async def test_a_failed_probe_goes_back_to_the_relay_when_its_window_ends_and_waits_for_the_next(h):
    await h.after(0)
    await h.after(11)
    h.live["endpoint"] = RELAY_EP
    h.handshake_now()
    assert await h.after(76) == PROBING  # 2 s into the second minute after it went to the relay
    h.live["endpoint"] = RELAY_EP  # the other side's packets still come through the relay: the device roamed back
    assert await h.after(10) == PROBING  # the other side may start a moment later: the window is waited out
    assert await h.after(20) == RELAY and h.configured() == RELAY_EP
    assert await h.after(20) == RELAY  # 52 s: no second try in the same minute
    assert await h.after(10) == PROBING  # the next minute's window: every window from now on, so the two sides of
    # a pair that went relayed at different moments still try together


async def test_two_nodes_that_went_relayed_at_different_moments_probe_in_the_same_window():
    """What makes hole punching work: both sides of a pair send directly at once, whenever each went relayed."""
    one, other = Harness(), Harness()
    other.selector = PathSelector(other.store, other.device, other.converges.append,  # one shared clock
                                  monotonic=lambda: one.mono, wall=lambda: one.wall)
    seen = []
    for step in range(120):  # four minutes in 2 s ticks; the second node starts 30 s after the first
        one.mono += 2
        one.wall += 2
        for h in (one, other) if step >= 15 else (one,):
            await h.selector.tick()
            if h.selector.paths["n_b"].path == RELAY:
                h.live["endpoint"] = RELAY_EP  # nobody answers directly while the other side is on the relay
                h.live["handshake"] = one.wall
        seen.append(tuple(h.selector.paths["n_b"].path if "n_b" in h.selector.paths else None for h in (one, other)))
    both = [i for i, (x, y) in enumerate(seen) if x == PROBING and y == PROBING]
    assert both, seen
    assert any(x == PROBING and y == RELAY for x, y in seen[:both[0]]), seen  # the first one tried alone first


async def test_the_other_side_coming_through_directly_ends_the_relay_at_once(h):
    await h.after(0)
    await h.after(16)
    h.live["endpoint"] = "198.51.100.7:40123"  # roamed to where the other side's direct packets came from
    h.handshake_now()
    assert await h.after(2) == DIRECT and h.configured() == DIRECT_EP


async def test_a_direct_peer_whose_other_side_went_to_the_relay_follows_it(h):
    h.handshake_now()
    assert await h.after(0) == DIRECT
    h.live["endpoint"] = RELAY_EP  # the device roamed: the other side's packets come through the relay
    h.handshake_now()
    assert await h.after(2) == RELAY and h.configured() == RELAY_EP


def test_a_malformed_fallback_endpoint_refuses_the_peer_by_name():
    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.1.0.1")
    bad = Peer("n_x", key(), "10.100.0.5", "198.51.100.7:51820", fallback_endpoint="relay-without-port")
    d = base.with_peers([bad])
    assert "n_x" not in d.peers and "fallback endpoint" in dict(d.rejected)["n_x"]
    # a host name: the device would hold the resolved address, and path selection took every relayed packet for
    # the other side coming through directly (back to the dead direct path every ~3 minutes)
    named = Peer("n_w", key(), "10.100.0.8", "198.51.100.7:51820", fallback_endpoint="relay.example.net:51821")
    assert "is not an IP address and port" in dict(base.with_peers([named]).rejected)["n_w"]
    wire = Peer.from_wire({"id": "n_y", "public_key": key(), "mesh_ip": "10.100.0.6",
                           "fallback_endpoint": RELAY_EP})
    assert wire.fallback_endpoint == RELAY_EP and wire.to_wire()["fallback_endpoint"] == RELAY_EP
    assert "fallback_endpoint" not in Peer("n_z", key(), "10.100.0.7").to_wire()  # the older shape stays as it was


async def test_a_pair_whose_direct_path_is_dead_loses_little_to_probes():
    """Both sides of a relayed pair probe in the same window, and when the direct path is dead, whatever either
    sends while probing goes nowhere. The window used to be waited out (30 s of every minute lost, for good);
    now a probe ends when, 11 s in, packets went out and none came back, and each failed probe doubles the wait
    for the next. The device model: traffic flows both ways; a side gets the other's packets only while both
    are on the relay (the direct path delivers nothing), and it roams to the relay when it does."""
    one, other = Harness(), Harness()
    other.selector = PathSelector(other.store, other.device, other.converges.append,
                                  monotonic=lambda: one.mono, wall=lambda: one.wall)
    sides = (one, other)
    ticks = lost = 0
    probe_starts = []
    for step in range(30 * 30):  # 30 minutes in 2 s ticks
        one.mono += 2
        one.wall += 2
        for h in sides:
            await h.selector.tick()
        paths = [h.selector.paths["n_b"].path for h in sides]
        for h in sides:
            h.live["tx"] = h.live.get("tx", 0) + 100  # always something to send
            if all(p == RELAY for p in paths):
                h.live["endpoint"], h.live["rx"], h.live["handshake"] = RELAY_EP, h.live["rx"] + 100, one.wall
        if paths[0] == PROBING and (not probe_starts or probe_starts[-1][1] != step - 1):
            probe_starts.append((step, step))
        elif paths[0] == PROBING:
            probe_starts[-1] = (probe_starts[-1][0], step)
        ticks += 1
        lost += any(p != RELAY for p in paths)
    durations = [(end - start + 1) * 2 for start, end in probe_starts]
    assert all(d <= 14 for d in durations[1:]), durations  # ended on the evidence, not at 30 s
    assert len(probe_starts) <= 7, probe_starts  # 1, 2, 4, 8 minutes apart: not one a minute
    assert lost / ticks < 0.08, (lost, ticks)  # was about half of all time


async def test_a_probe_that_hears_back_is_not_cut_short(h):
    await probing_after_a_minute_on_the_relay(h)
    h.live["tx"] = 500
    h.live["endpoint"], h.live["rx"] = DIRECT_EP, h.live["rx"] + 148  # an answer came directly
    h.handshake_now()
    assert await h.after(12) == PROBING and await h.after(6) == PROBING  # evidence of life: the window goes on
    assert await h.after(14) == DIRECT and h.selector.paths["n_b"].failed_probes == 0


async def test_an_idle_pair_waits_its_probe_window_out_and_never_backs_off(h):
    # Keepalives only (32 bytes per 25 s): nothing to lose, and they are the packets that punch two NATs open.
    # Ended early and backed off, an idle pair whose direct path came back stayed relayed for many minutes.
    await probing_after_a_minute_on_the_relay(h)
    h.live["tx"] += 32  # one keepalive went out directly; nothing back yet
    assert await h.after(12) == PROBING and await h.after(10) == PROBING  # no early end
    assert await h.after(10) == RELAY and h.selector.paths["n_b"].failed_probes == 0
    assert await h.after(28) == PROBING  # the very next window: no backoff for a probe that lost nothing
