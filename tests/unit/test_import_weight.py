"""What the daemon imports decides most of its memory (the code of every module stays resident): a module only
one configuration needs is imported only in that configuration. pyroute2 (~160 modules) is imported only when the
kernel WireGuard backend creates its device: the device's netlink is plexd's own (plexd.machine.wireguard.genl), and a
node on wireguard-go never loads it."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
from dataclasses import replace
from plexd.config.settings import load
import plexd.cli, plexd.node.assembly
from plexd.machine.wireguard_select import backend_kind, wireguard_backend
config = load(env={{}}, flags={{"data_dir": "/nonexistent"}})
config = replace(config, mesh=replace(config.mesh, backend={backend!r}))
wireguard_backend(config)
print(backend_kind(config), "pyroute2" in sys.modules)
"""


def probe(backend: str) -> str:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(backend=backend)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_a_userspace_node_never_imports_pyroute2():
    assert probe("userspace") == "userspace False"


def test_the_kernel_backend_does_not_bring_it_either_until_it_creates_the_device():
    assert probe("kernel") == "kernel False"
