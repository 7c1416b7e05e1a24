"""Control-plane headroom: registration throughput, then one event fanned out to N open SSE streams.

    .venv/bin/python -m bench.devplane_bench [--nodes 1000] [--concurrency 32]

A real `plexd-devplane serve` process (started through the test harness) on loopback:

1. N registrations over HTTP (concurrent clients). Every deployment starts with the `*`<->`*` policy, so
   registration k also returns k-1 peers and sends `peer_added` to k-1 nodes: the cost is the real full-mesh
   cost, not an empty insert.
2. N SSE streams held open by raw asyncio sockets (a light client, so the bench measures the server). The
   devplane admits stream opens at a steady rate and answers the rest 503 + Retry-After
   (`plexd.devplane.admission`); the bench honours it as plexd does, and reports how many were told to wait.
3. One admin broadcast event, then one more registration (a real `peer_added` to all N): time from the request
   to the moment the event's `id:` line has arrived on every stream (p50 / p99 / max).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import resource
import tempfile
import time
from urllib.parse import urlsplit

import httpx

from plexd.devplane.harness import Devplane


def raise_fd_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def register_all(url: str, tokens: list[str], concurrency: int) -> tuple[list[dict], list[float], float]:
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    nodes: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def one(i: int, token: str) -> None:
            body = {"token": token, "public_key": base64.b64encode(os.urandom(32)).decode(), "hostname": f"b-{i}"}
            async with sem:
                start = time.perf_counter()
                resp = await client.post("/v1/register", json=body, headers={"Authorization": f"Bearer {token}"})
                latencies.append(time.perf_counter() - start)
            resp.raise_for_status()
            nodes.append(resp.json())

        start = time.perf_counter()
        await asyncio.gather(*(one(i, t) for i, t in enumerate(tokens)))
        elapsed = time.perf_counter() - start
    return nodes, latencies, elapsed


class Stream:
    """One SSE stream over a raw socket; records when a given event id shows up."""

    def __init__(self, node: dict) -> None:
        self.node = node
        self.buf = b""
        self.arrived: dict[bytes, float] = {}
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None
        self.refusals = 0

    async def open(self, host: str, port: int, last_event_id: str) -> None:
        """Open the stream; a 503 with Retry-After (load shedding) is waited out and tried again."""
        while (wait := await self._try_open(host, port, last_event_id)) is not None:
            self.refusals += 1
            await asyncio.sleep(wait * (0.75 + random.random() / 2))  # jittered, as plexd's own backoff

    async def _try_open(self, host: str, port: int, last_event_id: str) -> float | None:
        self.reader, self.writer = await asyncio.open_connection(host, port)
        self.writer.write(
            f"GET /v1/nodes/{self.node['node_id']}/events HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {self.node['node_secret_key']}\r\nAccept: text/event-stream\r\n"
            f"Last-Event-ID: {last_event_id}\r\n\r\n".encode())
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 503"):
            self.writer.close()
            retry = next((line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                          if line.lower().startswith(b"retry-after:")), b"1")
            return float(retry) if retry.isdigit() else 1.0
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"stream refused: {head[:80]!r}")
        self.task = asyncio.create_task(self._read())
        return None

    async def _read(self) -> None:
        assert self.reader is not None
        while True:
            chunk = await self.reader.read(65536)
            if not chunk:
                return
            now = time.perf_counter()
            self.buf += chunk
            start = 0
            while (i := self.buf.find(b"id: evt_", start)) != -1:
                end = self.buf.find(b"\n", i)
                if end == -1:
                    break
                self.arrived.setdefault(self.buf[i + 4:end], now)
                start = end
            self.buf = self.buf[start:]

    def close(self) -> None:
        if self.task:
            self.task.cancel()
        if self.writer:
            self.writer.close()


async def fan_out(dp: Devplane, streams: list[Stream], trigger, label: str) -> dict[str, float]:
    last = dp.admin.status()["last_event_id"]
    target = f"evt_{int(last.split('_')[1]) + 1}".encode()
    start = time.perf_counter()
    await asyncio.to_thread(trigger)
    deadline = start + 60
    while time.perf_counter() < deadline and any(target not in s.arrived for s in streams):
        await asyncio.sleep(0.002)
    missing = sum(1 for s in streams if target not in s.arrived)
    delays = [s.arrived[target] - start for s in streams if target in s.arrived]
    out = {"p50_ms": pct(delays, 50) * 1000, "p99_ms": pct(delays, 99) * 1000, "all_ms": max(delays) * 1000,
           "missing": missing}
    print(f"  {label}: delivered to {len(delays)}/{len(streams)} streams; p50 {out['p50_ms']:.1f} ms, "
          f"p99 {out['p99_ms']:.1f} ms, all {out['all_ms']:.1f} ms")
    return out


async def run(nodes_wanted: int, concurrency: int) -> None:
    raise_fd_limit(nodes_wanted * 2 + 1024)
    with tempfile.TemporaryDirectory(prefix="plexd-bench-") as tmp, \
            Devplane(tmp, heartbeat_interval="1h", keepalive="15s") as dp:
        t0 = time.perf_counter()
        tokens = [dp.admin.create_token() for _ in range(nodes_wanted + 1)]
        print(f"devplane {dp.url}; {len(tokens)} bootstrap tokens created in {time.perf_counter() - t0:.2f} s")

        nodes, latencies, elapsed = await register_all(dp.url, tokens[:nodes_wanted], concurrency)
        print(f"registrations: {len(nodes)} in {elapsed:.2f} s = {len(nodes) / elapsed:.0f}/s "
              f"(concurrency {concurrency}); latency p50 {pct(latencies, 50) * 1000:.1f} ms, "
              f"p99 {pct(latencies, 99) * 1000:.1f} ms  [full mesh: peer lists and peer_added grow with N]")

        parts = urlsplit(dp.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        last = dp.admin.status()["last_event_id"]
        streams = [Stream(n) for n in nodes]
        t0 = time.perf_counter()
        for i in range(0, len(streams), 100):
            await asyncio.gather(*(s.open(host, port, last) for s in streams[i:i + 100]))
        while dp.admin.status()["streams"] < len(streams):
            await asyncio.sleep(0.05)
        print(f"streams: {len(streams)} open in {time.perf_counter() - t0:.2f} s "
              f"({sum(s.refusals for s in streams)} opens told to come back later by the load shedding)")
        try:
            await fan_out(dp, streams, lambda: dp.admin.broadcast_event("bench", {"n": 1}),
                          "one admin event to all")
            last_token = tokens[-1]

            def register_one() -> None:
                httpx.post(f"{dp.url}/v1/register", timeout=60, headers={"Authorization": f"Bearer {last_token}"},
                           json={"token": last_token, "public_key": base64.b64encode(os.urandom(32)).decode(),
                                 "hostname": "late"}).raise_for_status()

            await fan_out(dp, streams, register_one, "peer_added of a new node to all")
        finally:
            for s in streams:
                s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(run(args.nodes, args.concurrency))


if __name__ == "__main__":
    main()
