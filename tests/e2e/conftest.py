"""Fixtures of the e2e lab tests."""

from __future__ import annotations

import pytest
from lab_daemon import Daemon

from plexd.devplane.harness import Devplane
from plexd.lab import Lab


@pytest.fixture
def lab_dp(tmp_path, request):
    lab = Lab().up(getattr(request, "param", 3))
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
