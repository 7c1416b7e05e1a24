"""Fixtures of the e2e lab tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from lab_daemon import lab_with_devplane


@pytest.fixture
def lab_dp(tmp_path, request):
    """Lab nodes and a devplane on the lab bridge. `indirect` parametrization may ask for a number of nodes (3 by
    default) or a dict `{"nodes": N, "dialect": "platform"}` (the devplane and the daemons speak the platform
    contract)."""
    param = getattr(request, "param", 3)
    options = param if isinstance(param, dict) else {"nodes": param}
    with lab_with_devplane(tmp_path, options.get("nodes", 3), options.get("dialect", "spec")) as parts:
        yield parts


@pytest.fixture
def api_dir():
    """A directory for a daemon's socket: 0755, outside pytest's 0700 tmp_path, so other uids can reach it."""
    base = tempfile.mkdtemp(prefix="pxapi")
    os.chmod(base, 0o755)
    yield Path(base)
    shutil.rmtree(base, ignore_errors=True)
