"""Reconnect storm: N connected event-stream clients, the control plane restarts, how do they come back?

Each client is the real `plexd.controlplane.event_stream.EventStream` (same backoff, jitter, storm limit and watchdog as
the daemon) with its own HTTP connection and a registered node, all in one process; the control plane is a real
`plexd-devplane` process. After every client is connected, the devplane is restarted (SIGTERM, or SIGKILL with
--kill) and restarted on the same port; we record when each client is connected again and how many connection
attempts the devplane had to absorb.

    .venv/bin/python bench/reconnect_storm.py [--clients 1000] [--kill] [--down 3]

The clients use the daemon's defaults (`sse.*` of `plexd.config.settings`): the lifecycle's backoff (docs/decisions.md,
Lifecycle) for ordinary failures, a random 0-5 s before the first reconnect after a stream closes, Retry-After spread by
up to 50 %. The devplane sheds stream opens beyond 5 % of its fleet per second with 503 + Retry-After
(`plexd.devplane.admission`).

Figures: arrival spread of the reconnects after the devplane is back (p50/p90/max, per-second histogram with the
share of the fleet), the attempt count while it was down, and the devplane's peak request rate (stream opens per
second, admitted or shed) — the load a storm puts on a recovering control plane. Goals: no second sees more than
10 % of the clients come back, all are back within 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from nacl.public import PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plexd.base.clock import Clock
from plexd.config.settings import SseConfig
from plexd.controlplane.event_signing import NonceStore, Verifier
from plexd.controlplane.event_stream import EventStream
from plexd.devplane.harness import Devplane
from plexd.state.model import SigningKeys


def register(dp: Devplane, n: int) -> list[dict]:
    nodes = []
    with httpx.Client(base_url=dp.url, timeout=30) as http:
        for i in range(n):
            token = dp.admin.create_token()
            pub = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
            r = http.post("/v1/register", headers={"Authorization": f"Bearer {token}"},
                          json={"token": token, "public_key": pub, "hostname": f"storm-{i}"})
            r.raise_for_status()
            nodes.append(r.json())
    return nodes


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--kill", action="store_true", help="SIGKILL the devplane instead of a graceful stop")
    ap.add_argument("--down", type=float, default=3.0, help="seconds the devplane stays down")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)

    with tempfile.TemporaryDirectory(prefix="plexd-storm-") as tmp, Devplane(Path(tmp) / "dp") as dp:
        t0 = time.perf_counter()
        nodes = register(dp, args.clients)
        print(f"registered {len(nodes)} nodes in {time.perf_counter() - t0:.1f} s")
        clock = Clock()
        arrivals: list[list[float]] = [[] for _ in nodes]
        streams = []

        async def _ignore(env) -> None:
            return None

        for i, node in enumerate(nodes):
            data_dir = Path(tmp) / f"n{i}"
            data_dir.mkdir()
            verifier = Verifier(SigningKeys(current=node["signing_public_key"]), NonceStore(clock), clock)
            stream = EventStream(dp.url, node["node_id"], (lambda s=node["node_secret_key"]: s), data_dir, verifier,
                                 _ignore, clock=clock, reconnect_spread=SseConfig().reconnect_spread,
                                 on_connected=(lambda i=i: arrivals[i].append(time.perf_counter())))
            streams.append(stream)
        tasks = [asyncio.create_task(s.run()) for s in streams]
        t0 = time.perf_counter()
        while not all(s.connected.is_set() for s in streams):
            await asyncio.sleep(0.05)
        print(f"{len(streams)} clients connected in {time.perf_counter() - t0:.2f} s")
        await asyncio.sleep(1.0)

        attempts_before = sum(s.attempts for s in streams)
        rate_samples: list[tuple[float, int]] = []

        async def sample_attempts() -> None:
            while True:
                rate_samples.append((time.perf_counter(), sum(s.attempts for s in streams)))
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample_attempts())
        t_down = time.perf_counter()
        await asyncio.to_thread(dp.kill if args.kill else dp.stop)
        await asyncio.sleep(args.down)
        await asyncio.to_thread(dp.start)
        t_up = time.perf_counter()
        attempts_down = sum(s.attempts for s in streams) - attempts_before
        while not all(len(a) >= 2 for a in arrivals):
            if time.perf_counter() - t_up > 180:
                break
            await asyncio.sleep(0.05)
        back = sorted(a[1] - t_up for a in arrivals if len(a) >= 2)
        attempts_total = sum(s.attempts for s in streams) - attempts_before
        sampler.cancel()
        peak_rate = max((b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(rate_samples, rate_samples[10:], strict=False)
                        if b[0] > t_up)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    print(f"\ndevplane {'killed' if args.kill else 'stopped'} for {t_up - t_down:.2f} s "
          f"(down {args.down:.1f} s + start)")
    print(f"connection attempts while it was down: {attempts_down} ({attempts_down / len(streams):.1f} per client)")
    print(f"attempts until all were back: {attempts_total} ({attempts_total / len(streams):.1f} per client)")
    print(f"clients back: {len(back)}/{len(streams)}")
    print(f"devplane peak request rate after it was back: {peak_rate:.0f} stream opens/s "
          f"(1 s sliding window, admitted or shed)")
    if back:
        q = statistics.quantiles(back, n=10) if len(back) > 1 else [back[0]] * 9
        print(f"reconnect after the devplane was back: min {back[0]:.2f} s  p50 {statistics.median(back):.2f} s  "
              f"p90 {q[8]:.2f} s  max {back[-1]:.2f} s")
        print("arrivals per second after the devplane was back:")
        buckets: dict[int, int] = {}
        for b in back:
            buckets[int(max(b, 0))] = buckets.get(int(max(b, 0)), 0) + 1
        peak = max(buckets.values())
        for sec in range(int(max(back[-1], 0)) + 1):
            n = buckets.get(sec, 0)
            print(f"  {sec:3d}-{sec + 1:<3d}s {n:4d} {100 * n / len(streams):5.1f} % "
                  f"{'#' * max(1 if n else 0, round(50 * n / peak))}")
        print(f"busiest second: {100 * peak / len(streams):.1f} % of the clients (goal <= 10 %); "
              f"last back after {back[-1]:.1f} s (goal <= 30 s)")


if __name__ == "__main__":
    asyncio.run(main())
