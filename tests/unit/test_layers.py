"""The architecture's contracts (pyproject.toml, [tool.importlinter]), run by import-linter: every package in a layer
(entry points -> node -> services -> features -> identity/engine -> wire -> machine -> model -> config -> base), the
feature packages independent of each other, the model and the configuration free of features, and the daemon free
of the reference control plane. A lower layer never imports a higher one, directly or through a module in between."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in out.stdout


def test_every_package_and_top_level_module_is_in_a_layer():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    named = {name for layer in layers for name in re.split(r"[|:]", layer.replace(" ", "")) if name}
    package = ROOT / "plexd"
    present = {f"plexd.{p.stem}" for p in package.iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert present - named == set(), "not in any layer of the contract"
    assert named - present == set(), "named in the contract but not in plexd/"
