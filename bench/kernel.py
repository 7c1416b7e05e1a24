"""Kernel WireGuard figures on Debian's stock kernel, in the kernel tier's VM: plexd vs `wg syncconf` on the same
kernel device, and event → device latency.

Run on the host as root: `.venv/bin/python -m bench kernel [--peers 1000] [--repeat 3] [--events 100]`. It boots the
VM (scripts/kernel-vm.sh: QEMU, Debian's linux-image-amd64) and runs inside it:

  * full apply of N peers onto an empty kernel device, and a 1 % change onto a full one: plexd (the whole converge,
    and its device part alone) against `wg syncconf` on the same device, in the same run (bench/converge_bench.py);
  * event → device latency at N peers, one `peer_added` at a time, on kernel WireGuard and, for comparison in the
    same VM, on wireguard-go (bench/event_latency.py).

The VM emulates its CPU (QEMU's TCG where no usable KVM is: about 16x slower for Python than the host), so the
absolute times mean little: the ratios, measured side by side in one run, are the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def inside(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import converge_bench
    import event_latency

    print(f"== converge on kernel WireGuard ({os.uname().release}), {args.repeat} runs each, medians", flush=True)
    asyncio.run(converge_bench.bench([args.peers], args.repeat, kind="kernel"))
    for backend in ("kernel", "userspace"):
        lat = sorted(x * 1000 for x in asyncio.run(event_latency.measure(args.events, args.peers, backend=backend)))
        q = statistics.quantiles(lat, n=100, method="inclusive")
        print(f"== event -> device, {backend}: {len(lat)} peer_added events at {args.peers} peers: "
              f"p50 {statistics.median(lat):.1f} ms  p90 {q[89]:.1f} ms  p99 {q[98]:.1f} ms  max {lat[-1]:.1f} ms",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--events", type=int, default=100)
    args = ap.parse_args()
    if os.environ.get("PLEXD_KERNEL_VM") == "1":
        inside(args)
        return
    cmd = [str(REPO / "scripts" / "kernel-vm.sh"), "env", "PLEXD_TEST_LOAD_FACTOR=4", "PYTHONDONTWRITEBYTECODE=1",
           str(REPO / ".venv" / "bin" / "python"), "-m", "bench", "kernel", "--peers", str(args.peers),
           "--repeat", str(args.repeat), "--events", str(args.events)]
    sys.exit(subprocess.run(cmd, cwd=REPO).returncode)


if __name__ == "__main__":
    main()
