"""Cold start of the plexd CLI: ``plexd --help`` and ``plexd status`` (median of N fresh processes), plus the
slowest imports of ``plexd status`` from ``python -X importtime``.

    .venv/bin/python bench/cli_startup.py [--runs 30]

A CLI that people run by hand (and scripts run in loops) should answer in well under 100 ms; heavy modules
(the HTTP client, PyNaCl, yaml, asyncio) are imported only by the commands that need them. The baseline row is a bare
``python -c pass`` on the same interpreter, i.e. the floor no Python CLI can go below.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLEXD = str(Path(sys.executable).with_name("plexd"))


def time_runs(cmd: list[str], env: dict[str, str], runs: int) -> list[float]:
    subprocess.run(cmd, env=env, capture_output=True, check=True)  # warm the page cache once
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, env=env, capture_output=True, check=True)
        out.append((time.perf_counter() - start) * 1000)
    return out


def import_offenders(env: dict[str, str], top: int) -> list[tuple[int, str]]:
    """(cumulative µs, module) of the slowest top-level imports of `plexd status`."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "plexd.cli", "status"], env=env,
                          capture_output=True, text=True, check=True)
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _self_us, cumulative, name = line.split(":", 1)[1].split("|")
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        if depth == 0:  # top-level imports only, so nested ones are not counted twice
                rows.append((int(cumulative), name.strip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "config.yaml")
        config.write_text(f"api: {{url: http://127.0.0.1:9, allow_insecure: true}}\ndata_dir: {tmp}/data\n")
        env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(config)}
        rows = [
            ("python -c pass (floor)", [sys.executable, "-c", "pass"]),
            ("plexd --help", [PLEXD, "--help"]),
            ("plexd status", [PLEXD, "status"]),
            ("plexd status --json", [PLEXD, "status", "--json"]),
        ]
        print(f"cold start, {args.runs} runs each, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
        print(f"{'command':<26} {'median ms':>10} {'p10':>8} {'p90':>8}")
        for label, cmd in rows:
            samples = sorted(time_runs(cmd, env, args.runs))
            p10 = samples[len(samples) // 10]
            p90 = samples[(len(samples) * 9) // 10]
            print(f"{label:<26} {statistics.median(samples):>10.1f} {p10:>8.1f} {p90:>8.1f}")
        print("\nslowest top-level imports of 'plexd status' (python -X importtime, cumulative):")
        for cumulative, name in import_offenders(env, args.top):
            print(f"  {cumulative / 1000:>7.1f} ms  {name}")


if __name__ == "__main__":
    main()
