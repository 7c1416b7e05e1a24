"""Fixtures of the e2e lab tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

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


@pytest.fixture
def api_dir():
    """A directory for a daemon's socket: 0755, outside pytest's 0700 tmp_path, so other uids can reach it."""
    base = tempfile.mkdtemp(prefix="pxapi")
    os.chmod(base, 0o755)
    yield Path(base)
    shutil.rmtree(base, ignore_errors=True)
