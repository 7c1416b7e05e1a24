"""Telemetry backlog: how long a node takes to deliver 10 minutes of telemetry queued while the control plane was
away, and what queueing it cost.

    .venv/bin/python -m bench.telemetry_backlog [--peers 100] [--minutes 10] [--log-rate 10] [--audit-rate 5]

A real `plexd-devplane serve` on loopback and one registered node. The telemetry lanes of an uplink outbox
(plexd.telemetry.queue, a real SQLite file) are filled with what the collectors make in `--minutes` at the default
intervals: metrics every 15 s for `--peers` peers (system + tunnel and latency per peer), `--log-rate` log lines
and `--audit-rate` audit events per second. Then the outbox delivers the three lanes (batches of 1,000 / 200 /
500, gzip above 1 KiB, the node's bearer secret) into the devplane, which stores every batch; the clock stops when
all three lanes are empty.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import tempfile
import time
from pathlib import Path

import httpx

from plexd.base.gojson import EncodedJSON
from plexd.controlplane.client import ControlPlaneClient
from plexd.controlplane.uplink import UplinkOutbox
from plexd.devplane.harness import Devplane
from plexd.machine.wireguard import PeerCounters
from plexd.state.model import Peer
from plexd.telemetry.auditd import audit_entry, parse_record
from plexd.telemetry.points import MetricPoints
from plexd.telemetry.queue import TelemetryQueue, lane
from plexd.telemetry.system import SystemSampler

AUDIT = [
    'type=SYSCALL msg=audit(1700000000.123:4242): arch=c000003e syscall=257 success=no exit=-13 items=1 ppid=700 '
    'pid=812 auid=1000 uid=1000 gid=1001 comm="cat" exe="/usr/bin/cat" key="shadow"',
    'type=PATH msg=audit(1700000000.123:4242): item=0 name="/etc/shadow" nametype=NORMAL',
]


def fill(queue: TelemetryQueue, peers: int, minutes: float, log_rate: float, audit_rate: float) -> dict[str, int]:
    keys = {f"n_{i}": base64.b64encode(os.urandom(32)).decode() for i in range(peers)}
    desired = {pid: Peer(pid, key, f"10.100.{i // 250}.{i % 250 + 1}") for i, (pid, key) in enumerate(keys.items())}
    now = time.time()
    device = {key: PeerCounters(now - 30, 123456, 654321) for key in keys.values()}
    sampler = SystemSampler()
    counts = {"metrics": 0, "logs": 0, "audit": 0}
    seconds = int(minutes * 60)
    audit = audit_entry([parse_record(line) for line in AUDIT], "bench-node")
    for second in range(seconds):
        stamp = f"2026-11-23T10:{second // 60 % 60:02d}:{second % 60:02d}Z"
        if second % 15 == 0:
            points = MetricPoints().texts(stamp, sampler.sample(), device, desired,
                                          {pid: 420_000 for pid in desired}, now)
            queue.append_texts("metrics", points)
            counts["metrics"] += len(points)
        logs = [{"timestamp": stamp, "source": "journald", "unit": "sshd", "severity": "info",
                 "hostname": "bench-node", "message": f"Accepted publickey for deploy from 203.0.113.{n} port 22"}
                for n in range(int(log_rate))]
        queue.append("logs", logs)
        counts["logs"] += len(logs)
        events = [audit | {"timestamp": stamp}] * int(audit_rate)
        queue.append("audit", events)
        counts["audit"] += len(events)
    return counts


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=100)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--log-rate", type=float, default=10.0)
    ap.add_argument("--audit-rate", type=float, default=5.0)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="plexd-bench-telemetry-"))
    dp = Devplane(workdir / "dp", listen="127.0.0.1:0")
    dp.start()
    try:
        token = dp.admin.create_token()
        resp = httpx.post(f"{dp.url}/v1/register", headers={"Authorization": f"Bearer {token}"}, timeout=30,
                          json={"token": token, "public_key": base64.b64encode(os.urandom(32)).decode(),
                                "hostname": "bench-node"})
        resp.raise_for_status()
        node_id, secret = resp.json()["node_id"], resp.json()["node_secret_key"]
        async def no_other_lane(kind, body):
            raise RuntimeError(f"no lane for {kind}")

        box = UplinkOutbox(workdir / "uplink.db", no_other_lane)
        queue = TelemetryQueue(box, {"metrics": 32 << 20, "logs": 64 << 20, "audit": 64 << 20})
        start = time.perf_counter()
        counts = fill(queue, args.peers, args.minutes, args.log_rate, args.audit_rate)
        filled = time.perf_counter() - start
        size = sum(queue.status(s)["bytes"] for s in counts)
        async with ControlPlaneClient(dp.url, token=secret) as client:
            posts = {"metrics": client.send_metrics, "logs": client.send_logs, "audit": client.send_audit}
            batch = {"metrics": 1000, "logs": 200, "audit": 500}

            async def drain(stream: str) -> float:
                async def send(entries):
                    await posts[stream](node_id, EncodedJSON.array([e.items for e in entries]))

                queue.add_lane(stream, send, batch_size=batch[stream], interval=1.0)
                begun = time.perf_counter()
                await box.deliver(lane(stream))
                if queue.status(stream)["pending"]:
                    raise RuntimeError(f"{stream}: {queue.status(stream)['last_error']}")
                return time.perf_counter() - begun

            start = time.perf_counter()
            times = await asyncio.gather(*(drain(s) for s in counts))
            total = time.perf_counter() - start
        stored = {s: len(getattr(dp.admin, s)(node_id)) for s in counts}
        assert stored == counts, (stored, counts)
        queue.close()
        box.close()
    finally:
        dp.stop()
    entries = sum(counts.values())
    print(f"{args.minutes:g} min backlog, {args.peers} peers: {counts['metrics']} metrics points, {counts['logs']} "
          f"log lines, {counts['audit']} audit events ({entries} entries, {size / 1e6:.1f} MB queued)")
    print(f"  queueing them:   {filled:.2f} s ({entries / filled:,.0f} entries/s into the uplink outbox)")
    print(f"  draining them:   {total:.2f} s until all three queues were empty "
          f"({entries / total:,.0f} entries/s; metrics {times[0]:.2f} s, logs {times[1]:.2f} s, "
          f"audit {times[2]:.2f} s), every entry stored by the devplane")


if __name__ == "__main__":
    asyncio.run(main())
