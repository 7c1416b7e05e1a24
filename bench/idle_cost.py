"""Idle cost: CPU seconds per minute (and RSS) of a connected `plexd up` with 100 peers and no events.

The daemon runs with its default timings (heartbeat 30 s, reconcile 60 s, SSE keepalives from the devplane every
15 s) in a lab namespace with real wireguard-go; the 100 peers are real registered nodes of the devplane (so every
reconcile keeps them). After the device holds all of them and a warm-up, the plexd process's user+system CPU is
read from /proc before and after the measurement window. wireguard-go's own CPU is shown separately (it is not
plexd's code; the peers' endpoints are on the lab bridge where nothing answers, so it keeps retrying handshakes).
After the window, 20 reconcile cycles run back to back through the daemon's socket give the CPU of one cycle (what
the 60 s reconcile costs an idle node).

    sudo .venv/bin/python bench/idle_cost.py [--peers 100] [--seconds 120]
    sudo .venv/bin/python bench/idle_cost.py --peers 1000 --seconds 300    # idle after the burst of 1,000 joins
    sudo .venv/bin/python bench/idle_cost.py --peers 1000 --without-telemetry   # the daemon without its telemetry
    sudo .venv/bin/python bench/idle_cost.py --peers 10000 --seconds 30 --via-events   # RSS with 10,000 peers
    sudo .venv/bin/python bench/idle_cost.py --peers 1000 --config 'telemetry: {metrics: {latency_peers: 0}}'
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import subprocess
import time
from dataclasses import dataclass

import httpx
from _connected_lab import WITHOUT_TELEMETRY, _cpu, connected_node, preload
from nacl.public import PrivateKey

from plexd.machine.wireguard.uapi import UapiClient
from plexd.node.control import RECONCILE_PATH
from plexd.node.control_client import call


def wireguard_go_pid(netns: str) -> int | None:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    for pid in out:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"wireguard-go" in f.read():
                    return int(pid)
        except OSError:
            continue
    return None


@dataclass
class IdleRun:
    seconds: float
    plexd_cpu: float  # CPU seconds in the window
    wg_cpu: float
    rss_mib: float
    peers_at_end: int
    heartbeats: int
    snapshot: str | None
    workdir: str
    rss_parts: list[tuple[str, float]]  # MiB per mapping, largest first
    reconcile_cpu: float | None  # CPU seconds of one reconcile cycle (after the window); None: not measured
    settled: bool  # the warm-up ended with the daemon quiet (False: it was still busy when the warm-up gave up)
    requests: dict[str, int]  # the node's requests to the control plane in the window, by route

    def requests_per_hour(self) -> list[tuple[str, float]]:
        """The window's requests scaled to an hour, most first."""
        scale = 3600 / self.seconds
        return sorted(((route, n * scale) for route, n in self.requests.items()), key=lambda kv: -kv[1])

    @property
    def per_minute(self) -> float:
        return self.plexd_cpu / (self.seconds / 60)


async def settle(node, *, quiet_cpu: float = 0.05, every: float = 5.0, limit: float = 300.0) -> bool:
    """Warm-up: until the daemon used less than `quiet_cpu` CPU seconds in `every` seconds, so the window measures
    the idle daemon and not the tail of the join burst (a slowed-down daemon, under tracemalloc for example, can
    still be applying queued events when the device already has every peer from a state pull). False when the
    daemon was still busy after `limit` seconds (the window is measured anyway, and the report says so)."""
    deadline = time.monotonic() + limit
    while True:
        before = node.cpu_seconds()
        await asyncio.sleep(every)
        if node.cpu_seconds() - before < quiet_cpu:
            return True
        if time.monotonic() > deadline:
            return False


def reconcile_cpu(node, cycles: int = 20) -> float:
    """CPU seconds of one reconcile cycle, averaged over `cycles` run back to back through the daemon's socket
    (`POST /v1/daemon/reconcile`, what `plexd reconcile` sends; the socket's own request handling is included)."""
    before = node.cpu_seconds()
    for _ in range(cycles):
        call(str(node.api_socket), "POST", RECONCILE_PATH, {"dry_run": False}, timeout=60)
    return (node.cpu_seconds() - before) / cycles


