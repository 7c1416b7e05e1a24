"""The architecture's layers (pyproject.toml, [tool.importlinter]): cli -> node -> services -> domains -> engine ->
adapters -> model. A lower layer never imports a higher one, directly or through a module in between."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_layers_contract_is_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken." in out.stdout
