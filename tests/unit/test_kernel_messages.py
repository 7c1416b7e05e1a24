"""Kernel WireGuard backend: generic-netlink message building and dump merging.

The kernel on these machines has no WireGuard module (no `wireguard` genl family, and `ip link add type
wireguard` is EOPNOTSUPP), so the netlink I/O itself cannot run here; these tests encode the messages with
pyroute2 exactly as they would be sent, decode them back, and feed split dumps to the parser.
"""

from __future__ import annotations

import base64

import pytest
from pyroute2.netlink.generic.wireguard import (
    WG_CMD_SET_DEVICE,
    WGPEER_F_REMOVE_ME,
    WGPEER_F_REPLACE_ALLOWEDIPS,
    WGPEER_F_UPDATE_ONLY,
    wgmsg,
)

from plexd.mesh.wireguard import ZERO_KEY, DeviceUpdate, PeerUpdate, kernel_module_loaded
from plexd.mesh.wireguard.kernel import KernelBackend, build_set_messages, parse_dump

K = [base64.b64encode(bytes([i]) * 32).decode() for i in range(1, 200)]


def _roundtrip(msg: wgmsg) -> wgmsg:
    msg.encode()
    out = wgmsg(msg.data)
    out.decode()
    return out


def _peer(msg: wgmsg, i: int = 0):
    return msg.get_attr("WGDEVICE_A_PEERS")[i]


def test_set_message_carries_device_and_peer_fields() -> None:
    update = DeviceUpdate(private_key=K[0], listen_port=51820, peers=(
        PeerUpdate(public_key=K[1], endpoint="[fd00::1]:51821", allowed_ips=frozenset({"10.0.0.0/24", "fd00::/64"}),
                   psk=K[2], persistent_keepalive=25),
        PeerUpdate(public_key=K[3], remove=True),
        PeerUpdate(public_key=K[4], update_only=True, endpoint="1.2.3.4:5"),
    ))
    (msg,) = build_set_messages("wg0", update)
    msg = _roundtrip(msg)
    assert msg["cmd"] == WG_CMD_SET_DEVICE
    assert msg.get_attr("WGDEVICE_A_IFNAME") == "wg0"
    assert msg.get_attr("WGDEVICE_A_LISTEN_PORT") == 51820
    p = _peer(msg)
    assert p.get_attr("WGPEER_A_FLAGS") == WGPEER_F_REPLACE_ALLOWEDIPS
    assert p.get_attr("WGPEER_A_ENDPOINT")["addr"] == "fd00::1" and p.get_attr("WGPEER_A_ENDPOINT")["port"] == 51821
    assert p.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") == 25
    assert _peer(msg, 1).get_attr("WGPEER_A_FLAGS") == WGPEER_F_REMOVE_ME
    assert _peer(msg, 2).get_attr("WGPEER_A_FLAGS") == WGPEER_F_UPDATE_ONLY
    dev = parse_dump([msg])  # the parser reads what the builder wrote
    assert dev.private_key == K[0]
    assert dev.peers[K[1]].allowed_ips == frozenset({"10.0.0.0/24", "fd00::/64"})
    assert dev.peers[K[1]].psk == K[2] and dev.peers[K[4]].endpoint == "1.2.3.4:5"


def test_large_updates_are_split_and_only_the_first_carries_device_fields() -> None:
    peers = tuple(PeerUpdate(public_key=k, allowed_ips=frozenset({f"10.1.{i}.0/24"})) for i, k in enumerate(K[:150]))
    msgs = [_roundtrip(m) for m in build_set_messages("wg0", DeviceUpdate(listen_port=1, peers=peers))]
    assert len(msgs) == 3
    assert msgs[0].get_attr("WGDEVICE_A_LISTEN_PORT") == 1
    assert all(m.get_attr("WGDEVICE_A_LISTEN_PORT") is None for m in msgs[1:])
    assert sum(len(m.get_attr("WGDEVICE_A_PEERS")) for m in msgs) == 150
    assert build_set_messages("wg0", DeviceUpdate()) == []


