"""Event-to-device latency: the admin publishes `peer_added` → the peer is on the node's WireGuard device.

A real `plexd up` runs in a lab namespace with real wireguard-go; the devplane runs on the lab bridge. For each of
N events (sequentially) the clock starts before the admin API call (so it includes the devplane signing and
fanning out the event) and stops when the peer shows up in the device's UAPI `get=1` dump — the same data
`wg show` prints, read directly from the node's socket (probed every ~1 ms) rather than by spawning `wg`.
The path measured: admin HTTP → sign → SSE → parse → Ed25519 verify → nonce + cursor persisted (fsync) →
desired model → converge (observe device and link, one UAPI set, one route).

    sudo .venv/bin/python bench/event_latency.py [--events 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from _connected_lab import connected_node, random_peer

from plexd.mesh.wireguard.uapi import b64_to_hex


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


async def on_device(sock: str, public_key: str) -> bool:
    return f"public_key={b64_to_hex(public_key)}\n" in await device_dump(sock)


async def measure(n_events: int) -> list[float]:
    with connected_node(reconcile="10m") as node:
        sock = f"{node.lab_node.sock_dir}/plexd0.sock"
        admin = node.dp.admin
        node_id = node.node_id
        # warm-up: one event, so connection set-up is not in the figures
        warm = random_peer(10_000)
        admin.publish_event(node_id, "peer_added", warm)
        while not await on_device(sock, warm["public_key"]):
            await asyncio.sleep(0.001)
        latencies = []
        for i in range(n_events):
            peer = random_peer(i)
            start = time.perf_counter()
            await asyncio.to_thread(admin.publish_event, node_id, "peer_added", peer)
            deadline = start + 10
            while not await on_device(sock, peer["public_key"]):
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"peer {i} did not reach the device in 10 s; see {node.workdir}/plexd.log")
                await asyncio.sleep(0.001)
            latencies.append(time.perf_counter() - start)
        return latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200)
    args = ap.parse_args()
    lat = sorted(x * 1000 for x in asyncio.run(measure(args.events)))
    q = statistics.quantiles(lat, n=100)
    print(f"event → device latency over {len(lat)} peer_added events (device grows from 1 to {len(lat) + 1} peers)")
    print(f"  min {lat[0]:.1f} ms   p50 {statistics.median(lat):.1f} ms   p90 {q[89]:.1f} ms   "
          f"p99 {q[98]:.1f} ms   max {lat[-1]:.1f} ms")
    print("  goal: p99 <= 50 ms on loopback")


if __name__ == "__main__":
    main()
