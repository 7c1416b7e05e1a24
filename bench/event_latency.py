"""Event-to-device latency: the admin publishes `peer_added` → the peer is on the node's WireGuard device.

A real `plexd up` runs in a lab namespace with real wireguard-go; the devplane runs on the lab bridge. With
`--peers N`, N peers are put on the device first (a burst of events, then a pause). For each of the measured
events (one at a time) the clock starts before the admin API call (so it includes the devplane signing and fanning
out the event) and stops when the kernel announces the route for the peer's address (see `_route_watch`: plexd
adds it right after the UAPI `set`, so it marks the end of the apply without dumping the device). At the end the
device's own dump is checked to hold every peer.
The path measured: admin HTTP → sign → SSE → parse → Ed25519 verify → nonce + cursor → desired model → delta
apply (one UAPI set for the touched peer, one route).

    sudo .venv/bin/python bench/event_latency.py [--events 200] [--peers 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from _connected_lab import WITHOUT_TELEMETRY, connected_node, preload, random_peer
from _route_watch import RouteWatch


async def device_dump(sock: str) -> str:
    """Raw UAPI `get=1` (what `wg show` reads). The probe only looks for one key, so it skips parsing: a full
    parse of a few hundred peers in a tight loop would steal the CPU the daemon is being timed on."""
    reader, writer = await asyncio.open_unix_connection(sock, limit=1 << 22)
    try:
        writer.write(b"get=1\n\n")
        await writer.drain()
        return (await reader.readuntil(b"\n\n")).decode()
    finally:
        writer.close()


LOAD_FACTOR = max(1.0, float(os.environ.get("PLEXD_TEST_LOAD_FACTOR", "1")))
PUBLISH_CALLS: list[float] = []  # the admin API call alone (the devplane signs and queues the event)


async def measure(n_events: int, n_peers: int, extra_config: str = "", backend: str = "userspace") -> list[float]:
    with connected_node(reconcile="10m", extra_config=extra_config, backend=backend) as node:
        admin = node.dp.admin
        node_id = node.node_id
        await preload(node, n_peers)
        await asyncio.sleep(2)  # let the burst settle (mirror written, bookkeeping committed)
        async with RouteWatch(node.lab_node.netns) as routes:
            warm = random_peer(10_000)  # warm-up: connection set-up is not in the figures
            admin.publish_event(node_id, "peer_added", warm)
            # the first event waits behind the preload's last applies (minutes for wireguard-go on the kernel VM's
            # emulated CPU): the window stretches with the load factor, as the lab's do
            await routes.wait_covered(warm["mesh_ip"], 30 * LOAD_FACTOR)
            latencies = []
            peers = [random_peer(i) for i in range(n_events)]
            for i, peer in enumerate(peers):
                start = time.perf_counter()
                await asyncio.to_thread(admin.publish_event, node_id, "peer_added", peer)
                PUBLISH_CALLS.append(time.perf_counter() - start)
                try:
                    seen = await routes.wait_covered(peer["mesh_ip"], 10)
                except TimeoutError:
                    raise RuntimeError(f"peer {i} did not arrive in 10 s; see {node.workdir}/plexd.log") from None
                latencies.append(seen - start)
                await asyncio.sleep(0.02)  # one event at a time: the latency of one, not of a burst
        on_device = await node.device_keys()
        missing = [p["id"] for p in peers if p["public_key"] not in on_device]
        if missing:
            raise RuntimeError(f"{len(missing)} measured peers are not on the device")
        return latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--peers", type=int, default=0, help="peers put on the device before measuring")
    ap.add_argument("--without-telemetry", action="store_true", help="telemetry off: its share of the outliers")
    ap.add_argument("--backend", choices=("userspace", "kernel"), default="userspace",
                    help="the node's WireGuard (kernel: where the kernel has the module, e.g. python -m bench kernel)")
    args = ap.parse_args()
    lat = sorted(x * 1000 for x in asyncio.run(measure(args.events, args.peers,
                                                        WITHOUT_TELEMETRY if args.without_telemetry else "",
                                                        args.backend)))
    q = statistics.quantiles(lat, n=100, method="inclusive")
    print(f"event → device latency over {len(lat)} peer_added events, {args.peers} peers already on the device")
    print(f"  min {lat[0]:.1f} ms   p50 {statistics.median(lat):.1f} ms   p90 {q[89]:.1f} ms   "
          f"p99 {q[98]:.1f} ms   max {lat[-1]:.1f} ms")
    pub = sorted(x * 1000 for x in PUBLISH_CALLS)
    print(f"  of which the admin API call (devplane: sign, store, queue): p50 {statistics.median(pub):.1f} ms")
    print("  goal: p99 <= 10 ms at every N")


if __name__ == "__main__":
    main()
