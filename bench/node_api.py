"""Node API throughput: `GET /v1/state/metadata` over the daemon's socket, N concurrent clients, requests per second
and latency percentiles, while the daemon holds `--peers` peers on its device.

A real `plexd up` in a lab namespace (real wireguard-go, real devplane); the peers are put on the device first by
a burst of events. Each client is its own process (so the clients' Python does not share one GIL with the
measurement) on one keep-alive HTTP/1.1 connection, sending a request as soon as the last answer is read. Latency
is measured per request by the client, from sending the request to reading the whole answer.

By default the rate limit is off (`rate_limit: 0`), to measure the server; `--rate-limit default` keeps the
shipped limit (100/s per uid, burst 200): all clients run as root, so they share one bucket, and the refused
requests (429, answered after a quarter second) show what a runaway client costs the daemon.

    sudo .venv/bin/python -m bench node_api [--clients 10] [--seconds 10] [--peers 1000] [--rate-limit off|default]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _connected_lab import connected_node, preload

REQUEST = b"GET /v1/state/metadata HTTP/1.1\r\nHost: localhost\r\n\r\n"


def client(sock_path: str, seconds: float, start_at: float, out: multiprocessing.Queue) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    while time.time() < start_at:
        time.sleep(0.001)
    end = time.perf_counter() + seconds
    buf = b""
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        s.sendall(REQUEST)
        while True:  # one answer: headers, then content-length bytes
            head_end = buf.find(b"\r\n\r\n")
            if head_end >= 0:
                head = buf[:head_end].decode("latin-1")
                length = next(int(line.split(":", 1)[1]) for line in head.split("\r\n")
                              if line.lower().startswith("content-length:"))
                if len(buf) >= head_end + 4 + length:
                    buf = buf[head_end + 4 + length:]
                    break
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("the daemon closed the connection")
            buf += chunk
        latencies.append(time.perf_counter() - t0)
        code = head.split(" ", 2)[1]
        statuses[code] = statuses.get(code, 0) + 1
    s.close()
    out.put((latencies, statuses))


def measure(sock_path: str, clients: int, seconds: float) -> tuple[list[float], dict[str, int]]:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 0.5
    procs = [ctx.Process(target=client, args=(sock_path, seconds, start_at, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(10)
    latencies = [x for lat, _ in results for x in lat]
    statuses: dict[str, int] = {}
    for _, st in results:
        for code, n in st.items():
            statuses[code] = statuses.get(code, 0) + n
    return latencies, statuses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--rate-limit", choices=("off", "default"), default="off")
    args = ap.parse_args()
    extra = "rate_limit: 0" if args.rate_limit == "off" else ""
    with connected_node(reconcile="1h", node_api=extra) as node:
        took = asyncio.run(preload(node, args.peers))
        node.dp.admin.set_metadata(node.node_id, {f"key{i}": f"value-{i}" for i in range(20)})
        time.sleep(1)
        cpu0 = node.cpu_seconds()
        lat, statuses = measure(str(node.api_socket), args.clients, args.seconds)
        cpu = node.cpu_seconds() - cpu0
        rss = node.rss_mib()
    lat_ms = sorted(x * 1000 for x in lat)
    q = statistics.quantiles(lat_ms, n=100, method="inclusive")
    print(f"GET /v1/state/metadata over the socket: {args.clients} clients for {args.seconds:g}s, "
          f"{args.peers} peers on the device (preloaded in {took:.1f}s), rate limit {args.rate_limit}")
    print(f"  {len(lat_ms) / args.seconds:,.0f} requests/s   statuses {dict(sorted(statuses.items()))}")
    print(f"  latency p50 {statistics.median(lat_ms):.2f} ms   p90 {q[89]:.2f} ms   p99 {q[98]:.2f} ms   "
          f"max {lat_ms[-1]:.2f} ms")
    print(f"  daemon CPU {cpu / args.seconds * 100:.0f}% of one core, RSS {rss:.0f} MiB")
    print("  goal: >= 2,000 requests/s and p99 <= 10 ms with 10 clients at 1,000 peers")


if __name__ == "__main__":
    main()
