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
    """Lab nodes (3, or as many as `indirect` parametrization asks) and a devplane on the lab bridge."""
    with lab_with_devplane(tmp_path, getattr(request, "param", 3)) as parts:
        yield parts


@pytest.fixture
def api_dir():
    """A directory for a daemon's socket: 0755, outside pytest's 0700 tmp_path, so other uids can reach it."""
    base = tempfile.mkdtemp(prefix="pxapi")
    os.chmod(base, 0o755)
    yield Path(base)
    shutil.rmtree(base, ignore_errors=True)
