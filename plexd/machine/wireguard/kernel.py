"""The kernel WireGuard backend: the device's generic netlink (`wireguard` family) packed and read by
plexd.machine.wireguard.genl on a socket of its own, and the device created through pyroute2.

The codec is pure and unit-tested against pyroute2's (tests/unit/test_kernel_messages.py); the I/O around it
needs the kernel module, which the kernel tier's VM has (tests/e2e/test_converge.py and the kernel labs).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Mapping

from plexd.machine import rtnl
from plexd.machine.wireguard import (
    CounterRow,
    DeviceConfig,
    DeviceUpdate,
    PeerCounters,
    WireGuardError,
    b64_to_hex,
    check_interface_name,
    genl,
)


class KernelBackend:
    """`WireGuardBackend` over generic netlink, in the current or a named network namespace. Where the kernel has
    the module, tests/e2e/test_converge.py runs its drift test through it; these machines have none."""

    def __init__(self, interface: str, netns: str | None = None) -> None:
        self.interface = interface
        self.netns = netns

    def _socket(self) -> tuple[socket.socket, int]:
        """A generic-netlink socket in the backend's network namespace, and the wireguard family's id."""
        try:
            sock = rtnl.open_socket(self.netns, genl.NETLINK_GENERIC)
        except OSError as e:
            raise WireGuardError(f"cannot open generic netlink: {e.strerror or e}") from None
        try:
            sock.bind((0, 0))
            return sock, genl.family_id(sock)
        except OSError as e:
            sock.close()
            raise _netlink_error(e, "cannot open WireGuard netlink") from None
        except BaseException:
            sock.close()
            raise

    def process_gone(self) -> bool:
        return False

    async def close(self) -> None:
        """Nothing to let go of: the device is the kernel's (`delete_device` removes it)."""

    async def observe(self) -> DeviceConfig | None:
        return await asyncio.to_thread(self._observe)

    async def counters(self) -> Mapping[str, PeerCounters] | None:
        device = await self.observe()  # the netlink dump has no lighter form
        if device is None:
            return None
        return {key: PeerCounters(p.last_handshake, p.rx, p.tx) for key, p in device.peers.items()}

    async def counter_rows(self) -> list[CounterRow] | None:
        device = await self.observe()
        if device is None:
            return None
        rows: list[CounterRow] = []
        for key, p in device.peers.items():
            seconds = int(p.last_handshake)
            rows.append((b64_to_hex(key), str(seconds), str(round((p.last_handshake - seconds) * 1e9)),
                         str(p.tx), str(p.rx)))
        return rows

    def _observe(self) -> DeviceConfig | None:
        sock, family = self._socket()
        with sock:
            try:
                return genl.parse_device(genl.dump(sock, family, genl.get_request(self.interface)))
            except OSError as e:
                if e.errno in (errno.ENODEV, errno.ENOENT):
                    return None
                raise _netlink_error(e, f"cannot read WireGuard device {self.interface}") from None

    async def apply(self, update: DeviceUpdate) -> None:
        await asyncio.to_thread(self._apply, update)

    def _apply(self, update: DeviceUpdate) -> None:
        if update.is_empty():
            return
        sock, family = self._socket()
        with sock:
            try:
                genl.request(sock, family, genl.iter_set_requests(self.interface, update))
            except OSError as e:
                raise _netlink_error(e, f"WireGuard refused a set on {self.interface}") from None

    async def ensure_device(self) -> bool:
        check_interface_name(self.interface)
        return await asyncio.to_thread(self._ensure)

    def _ensure(self) -> bool:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with IPRoute(netns=self.netns) if self.netns else IPRoute() as ipr:
            if ipr.link_lookup(ifname=self.interface):
                return False
            try:
                ipr.link("add", ifname=self.interface, kind="wireguard")
            except NetlinkError as e:
                if e.code == errno.EOPNOTSUPP:
                    raise WireGuardError("the kernel has no WireGuard (link type wireguard not supported)") from None
                raise WireGuardError(f"cannot create {self.interface}: {e}") from None
            return True

    async def delete_device(self) -> None:
        from plexd.machine.links import Links

        await Links(self.interface, self.netns).delete_link()


def _netlink_error(e: OSError, what: str) -> WireGuardError:
    if e.errno == errno.EPERM:
        return WireGuardError("no permission for netlink: plexd must run as root or with CAP_NET_ADMIN")
    return WireGuardError(f"{what}: {e.strerror or e}")
