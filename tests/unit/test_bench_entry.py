"""Every bench the README points at must at least load the way `python -m bench NAME` loads it: a bench that
dies on an import (a helper found only when run as a script) is a figure nobody can reproduce."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from bench.__main__ import benches


@pytest.mark.parametrize("name", sorted(benches()))
def test_every_bench_imports_as_a_module_of_the_bench_package(name):
    module = importlib.import_module(f"bench.{name}")
    assert callable(getattr(module, "main", None)), f"bench.{name} has no main()"


def test_python_dash_m_bench_runs_a_bench_that_uses_the_connected_lab_helpers():
    # event_latency imports _connected_lab and _route_watch by bare name: the case that used to fail.
    res = subprocess.run([sys.executable, "-m", "bench", "event_latency", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--events" in res.stdout
