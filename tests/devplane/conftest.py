"""Fixtures for the devplane tests: a real `plexd-devplane serve` process per module, fresh ones on demand."""

from __future__ import annotations

import pytest
from devplane_helpers import RegisteredNode, SSEReader

from plexd.devplane.harness import Devplane


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory):
    """One devplane per test module (fast); tests that restart or break it use `fresh_dp`."""
    with Devplane(tmp_path_factory.mktemp("devplane"), keepalive="1s") as plane:
        yield plane


@pytest.fixture
def fresh_dp(tmp_path):
    plane = Devplane(tmp_path / "devplane", keepalive="1s")
    try:
        yield plane.start()
    finally:
        plane.stop()


@pytest.fixture
def readers():
    """Collect SSEReaders so each is closed even when the test fails."""
    opened: list[SSEReader] = []

    def open_reader(node: RegisteredNode, last_event_id: str | None = None) -> SSEReader:
        reader = SSEReader(node, last_event_id)
        opened.append(reader)
        return reader.start()

    yield open_reader
    for r in opened:
        r.close()


@pytest.fixture(scope="module")
def platform_dp(tmp_path_factory: pytest.TempPathFactory):
    """One devplane speaking the platform dialect per test module."""
    with Devplane(tmp_path_factory.mktemp("devplane"), keepalive="1s", dialect="platform") as plane:
        yield plane


@pytest.fixture
def fresh_platform_dp(tmp_path):
    plane = Devplane(tmp_path / "devplane", keepalive="1s", dialect="platform")
    try:
        yield plane.start()
    finally:
        plane.stop()
