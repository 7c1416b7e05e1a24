"""Long fuzz run of every parser of outside input (hypothesis, 100,000 cases each by default).

    .venv/bin/python -m bench fuzz_parsers [--cases N] [--only NAME,...]

The targets and their properties are in bench/_fuzz_targets.py (the test suite runs the same ones briefly).
Prints one line per parser: cases run, failures (the first failing input is printed and the run goes on).
"""

from __future__ import annotations

import argparse
import sys
import time

from hypothesis import HealthCheck, Phase, given, settings

from bench._fuzz_targets import TARGETS


def run(target, cases: int) -> tuple[int, str]:
    count = 0

    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(target.strategy)
    def prop(value):
        nonlocal count
        count += 1
        target.check(value)

    try:
        prop()
    except Exception as exc:  # the property failed: report it, go on with the next parser
        return count, f"{type(exc).__name__}: {exc}"[:2000]
    return count, ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=100_000)
    p.add_argument("--only", default="")
    args = p.parse_args()
    only = {n for n in args.only.split(",") if n}
    failed = 0
    for target in TARGETS:
        if only and target.name not in only:
            continue
        start = time.monotonic()
        count, error = run(target, args.cases)
        took = time.monotonic() - start
        print(f"{target.name:<18} {count:>8} cases  {took:7.1f} s  {'FAILED: ' + error if error else 'ok'}",
              flush=True)
        failed += bool(error)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
