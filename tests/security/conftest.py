"""Fixtures of the security tests: each test is an attack that must fail. The lab ones reuse the e2e lab's
daemon helper (a real `plexd up` in a network namespace against the real devplane)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # lab_daemon, shared with the e2e tests

from lab_daemon import Daemon

from plexd.devplane.harness import Devplane
from plexd.lab import Lab


@pytest.fixture
def lab_dp(request, tmp_path):
    """Lab nodes (one, or as many as `indirect` parametrization asks) and a devplane on the lab bridge; every
    daemon appended is stopped, nothing is left."""
    lab = Lab().up(getattr(request, "param", 1))
    dp = None
    daemons: list[Daemon] = []
    try:
        dp = Devplane(tmp_path / "dp", listen=f"{lab.bridge_address}:0", keepalive="5s")
        dp.start()
        yield lab, dp, daemons, tmp_path
    finally:
        for d in daemons:
            d.stop()
        if dp is not None:
            dp.stop()
        lab.down()
        assert lab.leaks() == []
