"""The bridge relay: relayed vs direct ping RTT and iperf3 throughput, and the relay's CPU per 10,000 packets/s.

`python -m bench relay_bench [--pings N] [--seconds S] [--runs R] [--pps P]` (root; run under the shared test
lock). A lab with two wireguard-go pairs (configured with `wg set`, no daemon), every end behind its own nft
masquerade router:

  direct     routers with port-preserving `masquerade`, each end pointed at the other's router (hole punched)
  userspace  routers with `masquerade random,fully-random`, both ends pointed at the relay
             (`python -m plexd.bridge.standalone` on the public side)
  kernel     the same relayed pair with the relay's nftables fast path on (`inet plexd_relay`)

For each: ping RTT p50/p99 over N pings (10 ms apart), iperf3 TCP throughput over S seconds (`--runs` times,
each relayed run right after a direct one, so both see the machine in the same state; the median of each, and a
relayed path's share is of the direct runs interleaved with it), and for the relayed paths an iperf3 UDP
stream at P packets/s with the relay process's CPU (utime+stime from /proc) over it, scaled to 10,000 packets/s.
The kernel path's work is done in softirq, which no process is charged for: its CPU figure is the relay process
only (the userspace relay then sees handshakes only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))  # the relay lab helpers

from relay_lab import (
    RelayProcess,
    kernel_forwarded,
    nat_pair,
    point_at,
    relay_forwards,
    session_doc,
    wait,
)

from plexd.devplane.lab import Lab

TICKS = os.sysconf("SC_CLK_TCK")


def rtts(lab, end, ip: str, count: int) -> list[float]:
    out = lab.exec(end.node, ["ping", "-n", "-c", str(count), "-i", "0.01", "-W", "2", ip], check=False).stdout
    return [float(w.split("=", 1)[1]) for line in out.splitlines() for w in line.split() if w.startswith("time=")]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def iperf(lab, client, server_ip: str, seconds: int, udp_pps: int = 0) -> dict:
    args = ["iperf3", "-c", server_ip, "-t", str(seconds), "-J"]
    if udp_pps:
        args += ["-u", "-l", "1000", "-b", str(udp_pps * 1000 * 8)]
    res = subprocess.run(client.node.wrap(args), capture_output=True, text=True, timeout=seconds + 30)
    return json.loads(res.stdout)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def tcp_mbit(lab, a, b, seconds: int) -> float:
    return iperf(lab, a, b.mesh_ip, seconds)["end"]["sum_received"]["bits_per_second"] / 1e6


def reachable(name: str, a, b) -> None:
    wait(lambda: subprocess.run(a.node.wrap(["ping", "-c", "1", "-W", "1", b.mesh_ip]),
                                capture_output=True).returncode == 0, 30, f"{name}: a ping")


def measure(lab, name: str, a, b, args, direct_pair, relay=None) -> tuple[dict, list[float]]:
    """The path's row, and the direct pair's TCP runs interleaved with this path's."""
    reachable(name, a, b)
    r = rtts(lab, a, b.mesh_ip, args.pings)
    direct_runs, runs = [], []
    for _ in range(args.runs):
        direct_runs.append(tcp_mbit(lab, *direct_pair, args.seconds))
        runs.append(tcp_mbit(lab, a, b, args.seconds))
    row = {"path": name, "rtt_p50_ms": pct(r, 0.5), "rtt_p99_ms": pct(r, 0.99), "pings": len(r),
           "tcp_mbit_s": statistics.median(runs), "tcp_runs": [round(x, 1) for x in runs],
           "direct_alongside_mbit_s": statistics.median(direct_runs),
           "direct_alongside_runs": [round(x, 1) for x in direct_runs]}
    if relay is not None:
        def forwarded() -> int:
            s = relay.session("rel_1")
            return s["packets_a_to_b"] + s["packets_b_to_a"]
        kernel = (lambda: kernel_forwarded(lab, relay)) if name == "kernel" else (lambda: 0)
        before_pkts, before_kernel = forwarded(), kernel()
        before_cpu, t0 = cpu_seconds(relay.proc.pid), time.monotonic()
        udp = iperf(lab, a, b.mesh_ip, args.seconds, udp_pps=args.pps)
        elapsed = time.monotonic() - t0
        cpu = cpu_seconds(relay.proc.pid) - before_cpu
        pps = (forwarded() - before_pkts + kernel() - before_kernel) / elapsed
        row.update({"udp_pps_relayed": round(pps), "udp_lost_percent": udp["end"]["sum"].get("lost_percent"),
                    "relay_cpu_percent": round(100 * cpu / elapsed, 1),
                    "relay_cpu_percent_per_10k_pps": round(100 * cpu / elapsed * 10_000 / pps, 1) if pps else None})
    return row, direct_runs


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench relay_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--pings", type=int, default=300)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--runs", type=lambda v: max(1, int(v)), default=3,
                        help="TCP runs per path, each beside a direct one (at least 1)")
    parser.add_argument("--pps", type=int, default=10_000)
    args = parser.parse_args()

    rows = []
    with Lab().up() as lab:
        relay = RelayProcess(lab, lab.add_node())
        relay_forwards(relay)
        a, b = nat_pair(lab, 1)
        da, db = nat_pair(lab, 2, snat="masquerade")
        for end in (a, b, da, db):
            lab.spawn(end.node.wrap(["iperf3", "-s"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        point_at(lab, db, da, f"{da.router.public}:51820")
        point_at(lab, da, db, f"{db.router.public}:51820")
        reachable("direct", da, db)
        r = rtts(lab, da, db.mesh_ip, args.pings)
        direct_runs: list[float] = []

        relay.command({"sessions": [session_doc("rel_1", a, b)]})
        point_at(lab, b, a, relay.address)
        point_at(lab, a, b, relay.address)
        row, alongside = measure(lab, "userspace", a, b, args, (da, db), relay)
        rows.append(row)
        direct_runs += alongside

        assert relay.command({"fastpath": relay.node.address}) == {"ok": True}
        wait(lambda: relay.status()["fastpath"]["elements"] == 2, 10, "the fast path's elements")
        row, alongside = measure(lab, "kernel", a, b, args, (da, db), relay)
        rows.append(row)
        direct_runs += alongside
        dropped = relay.status()["dropped"]
        rows.insert(0, {"path": "direct", "rtt_p50_ms": pct(r, 0.5), "rtt_p99_ms": pct(r, 0.99), "pings": len(r),
                        "tcp_mbit_s": statistics.median(direct_runs), "tcp_runs": [round(x, 1) for x in direct_runs]})

    print(f"{'path':<10} {'p50 ms':>7} {'p99 ms':>7} {'TCP Mbit/s':>11} {'% direct':>8} {'UDP pps':>8} "
          f"{'lost %':>7} {'relay CPU %':>11} {'CPU %/10k pps':>13}")
    for r in rows:
        share = 100 * r["tcp_mbit_s"] / r.get("direct_alongside_mbit_s", r["tcp_mbit_s"])
        print(f"{r['path']:<10} {r['rtt_p50_ms']:>7.3f} {r['rtt_p99_ms']:>7.3f} {r['tcp_mbit_s']:>11.1f} "
              f"{share:>8.0f} {r.get('udp_pps_relayed', '-'):>8} "
              f"{_f(r.get('udp_lost_percent')):>7} {r.get('relay_cpu_percent', '-'):>11} "
              f"{r.get('relay_cpu_percent_per_10k_pps', '-'):>13}")
    for r in rows[1:]:
        print(f"{r['path']} TCP runs {r['tcp_runs']} Mbit/s; the direct runs beside them {r['direct_alongside_runs']}")
    print(f"relay drops: {dropped}")
    print(json.dumps(rows))


def _f(value) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