async def idle_run(peers: int, seconds: float, *, via_events: bool = False, extra_config: str = "") -> IdleRun:
    """A connected daemon with `peers` real peers, measured idle for `seconds` after a warm-up."""
    # The registered peers never heartbeat: the devplane is told to expect one an hour, or it would take them
    # offline (peer_removed for all of them) 5 minutes in, and the window would measure that burst.
    with connected_node(reconcile="10m" if via_events else "60s", peer_heartbeat="1h",
                        extra_config=extra_config) as node:
        if via_events:
            await preload(node, peers)
        with httpx.Client(base_url=node.dp.url, timeout=30) as http:
            for i in range(0 if via_events else peers):
                token = node.dp.admin.create_token()
                pub = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
                r = http.post("/v1/register", headers={"Authorization": f"Bearer {token}"},
                              json={"token": token, "public_key": pub, "hostname": f"idle-{i}"})
                r.raise_for_status()
                # An endpoint on the lab bridge where nothing listens: wireguard-go sends its handshakes there
                # (peers without any endpoint make it log an error per peer and packet instead).
                node.dp.admin.set_node_endpoint(r.json()["node_id"], f"{node.lab.bridge_address}:{40000 + i}")
        uapi = UapiClient("plexd0", socket_dir=node.lab_node.sock_dir)
        deadline = time.monotonic() + 300
        # Each registration is a peer_added and then a peer_endpoint_changed event: the window starts after the
        # last of them is applied.
        while (have := sum(1 for p in (await uapi.get()).peers.values() if p.endpoint or via_events)) < peers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {have} of {peers} peers reached the device with their endpoint")
            await asyncio.sleep(0.2)
        settled = await settle(node)
        wg_pid = wireguard_go_pid(node.lab_node.netns)
        node.dp.admin.clear_requests()
        plexd0, wg0, t0 = node.cpu_seconds(), _cpu(wg_pid) if wg_pid else 0.0, time.monotonic()
        await asyncio.sleep(seconds)
        plexd1, wg1, t1 = node.cpu_seconds(), _cpu(wg_pid) if wg_pid else 0.0, time.monotonic()
        requests = node.dp.admin.requests().get(node.node_id, {})
        still = len((await uapi.get()).peers)  # the window was idle only if no peer came or went
        heartbeats = len(node.dp.admin.heartbeats(node.node_id))
        rss, rss_parts = node.rss_mib(), node.rss_by_mapping()
        snap, workdir = node.tracemalloc_snapshot(), node.workdir
        # With --via-events the control plane does not hold the preloaded peers: a state pull would remove them all,
        # which is no idle cycle.
        per_cycle = None
        if not via_events:
            try:
                per_cycle = await asyncio.to_thread(reconcile_cpu, node)
            except Exception as exc:  # an extra figure: its failure must not cost the window's
                print(f"  (reconcile cycles not measured: {exc})")
    return IdleRun(t1 - t0, plexd1 - plexd0, wg1 - wg0, rss, still, heartbeats, snap, str(workdir), rss_parts,
                   per_cycle, settled, requests)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--via-events", action="store_true",
                    help="put the peers on the device as peer_added events (no registrations, reconcile 10 min): "
                         "fast at 10,000 peers, for the RSS figure; the CPU figure then has no reconcile in it")
    ap.add_argument("--without-telemetry", action="store_true",
                    help="telemetry off (metrics, logs, audit): how much of the idle cost is the daemon itself")
    ap.add_argument("--config", default="", metavar="YAML",
                    help="more daemon configuration, as YAML (what one setting costs: run with and without it)")
    args = ap.parse_args()
    extra = (WITHOUT_TELEMETRY if args.without_telemetry else "") + (args.config + "\n" if args.config else "")
    run = await idle_run(args.peers, args.seconds, via_events=args.via_events, extra_config=extra)
    print(f"connected plexd up, {args.peers} peers, no events{', telemetry off' if args.without_telemetry else ''}"
          f"{', with ' + args.config if args.config else ''}, "
          f"{run.seconds:.0f} s window "
          f"(heartbeat 30 s, reconcile 60 s, keepalive 15 s; {run.heartbeats} heartbeats in total)")
    print(f"  plexd:        {run.per_minute:.3f} CPU s/min   (goal <= 0.1)")
    print(f"  plexd RSS:    {run.rss_mib:.1f} MiB with {run.peers_at_end} peers on the device at the end   "
          "(goal <= 50 MB at 1,000, <= 100 MB at 10,000)")
    print("  RSS by mapping (MiB): " + ", ".join(f"{name} {mib:.1f}" for name, mib in run.rss_parts))
    if not run.settled:
        print("  WARNING: the daemon was still busy when the warm-up gave up: the window may hold the join burst")
    per_hour = run.requests_per_hour()
    print(f"  requests to the control plane: {sum(n for _, n in per_hour):.0f} per hour   (goal <= 150; the window's "
          "count scaled to an hour)")
    for route, n in per_hour:
        print(f"    {n:7.0f}  {route}")
    if run.reconcile_cpu is not None:
        print(f"  one reconcile cycle: {run.reconcile_cpu * 1000:.1f} ms CPU   (after the window: 20 cycles back to "
              "back through the daemon's socket, unchanged state; the state pull and the socket request included)")
    if run.snapshot is not None:
        print(f"  tracemalloc snapshot (taken after the RSS reading): {run.snapshot}; allocator stats in "
              f"{run.workdir}/plexd.log")
    if run.wg_cpu:
        print(f"  wireguard-go: {run.wg_cpu / (run.seconds / 60):.3f} CPU s/min   (not plexd's code)")


if __name__ == "__main__":
    asyncio.run(main())
