"""The node side of the upgrade tests (tests/integration/test_upgrade_install.py and
tests/security/test_signed_upgrade.py): a real `Upgrader` with a real config and control-plane client, inside a
small agent stand-in that records the restart it is asked for (the restart itself, re-exec and rollback, is
shown with real daemons in tests/e2e/test_upgrade_lab.py)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

from plexd.config import settings as config_mod
from plexd.controlplane.client import ControlPlaneClient
from plexd.upgrade.upgrader import Upgrader


class Agent(SimpleNamespace):
    """What Upgrader uses of the agent: config, client, the running checksum, and restart (recorded)."""

    def restart(self, reason: str) -> None:
        self.restarts.append(reason)


def upgrade_node(devplane, secret: str, tmp_path: Path, release_keys: Iterable[str], dialect: str = "spec",
                 **upgrade: object) -> tuple[Upgrader, Agent]:
    """An Upgrader for a node whose config pins `release_keys`, speaking `dialect`; `upgrade` adds upgrade.*
    settings."""
    path = tmp_path / "config.yaml"
    path.write_text(
        f"api: {{url: {devplane.url}, allow_insecure: true}}\n"  # the devplane serves plain HTTP
        f"data_dir: {tmp_path / 'data'}\nupgrade: {{dir: {tmp_path / 'releases'}, "
        f"release_keys: [{', '.join(repr(k) for k in release_keys)}]"
        + "".join(f", {k}: {v}" for k, v in upgrade.items()) + "}\n")
    (tmp_path / "data").mkdir(mode=0o700, exist_ok=True)
    cfg = config_mod.load(str(path), flags={})
    agent = Agent(config=cfg, client=ControlPlaneClient.for_config(cfg, token=secret, dialect=dialect),
                  binary_checksum="a" * 64, restarts=[])
    return Upgrader(agent, healthy=lambda: None), agent


def left_behind(tmp_path: Path) -> list[str]:
    """Everything an install leaves: release files (also half-written ones), the link, the marker."""
    rel = tmp_path / "releases"
    found = sorted(p.name for p in rel.iterdir()) if rel.exists() else []
    return found + (["upgrade.json"] if (tmp_path / "data" / "upgrade.json").exists() else [])
