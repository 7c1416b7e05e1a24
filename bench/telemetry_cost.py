"""Telemetry cost: the CPU and RSS that metrics, logs and audit reporting add to an idle node with 100 peers.

    sudo .venv/bin/python -m bench.telemetry_cost [--peers 100] [--seconds 180] [--log-rate 5]

Two runs of bench.idle_cost's connected daemon (real wireguard-go, real devplane, 100 registered peers, default
timings), one with telemetry off (``telemetry.{metrics,logs,audit}.enabled: false``) and one with the default
intervals (metrics 15 s / 60 s with latency probes to every peer, logs 10 s / 30 s, audit 5 s / 15 s) following
a log file and an auditd-format file that a writer thread appends to at `--log-rate` lines per second (and one
audit event per second). The difference of plexd's CPU seconds per minute is what telemetry adds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench helpers import each other by bare name

from idle_cost import idle_run

OFF = "telemetry: {metrics: {enabled: false}, logs: {enabled: false}, audit: {enabled: false}}\n"
AUDIT = ('type=SYSCALL msg=audit({t:.3f}:{n}): arch=c000003e syscall=257 success=yes exit=3 items=1 pid=812 '
         'uid=0 gid=0 comm="cat" exe="/usr/bin/cat" key="etc"\n'
         'type=PATH msg=audit({t:.3f}:{n}): item=0 name="/etc/hosts" nametype=NORMAL\n'
         'type=EOE msg=audit({t:.3f}:{n}): \n')


def writer(app_log: Path, audit_log: Path, rate: float, stop: threading.Event) -> None:
    n = 0
    while not stop.wait(1.0):
        with open(app_log, "a") as fh:
            fh.writelines(f"request {n}-{i} served in 3 ms\n" for i in range(int(rate)))
        with open(audit_log, "a") as fh:
            fh.write(AUDIT.format(t=time.time(), n=n))
        n += 1


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--log-rate", type=float, default=5.0)
    args = ap.parse_args()
    files = Path(tempfile.mkdtemp(prefix="plexd-bench-files-"))
    app_log, audit_log = files / "app.log", files / "audit.log"
    app_log.touch()
    audit_log.touch()
    stop = threading.Event()
    threading.Thread(target=writer, args=(app_log, audit_log, args.log_rate, stop), daemon=True).start()
    try:
        off = await idle_run(args.peers, args.seconds, extra_config=OFF)
        on = await idle_run(args.peers, args.seconds, extra_config=(
            f"telemetry: {{logs: {{source: files, files: [{app_log}]}}, audit: {{file: {audit_log}}}}}\n"))
    finally:
        stop.set()
    print(f"idle plexd up, {args.peers} peers, {args.seconds:.0f} s windows; telemetry following a log file at "
          f"{args.log_rate:g} lines/s and an audit log at 1 event/s")
    print(f"  telemetry off: {off.per_minute:.3f} CPU s/min, RSS {off.rss_mib:.1f} MiB")
    print(f"  telemetry on:  {on.per_minute:.3f} CPU s/min, RSS {on.rss_mib:.1f} MiB")
    print(f"  added:         {on.per_minute - off.per_minute:+.3f} CPU s/min (goal <= 0.05), "
          f"RSS {on.rss_mib - off.rss_mib:+.1f} MiB")


if __name__ == "__main__":
    asyncio.run(main())
