"""Benchmarks: one script per figure, never timed assertions in tests. `python -m bench` lists them.

The bench helpers (`_connected_lab`, `_route_watch`, ...) import each other by bare name, as they do when a bench
runs as a script (`python bench/NAME.py`, its folder first on sys.path); the package puts its folder there too,
so `python -m bench NAME` and `python -m bench.NAME` find them the same way.
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)
