"""Soak: one connected node with 1,000 peers under steady churn for an hour; its resources sampled every 10 s.

Run as root: `.venv/bin/python -m bench soak [--minutes 60] [--peers 1000]`.

The node is a real `plexd up` (wireguard-go, nftables, default reconcile and heartbeat intervals) against the
real devplane, set up as `bench chaos` sets it up (bench/chaos.py). After `--peers` simulated nodes register, the
churn runs for `--minutes`: a peer joins and one leaves every second, the policy changes and an action is
requested every minute, a node-API report is written every 10 s, the devplane is restarted every 10 minutes and a
peer is removed from the device by hand (`wg set ... remove`) every 5 minutes.

Every 10 s it samples plexd's RSS, open fds, threads, CPU time, the size of each SQLite file in data_dir, and,
for one joining peer in ten, the lag from its registration to its key on the device. At the end it prints: RSS
and its slope (MiB/hour, least squares over the samples after the first 10 minutes, or after the first half of a
shorter run), fds and threads (first, last, max), SQLite sizes, CPU-s per minute, event lag p50/p99, log lines by
level, the ERROR lines (with whether an injected fault explains them: within 60 s after a devplane restart or a
hand-made drift), and whether each hand-made drift was reported exactly once.
Goals: RSS slope <= 1 MiB/hour, fds and threads flat, every drift reported once, no unexplained ERROR line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import calendar
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._connected_lab import _cpu
from bench.chaos import POLICIES, Rig, rig
from plexd.node.control import STATUS_PATH
from plexd.node.control_client import call

SAMPLE_EVERY = 10.0
# PLEXD_BENCH_TRACEMALLOC=/path/out.snap: plexd runs under tracemalloc; snapshots are taken when the settle ends (10
# minutes, or half the run if shorter) and at the end (/path/out.snap.TICK), and the summary prints where the memory
# grew in between: the window the RSS slope is measured over
TRACE = os.environ.get("PLEXD_BENCH_TRACEMALLOC", "")
LAG_EVERY = 10  # one joining peer in ten is timed to the device


@dataclass
class Sample:
    t: float
    rss_mib: float
    fds: int
    threads: int
    cpu_s: float
    sqlite: dict[str, int]
    malloc: dict[str, float] | None = None  # glibc's own count (plexd status, daemon.malloc_mib), once a minute
    rss_parts: dict[str, float] = field(default_factory=dict)  # RssAnon, RssFile, RssShmem (MiB): what grows


@dataclass
class Soak:
    r: Rig
    peers: list[tuple[str, str]] = field(default_factory=list)  # (node id, public key), oldest first
    samples: list[Sample] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)  # (unix time, what)
    hand_drift: list[str] = field(default_factory=list)  # peer ids removed from the device by hand
    joined: int = 0
    timing: set[asyncio.Task] = field(default_factory=set)  # the lag probes under way

    async def register(self, client: httpx.AsyncClient, n: int) -> None:
        token = await asyncio.to_thread(self.r.dp.admin.create_token)
        key = base64.b64encode(os.urandom(32)).decode()
        resp = await client.post("/v1/register", json={"token": token, "public_key": key, "hostname": f"soak-{n}"},
                                 headers={"Authorization": f"Bearer {token}"})
        resp.raise_for_status()
        self.peers.append((resp.json()["node_id"], key))
        self.joined += 1
        if self.joined % LAG_EVERY == 0:
            task = asyncio.create_task(self._lag(key, time.monotonic()))
            self.timing.add(task)
            task.add_done_callback(self.timing.discard)

    async def _lag(self, key: str, start: float) -> None:
        while time.monotonic() - start < 30:
            out = await asyncio.to_thread(subprocess.run, self.r.node.wrap(["wg", "show", "plexd0", "peers"]),
                                          capture_output=True, text=True)
            if key in out.stdout.split():
                self.lags.append(time.monotonic() - start)
                return
            await asyncio.sleep(0.05)

    def sample(self, t0: float) -> None:
        pid = self.r.proc.pid if self.r.proc is not None else None
        if pid is None:
            return
        proc = Path(f"/proc/{pid}")
        try:
            status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
            fds = len(os.listdir(proc / "fd"))
            cpu = _cpu(pid)
        except OSError:
            return
        sizes = {p.name: p.stat().st_size for p in self.r.data_dir.iterdir()
                 if p.name.endswith((".db", ".db-wal", ".sqlite", ".sqlite-wal"))}
        parts = {k: int(status[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile", "RssShmem") if k in status}
        self.samples.append(Sample(time.monotonic() - t0, int(status["VmRSS"].split()[0]) / 1024,
                                   fds, int(status["Threads"]), cpu, sizes, rss_parts=parts))

    async def sample_heap(self) -> None:
        """glibc's count, once a minute, off the loop (the lag probes keep their timing)."""
        try:
            doc = await asyncio.to_thread(call, self.r.api_socket, "GET", STATUS_PATH, timeout=5)
        except Exception:  # a restart in progress: the next minute's sample
            return
        if self.samples:
            self.samples[-1].malloc = {**(doc["daemon"].get("malloc_mib") or {}),
                                       "frozen": (doc["daemon"].get("gc") or {}).get("frozen", 0)}


