"""List the benchmarks, or run one: `python -m bench` / `python -m bench NAME [ARGS...]`."""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).parent


def benches() -> dict[str, str]:
    out = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        out[path.stem] = doc.splitlines()[0] if doc else ""
    return out


def main() -> int:
    available = benches()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python -m bench NAME [ARGS...]   (each bench also runs as python -m bench.NAME)\n")
        width = max(map(len, available), default=0)
        for name, summary in available.items():
            print(f"  {name.ljust(width)}  {summary}")
        return 0
    name = sys.argv[1]
    if name not in available:
        print(f"bench: unknown benchmark {name!r}; one of: {', '.join(available)}", file=sys.stderr)
        return 2
    sys.argv = [f"bench.{name}", *sys.argv[2:]]
    runpy.run_module(f"bench.{name}", run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
