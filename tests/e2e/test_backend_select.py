"""`mesh.backend: auto` on a kernel with WireGuard as a module, as a server freshly booted has it: not loaded yet.

Asking the generic-netlink controller for the `wireguard` family makes the kernel load the module itself (what
plexd's unit, with `ProtectKernelModules=yes`, could not do), so `auto` picks the kernel backend. On this host
the probe answers for families the kernel has and has not; in the kernel tier, the module is unloaded first.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from plexd.config.settings import load
from plexd.machine.wireguard.kernel_probe import getfamily_request, has_genl_family, kernel_module_loaded
from plexd.machine.wireguard_select import backend_kind


def auto_config(tmp_path: Path):
    (tmp_path / "config.yaml").write_text("mesh: {backend: auto}\n")
    return load(str(tmp_path / "config.yaml"), env={})


def test_the_probe_asks_the_controller_by_name_and_reads_its_answer() -> None:
    request = getfamily_request("wireguard")
    assert len(request) % 4 == 0 and request.endswith(b"wireguard\0\0\0")
    assert has_genl_family("nlctrl")  # the controller itself: every kernel has it
    assert not has_genl_family("px-no-such-family")


@pytest.mark.kernel
def test_auto_loads_the_module_a_fresh_boot_has_not_loaded_and_picks_the_kernel(tmp_path) -> None:
    # the tier's other tests have removed their devices (they run one after another): nothing holds the module
    assert Path("/sys/module/wireguard/refcnt").read_text().strip() == "0", "a WireGuard device is still in use"
    subprocess.run(["modprobe", "-r", "wireguard"], check=True)
    assert not kernel_module_loaded()
    try:
        assert backend_kind(auto_config(tmp_path)) == "kernel"
        assert kernel_module_loaded()
    finally:
        subprocess.run(["modprobe", "wireguard"], check=True)