def test_split_dump_is_merged_by_public_key() -> None:
    """The kernel continues a peer with many allowed IPs in the next dump message under the same key."""
    first, second = wgmsg(), wgmsg()
    first["attrs"] += [["WGDEVICE_A_IFNAME", "wg0"], ["WGDEVICE_A_PRIVATE_KEY", K[0]],
                       ["WGDEVICE_A_LISTEN_PORT", 51820]]
    ip = lambda a, m: {"attrs": [["WGALLOWEDIP_A_FAMILY", 2], ["WGALLOWEDIP_A_IPADDR", bytes(a)],  # noqa: E731
                                 ["WGALLOWEDIP_A_CIDR_MASK", m]]}
    first["attrs"].append(["WGDEVICE_A_PEERS", [
        {"attrs": [["WGPEER_A_PUBLIC_KEY", K[1]], ["WGPEER_A_PRESHARED_KEY", ZERO_KEY],
                   ["WGPEER_A_ENDPOINT", {"addr": "10.0.0.9", "port": 51820}],
                   ["WGPEER_A_LAST_HANDSHAKE_TIME", {"tv_sec": 1700000000, "tv_nsec": 250000000}],
                   ["WGPEER_A_RX_BYTES", 10], ["WGPEER_A_TX_BYTES", 20],
                   ["WGPEER_A_ALLOWEDIPS", [ip([10, 0, 0, 1], 32)]]]}]])
    second["attrs"] += [["WGDEVICE_A_IFNAME", "wg0"], ["WGDEVICE_A_PEERS", [
        {"attrs": [["WGPEER_A_PUBLIC_KEY", K[1]], ["WGPEER_A_ALLOWEDIPS", [ip([10, 2, 0, 0], 16)]]]},
        {"attrs": [["WGPEER_A_PUBLIC_KEY", K[2]], ["WGPEER_A_ALLOWEDIPS", [ip([10, 3, 0, 0], 16)]]]}]]]
    dev = parse_dump([_roundtrip(first), _roundtrip(second)])
    assert dev.listen_port == 51820 and dev.private_key == K[0]
    p = dev.peers[K[1]]
    assert p.allowed_ips == frozenset({"10.0.0.1/32", "10.2.0.0/16"})
    assert p.psk == "" and p.endpoint == "10.0.0.9:51820" and (p.rx, p.tx) == (10, 20)
    assert p.last_handshake == 1700000000.25
    assert dev.peers[K[2]].allowed_ips == frozenset({"10.3.0.0/16"})


# These two show the missing module, this kernel's real answer. Where the module exists they would create a real
# interface in the host's namespace instead; there the converge drift test runs through the kernel backend in a
# lab namespace (tests/e2e/test_converge.py).
needs_no_module = pytest.mark.skipif(kernel_module_loaded(), reason="this kernel has the WireGuard module: the "
                                     "missing-module path cannot be shown, and the converge would touch the host")


@needs_no_module
def test_kernel_backend_reports_missing_module() -> None:
    assert kernel_module_loaded() is False  # this kernel: no WireGuard module (see the docstring)


@needs_no_module
async def test_no_module_and_no_permission_are_clear_converge_errors(monkeypatch) -> None:
    """Through the engine: one clear error line, nothing raised (the daemon keeps running). The missing module
    is this kernel's real answer; no permission (EPERM) cannot be produced without the module, so it is injected."""
    import errno

    import pyroute2
    from pyroute2.netlink.exceptions import NetlinkError

    from plexd.converge.engine import Engine
    from plexd.mesh.domain import WireGuardDomain
    from plexd.mesh.links import Links
    from plexd.state.desired import DesiredState

    desired = DesiredState.initial(interface="pxnokern0", listen_port=51820, mtu=1420, private_key=K[0],
                                   mesh_ip="10.100.0.1")
    converger = Engine([WireGuardDomain(KernelBackend("pxnokern0"), Links("pxnokern0"))])
    r = await converger.converge(desired)
    assert r.errors == ("the kernel has no WireGuard generic-netlink family (module not loaded)",) and not r.changes

    def no_permission(*args, **kwargs):
        raise NetlinkError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(pyroute2, "WireGuard", no_permission)
    r = await converger.converge(desired)
    assert r.errors == ("no permission for netlink: plexd must run as root or with CAP_NET_ADMIN",)


def test_both_backends_offer_what_the_engine_and_a_daemonless_deregister_call() -> None:
    """`plexd deregister` with no daemon running closed the backend it took the device down with; the kernel
    backend had no `close` (the systemd tier's first kernel run raised AttributeError there)."""
    from plexd.mesh.wireguard import WireGuardBackend
    from plexd.mesh.wireguard.userspace import UserspaceBackend

    assert isinstance(KernelBackend("pxnokern0"), WireGuardBackend)
    assert isinstance(UserspaceBackend("pxnokern0"), WireGuardBackend)
