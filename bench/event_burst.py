"""A burst of events: N `peer_added` published back to back → time until the last peer is on the device, and the
CPU plexd spent on it.

A real `plexd up` in a lab namespace with real wireguard-go, the devplane on the lab bridge (the same setup as
event_latency). The clock starts before the first publish and stops when the last peer shows in the device's UAPI
dump; plexd's user+system CPU is read from /proc before the first publish and after the last peer arrived.

    sudo .venv/bin/python bench/event_burst.py [--events 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from _connected_lab import connected_node, random_peer
from event_latency import on_device


async def measure(n_events: int) -> tuple[float, float, float]:
    with connected_node(reconcile="10m") as node:
        sock = f"{node.lab_node.sock_dir}/plexd0.sock"
        admin = node.dp.admin
        warm = random_peer(9_999)  # (its mesh IP must stay a valid address: 10.101.39.250)
        admin.publish_event(node.node_id, "peer_added", warm)
        deadline = time.perf_counter() + 30
        while not await on_device(sock, warm["public_key"]):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the warm-up peer did not arrive; see {node.workdir}/plexd.log")
            await asyncio.sleep(0.01)
        peers = [random_peer(i) for i in range(n_events)]
        cpu0 = node.cpu_seconds()
        start = time.perf_counter()

        def publish_all() -> float:
            for peer in peers:
                admin.publish_event(node.node_id, "peer_added", peer)
            return time.perf_counter() - start

        published = await asyncio.to_thread(publish_all)
        deadline = time.perf_counter() + 300
        while not await on_device(sock, peers[-1]["public_key"]):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the last peer did not arrive in 300 s; see {node.workdir}/plexd.log")
            await asyncio.sleep(0.01)
        took = time.perf_counter() - start
        return published, took, node.cpu_seconds() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1000)
    args = ap.parse_args()
    published, took, cpu = asyncio.run(measure(args.events))
    print(f"burst of {args.events} peer_added events: published in {published:.2f} s, last peer on the device "
          f"after {took:.2f} s, plexd CPU {cpu:.2f} s")


if __name__ == "__main__":
    main()