async def soak(minutes: float, npeers: int) -> None:
    # plexd as it runs on a server: without the chaos rig's libfaketime, which hooks every clock read
    with rig(reconcile="60s", heartbeat="30s", data_size="256m", steppable_clock=False) as r:
        s = Soak(r)
        async with httpx.AsyncClient(base_url=r.dp.url, timeout=30) as client:
            t = time.monotonic()
            for i in range(npeers):
                await s.register(client, i)
            print(f"{npeers} peers registered in {time.monotonic() - t:.0f} s", flush=True)
            s.lags.clear()
            t0 = time.monotonic()
            end = t0 + minutes * 60
            tick = 0
            next_sample = t0
            while time.monotonic() < end:
                tick += 1
                try:
                    await s.register(client, npeers + tick)
                    gone, _ = s.peers.pop(0)
                    await asyncio.to_thread(r.dp.admin.forget_node, gone)
                    if tick % 10 == 0:
                        await asyncio.to_thread(call, r.api_socket, "PUT", "/v1/state/report/soak",
                                                {"content_type": "application/json", "payload": {"tick": tick}})
                    if tick % 60 == 0:
                        await asyncio.to_thread(r.dp.admin.set_policies, POLICIES[tick // 60 % 2])
                        await asyncio.to_thread(r.dp.admin.request_action, r.node_id, "chaos.sh")
                    if tick % 300 == 150:
                        victim_id, victim_key = s.peers[len(s.peers) // 2]
                        s.faults.append((time.time(), f"wg set remove {victim_id}"))
                        s.hand_drift.append(victim_id)
                        await asyncio.to_thread(subprocess.run, r.node.wrap(
                            ["wg", "set", "plexd0", "peer", victim_key, "remove"]), check=True)
                    if tick % 600 == 0:
                        s.faults.append((time.time(), "devplane restart"))
                        await asyncio.to_thread(r.dp.restart)
                except (httpx.HTTPError, OSError, RuntimeError) as e:
                    print(f"  tick {tick}: {e}", flush=True)
                if TRACE and tick in (int(min(600, minutes * 30)), int(minutes * 60) - 5):
                    await asyncio.to_thread(snapshot, r, f"{TRACE}.{tick}")
                if time.monotonic() >= next_sample:
                    s.sample(t0)
                    if len(s.samples) % 6 == 1:
                        await s.sample_heap()
                    next_sample += SAMPLE_EVERY
                    if len(s.samples) % 30 == 0:
                        last = s.samples[-1]
                        print(f"  {last.t / 60:5.1f} min: RSS {last.rss_mib:.1f} MiB, {last.fds} fds, "
                              f"{last.threads} threads, CPU {last.cpu_s:.1f} s", flush=True)
                await asyncio.sleep(max(0.0, t0 + tick - time.monotonic()))
        await asyncio.sleep(70)  # the last hand drift's reconcile (60 s) reports it
        summary(s, minutes)
        snaps = sorted((p for p in glob.glob(f"{TRACE}.*") if p.rsplit(".", 1)[1].isdigit()),
                       key=lambda p: int(p.rsplit(".", 1)[1])) if TRACE else []
        if len(snaps) >= 2:
            growth(snaps[0], snaps[-1])


def snapshot(r: Rig, path: str) -> None:
    os.kill(r.proc.pid, signal.SIGUSR1)  # the traced daemon writes PLEXD_BENCH_TRACEMALLOC, then we move it
    deadline = time.monotonic() + 60
    while not os.path.exists(TRACE):
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon wrote no tracemalloc snapshot")
        time.sleep(0.2)
    os.replace(TRACE, path)


def growth(first: str, last: str, top: int = 15) -> None:
    import tracemalloc

    stats = tracemalloc.Snapshot.load(last).compare_to(tracemalloc.Snapshot.load(first), "traceback")
    print(f"tracemalloc: where plexd's memory grew between {first} and {last}")
    for stat in stats[:top]:
        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks")
        for line in stat.traceback.format()[-6:]:
            print("     " + line)


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB), in MiB per hour."""
    if len(points) < 2:
        return float("nan")
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den * 3600 if den else float("nan")


def summary(s: Soak, minutes: float) -> None:
    if not s.samples:
        print("no samples: plexd was not running")
        return
    first, last = s.samples[0], s.samples[-1]
    after = 600.0 if minutes >= 20 else minutes * 30
    settled = [(x.t, x.rss_mib) for x in s.samples if x.t >= after]
    print(f"== soak: {minutes:g} min, {len(s.samples)} samples, {s.joined} joins")
    print(f"RSS: first {first.rss_mib:.1f} MiB, last {last.rss_mib:.1f}, max {max(x.rss_mib for x in s.samples):.1f};"
          f" slope after {after / 60:g} min {slope_per_hour(settled):+.2f} MiB/hour (goal <= 1)")
    parts = [x for x in s.samples if x.t >= after and x.rss_parts]
    if parts:  # anonymous memory (heaps, Python's arenas) or file pages mapped (libraries, SQLite's shared memory)
        print("RSS by kind (MiB), after the settle: " + ", ".join(
            f"{k} {parts[0].rss_parts[k]:.1f} -> {parts[-1].rss_parts[k]:.1f} "
            f"({slope_per_hour([(x.t, x.rss_parts[k]) for x in parts]):+.2f}/hour)" for k in parts[0].rss_parts))
    heap = [(x.t, x.malloc) for x in s.samples if x.t >= after and x.malloc and "in_use" in x.malloc]
    if heap:  # where RSS growth is: glibc's blocks in use (a leak) or free in its heaps (fragmentation)
        def line(k: str) -> str:
            trend = slope_per_hour([(t, m[k]) for t, m in heap])
            return f"{k} {heap[0][1][k]:.1f} -> {heap[-1][1][k]:.1f} ({trend:+.2f}/hour)"

        print("glibc malloc (MiB), after the settle: "
              + ", ".join(line(k) for k in ("in_use", "free", "heap", "mapped")))
        print(f"objects frozen by the collector (collected as cycles only at a full collection): "
              f"{heap[0][1]['frozen']:.0f} -> {heap[-1][1]['frozen']:.0f}")
    for name, values in (("fds", [x.fds for x in s.samples]), ("threads", [x.threads for x in s.samples])):
        print(f"{name}: first {values[0]}, last {values[-1]}, max {max(values)}")
    print("SQLite: " + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sorted(last.sqlite.items())))
    span = (last.t - first.t) / 60
    print(f"CPU: {(last.cpu_s - first.cpu_s) / span:.3f} CPU-s per minute" if span > 0 else "CPU: -")
    if s.lags:
        lags = sorted(x * 1000 for x in s.lags)
        p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
        print(f"event lag (registration -> device), {len(lags)} peers: p50 {statistics.median(lags):.0f} ms, "
              f"p99 {p99:.0f} ms")
    levels: Counter[str] = Counter()
    errors: list[tuple[str, bool]] = []
    for path in s.r.logs:
        for line in path.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                levels["unparsed"] += 1
                continue
            levels[doc.get("level", "?")] += 1
            if doc.get("level") in ("error", "critical"):
                at = calendar.timegm(time.strptime(doc["ts"][:19], "%Y-%m-%dT%H:%M:%S"))
                explained = any(0 <= at - when <= 60 for when, _ in s.faults)
                errors.append((f"{doc['ts']} {doc.get('msg', '')[:160]}", explained))
    print("log lines: " + ", ".join(f"{k} {v}" for k, v in sorted(levels.items())))
    for text, explained in errors:
        print(f"  ERROR {'(after an injected fault)' if explained else '(UNEXPLAINED)'}: {text}")
    drift = [c["detail"] for d in s.r.dp.admin.drift(s.r.node_id) for c in d["corrections"]]
    for victim in s.hand_drift:
        seen = sum(f"peer {victim}:" in detail for detail in drift)
        print(f"hand drift on {victim}: reported {seen} time(s) (goal 1)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--peers", type=int, default=1000)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still takes its lab down
    asyncio.run(soak(args.minutes, args.peers))


if __name__ == "__main__":
    main()
