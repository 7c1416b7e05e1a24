"""Fixtures for the conformance tests: a real platform devplane with one registered node (per module)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from devplane.platform_helpers import PlatformNode, register

from plexd.devplane.harness import Devplane


@dataclass(frozen=True)
class PlatformDevplane:
    dp: Devplane
    node: PlatformNode

    @property
    def url(self) -> str:
        return self.dp.url


@pytest.fixture(scope="module")
def platform_devplane(tmp_path_factory: pytest.TempPathFactory):
    """`plexd-devplane serve --dialect platform` and one node registered with it, beaten once: its reachability
    is then "healthy" ("never_reported" before, a state the platform added after the vendored OpenAPI's cut)."""
    with Devplane(tmp_path_factory.mktemp("devplane"), keepalive="1s", dialect="platform") as dp:
        node = register(dp)
        assert node.heartbeat().status_code == 200
        yield PlatformDevplane(dp, node)
