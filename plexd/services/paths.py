"""Automatic path selection (issue 34 item 3): a peer with a `fallback_endpoint` (a bridge's relay) is configured on
its direct endpoint first, moved to the relay when the direct path shows no handshake, and taken back when the
direct path works again.

Per peer, every `TICK` seconds, from the live device (latest handshake, endpoint, bytes received):

    direct   no handshake in the last 3 minutes for `DIRECT_GRACE` (10 s) since the path was set → relay; the
             device roamed to the relay (the other side moved there) → relay
    relay    the device roamed to a direct address with a recent handshake (the other side came through
             directly) → direct; otherwise, at the start of a probe window at least one interval after it
             went to the relay → probing (after probes that lost traffic, only every 2nd, 4th, 8th window)
    probing  configured direct again until the window ends; then direct if packets kept arriving and the
             device's endpoint is not the relay's (WireGuard roams to wherever the other side's packets come
             from), else back to the relay. Sooner back to the relay when, `PROBE_EVIDENCE` (11 s) into the
             probe, traffic went out directly and nothing came back: a working direct path answers by then
             (two-way traffic at once, a one-way flow with WireGuard's passive keepalive at 10 s)

Probe windows are the first 30 s of each `interval` (60 s by default) of wall-clock time,
the same for every node: both sides of a relayed pair try the direct path at the same moment, which is what
two NATs that filter by endpoint need to let each other's packets in (a one-sided try can never get through
them). A pair whose direct path never works therefore sends into nothing while both sides probe: with traffic
flowing that costs at most `PROBE_EVIDENCE` per probe, and each such probe doubles the wait for the next (windows
whose number is a multiple of 2, 4, 8, so two sides with different counts still meet in the larger one's): a
blocked, busy pair loses some 11 s every 8 minutes, not 30 s of every minute. An idle pair (keepalives only)
waits each window out, losing nothing, and its keepalives are what get through two NATs that open for them.
Either side going back to the relay and sending brings the other's device back too (WireGuard roams to the
relay's address). The decision is a model edit (`DesiredState.relayed`), applied by the engine like any event
(a switch is news that wins over WireGuard's roaming); the reconcile keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from plexd.base.memo import ByIdentity
from plexd.machine.wireguard import DeviceConfig
from plexd.mesh.mesh_plan import normalize_endpoint
from plexd.state.desired_store import DesiredStore
from plexd.state.model import Peer

log = logging.getLogger(__name__)

TICK = 2.0
DIRECT_GRACE = 10.0  # a working direct path handshakes within ~1 s, or 5 s after one lost initiation
FRESH = 180.0  # a handshake younger than this: the path carries the session (WireGuard rekeys every 2 min)
PROBE_INTERVAL = 60.0
PROBE_WINDOW = 30.0
PROBE_EVIDENCE = 11.0  # into a probe: traffic sent directly and nothing back by now: the direct path is not there
# More than keepalives (32 bytes each, one per 25 s): traffic that a dead direct path would lose. An idle tunnel
# waits out the window, its keepalives the packets that punch the two NATs (and losing nothing, it never backs off).
PROBE_TRAFFIC = 256
MAX_PROBE_BACKOFF = 3  # probes that lost traffic double the wait before the next, up to 2**3 intervals

DIRECT, RELAY, PROBING = "direct", "relay", "probing"


@dataclass
class PeerPath:
    path: str
    since: float  # monotonic: when this path was set
    switches: int = 0
    rx_at_probe: int = 0
    tx_at_probe: int = 0
    failed_probes: int = 0  # in a row; reset when a probe (or the other side) brings the direct path back
    last_switch: float = 0.0  # wall clock, for status
    probed_slot: int = -1  # the probe window last used (wall-clock intervals since the epoch)
    relayed_at: float = 0.0  # monotonic: when it last went from direct to the relay (failed probes do not count)


class PathSelector:
    def __init__(self, store: DesiredStore, read_device: Callable[[], Awaitable[DeviceConfig | None]],
                 request_converge: Callable[[str], None], *, probe_interval: float = PROBE_INTERVAL,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.interval = probe_interval
        # Longer than a persistent keepalive (25 s): the side whose first packet the other NAT dropped (it sent
        # before the other side had) gets one more through before the window ends.
        self.window = min(PROBE_WINDOW, probe_interval - 10)
        self._store = store
        self._read = read_device
        self._converge = request_converge
        self._monotonic, self._wall = monotonic, wall
        self.paths: dict[str, PeerPath] = {}
        self._candidates = ByIdentity[dict[str, Peer]](size=2)  # every 2 s over 1,000 peers: only when they change

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(TICK)

    async def tick(self) -> None:
        desired = self._store.value
        candidates = self._candidates.get(desired.peers, None, lambda: {
            pid: p for pid, p in desired.peers.items() if p.fallback_endpoint})
        self.paths = {pid: st for pid, st in self.paths.items() if pid in candidates}
        if not candidates:
            return
        device = await self._read()
        if device is None:
            return
        now = self._monotonic()
        changed: list[str] = []
        for pid, peer in candidates.items():
            st = self.paths.setdefault(pid, PeerPath(RELAY if pid in desired.relayed else DIRECT, now, relayed_at=now))
            live = device.peers.get(peer.public_key)
            if live is None:
                continue
            path = self._decide(st, live.last_handshake, live.endpoint, live.rx, live.tx,
                                normalize_endpoint(peer.fallback_endpoint), now)
            if path != st.path:
                log.info("peer %s: path %s -> %s", pid, st.path, path,
                         extra={"peer_id": pid, "path": path})
                if (path == RELAY) != (st.path == RELAY):  # the endpoint the device is given changes
                    changed.append(pid)
                    st.switches += 1
                    st.last_switch = self._wall()
                if path == RELAY and st.path == DIRECT:
                    st.relayed_at = now
                st.path, st.since, st.rx_at_probe, st.tx_at_probe = path, now, live.rx, live.tx
        if changed:
            relayed = frozenset(pid for pid, st in self.paths.items() if st.path == RELAY)
            self._store.edit(lambda d: d.with_relayed(relayed), "path selection", tuple(changed))
            self._converge(f"path selection ({', '.join(sorted(changed))})")

    def _decide(self, st: PeerPath, handshake: float, endpoint: str, rx: int, tx: int, relay: str,
                now: float) -> str:
        wall = self._wall()
        fresh = handshake > 0 and wall - handshake < FRESH
        if st.path == DIRECT:
            if fresh and endpoint == relay:
                return RELAY  # the other side moved to the relay and the device roamed to it: follow
            return RELAY if not fresh and now - st.since >= DIRECT_GRACE else DIRECT
        slot, into = int(wall // self.interval), wall % self.interval
        if st.path == RELAY:
            if fresh and endpoint and endpoint != relay:
                st.failed_probes = 0
                return DIRECT  # the other side reached us directly and the device roamed to it
            # Not in its first interval on the relay (the direct path just failed); after that, every window (or
            # every 2**failed_probes-th), so the two sides of a pair, whenever each went relayed, try together.
            every = 2 ** min(st.failed_probes, MAX_PROBE_BACKOFF)
            if (into < self.window / 2 and slot != st.probed_slot and slot % every == 0
                    and now - st.relayed_at >= self.interval):
                st.probed_slot = slot
                return PROBING
            return RELAY
        # probing: configured direct until the window is over, or until it is plain that traffic is being lost
        sending = tx - st.tx_at_probe > PROBE_TRAFFIC
        if slot == st.probed_slot and into < self.window:
            if now - st.since >= PROBE_EVIDENCE and sending and rx <= st.rx_at_probe:
                st.failed_probes += 1
                return RELAY
            return PROBING
        if endpoint != relay and rx > st.rx_at_probe and fresh:
            st.failed_probes = 0
            return DIRECT
        if sending:  # a failed probe that cost traffic: wait longer before the next
            st.failed_probes += 1
        return RELAY

    def status(self) -> dict[str, Any]:
        return {pid: {"path": st.path, "switches": st.switches, "last_switch": st.last_switch or None}
                for pid, st in sorted(self.paths.items())}

    def paths_by_peer(self) -> Mapping[str, str]:
        return {pid: st.path for pid, st in self.paths.items()}
