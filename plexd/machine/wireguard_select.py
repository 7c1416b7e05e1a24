"""Which WireGuard backend this machine uses, decided in one place (the daemon, `reconcile --once`, `peers`).

``mesh.backend: auto`` picks the kernel module when the kernel has it (loaded, or loaded on request: a server
freshly booted has not loaded it yet, `plexd.machine.wireguard.kernel_probe`), else the userspace implementation
(``mesh.userspace_implementation``, wireguard-go by default), which plexd starts and supervises itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plexd.machine.wireguard.kernel_probe import kernel_wireguard_available

if TYPE_CHECKING:
    from plexd.config.settings import Config
    from plexd.machine.wireguard import WireGuardBackend


def backend_kind(config: Config) -> str:
    kind = config.mesh.backend
    if kind == "auto":
        kind = "kernel" if kernel_wireguard_available() else "userspace"
    return kind


def wireguard_backend(config: Config, interface: str = "") -> WireGuardBackend:
    """The mesh device's backend, or (`interface`) one of the same kind for another interface plexd serves.
    Each backend is imported only when chosen; pyroute2 (~160 modules, several MiB) only to create a kernel device."""
    interface = interface or config.mesh.interface
    if backend_kind(config) == "kernel":
        from plexd.machine.wireguard.kernel import KernelBackend

        return KernelBackend(interface)
    from plexd.machine.wireguard.userspace import UserspaceBackend
    from plexd.system.systemd import scope_command

    return UserspaceBackend(interface, implementation=config.mesh.userspace_implementation,
                            scope=scope_command(interface))

