"""A burst of events: N `peer_added` published back to back → time until the last peer is on the device, and the
CPU plexd spent on it.

A real `plexd up` in a lab namespace with real wireguard-go, the devplane on the lab bridge (the same setup as
event_latency). With `--peers N`, N peers are put on the device first. The clock starts before the first publish
and stops when the kernel announces the route of the last peer's address (plexd adds it right after the UAPI
`set` that carries the peer; see `_route_watch`); the device's own dump is then checked to hold every peer of the
burst. plexd's user+system CPU is read from /proc before the first publish and when the last peer arrived.

    sudo .venv/bin/python bench/event_burst.py [--events 1000] [--peers 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from _connected_lab import connected_node, preload, random_peer
from _route_watch import RouteWatch
from event_latency import device_dump

from plexd.machine.wireguard.uapi import b64_to_hex


async def measure(n_events: int, n_peers: int) -> tuple[float, float, float]:
    with connected_node(reconcile="10m") as node:
        sock = f"{node.lab_node.sock_dir}/plexd0.sock"
        admin = node.dp.admin
        await preload(node, n_peers)
        await asyncio.sleep(3)  # the preload settled: mirror and bookkeeping committed
        async with RouteWatch(node.lab_node.netns) as routes:
            warm = random_peer(9_999)  # (its mesh IP must stay a valid address: 10.101.39.250)
            admin.publish_event(node.node_id, "peer_added", warm)
            await routes.wait_covered(warm["mesh_ip"], 30)
            peers = [random_peer(i) for i in range(n_events)]
            cpu0 = node.cpu_seconds()
            start = time.perf_counter()

            def publish_all() -> float:
                for peer in peers:
                    admin.publish_event(node.node_id, "peer_added", peer)
                return time.perf_counter() - start

            published = await asyncio.to_thread(publish_all)
            try:
                seen = await routes.wait_covered(peers[-1]["mesh_ip"], 300)
            except TimeoutError:
                raise RuntimeError(f"the last peer did not arrive in 300 s; see {node.workdir}/plexd.log") from None
            cpu = node.cpu_seconds() - cpu0
        dump = await device_dump(sock)
        missing = [p["id"] for p in peers if f"public_key={b64_to_hex(p['public_key'])}" not in dump]
        if missing:
            raise RuntimeError(f"{len(missing)} peers of the burst are not on the device, e.g. {missing[:3]}")
        return published, seen - start, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1000)
    ap.add_argument("--peers", type=int, default=0, help="peers put on the device before the burst")
    args = ap.parse_args()
    published, took, cpu = asyncio.run(measure(args.events, args.peers))
    print(f"burst of {args.events} peer_added events on {args.peers} peers: published in {published:.2f} s, "
          f"last peer on the device after {took:.2f} s, plexd CPU {cpu:.2f} s")
    print("  goal at 1,000 peers: <= 1.5 s and <= 1 CPU-s")


if __name__ == "__main__":
    main()
