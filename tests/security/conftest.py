"""Fixtures of the security tests: each test is an attack that must fail. The lab ones reuse the e2e lab's
daemon helper (a real `plexd up` in a network namespace against the real devplane)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # lab_daemon, shared with the e2e tests

from lab_daemon import lab_with_devplane


@pytest.fixture
def lab_dp(request, tmp_path):
    """Lab nodes (one, or as many as `indirect` parametrization asks) and a devplane on the lab bridge; every
    daemon appended is stopped, nothing is left."""
    with lab_with_devplane(tmp_path, getattr(request, "param", 1)) as parts:
        yield parts
