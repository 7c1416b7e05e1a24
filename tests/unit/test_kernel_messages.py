"""Kernel WireGuard backend: the generic-netlink codec (plexd.machine.wireguard.genl) held to pyroute2's.

The kernel on these machines has no WireGuard module, so the netlink I/O itself runs only in the kernel tier's VM
(tests/e2e/test_converge.py and the kernel labs). Here pyroute2's own WireGuard message class is the reference:
what plexd packs, pyroute2 decodes to the same fields; dumps pyroute2 encodes as the kernel sends them, split
over several messages, plexd reads back merged.
"""

from __future__ import annotations

import base64
import ipaddress
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyroute2.netlink.generic.wireguard import (
    WG_CMD_SET_DEVICE,
    WGDEVICE_F_REPLACE_PEERS,
    WGPEER_F_REMOVE_ME,
    WGPEER_F_REPLACE_ALLOWEDIPS,
    WGPEER_F_UPDATE_ONLY,
    wgmsg,
)

from plexd.machine.wireguard import ZERO_KEY, DeviceUpdate, PeerUpdate, WireGuardError, kernel_module_loaded
from plexd.machine.wireguard.genl import get_request, parse_device, set_requests
from plexd.machine.wireguard.kernel import KernelBackend

K = [base64.b64encode(bytes([i]) * 32).decode() for i in range(1, 200)]


def _decoded(body: bytes) -> wgmsg:
    """A body plexd packed, as pyroute2 reads it (behind a netlink header, as the kernel gets it)."""
    header = (16 + len(body)).to_bytes(4, "little") + bytes(12)
    msg = wgmsg(header + body)
    msg.decode()
    return msg


def _encoded(msg: wgmsg) -> bytes:
    """A message pyroute2 packs, as plexd reads it: the body after the netlink header."""
    msg.encode()
    return bytes(msg.data[16:])


def _peer(msg: wgmsg, i: int = 0):
    return msg.get_attr("WGDEVICE_A_PEERS")[i]


def test_set_message_carries_device_and_peer_fields() -> None:
    update = DeviceUpdate(private_key=K[0], listen_port=51820, fwmark=7, replace_peers=True, peers=(
        PeerUpdate(public_key=K[1], endpoint="[fd00::1]:51821", allowed_ips=frozenset({"10.0.0.0/24", "fd00::/64"}),
                   psk=K[2], persistent_keepalive=25),
        PeerUpdate(public_key=K[3], remove=True),
        PeerUpdate(public_key=K[4], update_only=True, endpoint="1.2.3.4:5", psk=""),
    ))
    (body,) = set_requests("wg0", update)
    msg = _decoded(body)
    assert msg["cmd"] == WG_CMD_SET_DEVICE
    assert msg.get_attr("WGDEVICE_A_IFNAME") == "wg0"
    assert msg.get_attr("WGDEVICE_A_LISTEN_PORT") == 51820 and msg.get_attr("WGDEVICE_A_FWMARK") == 7
    assert msg.get_attr("WGDEVICE_A_FLAGS") == WGDEVICE_F_REPLACE_PEERS
    assert msg.get_attr("WGDEVICE_A_PRIVATE_KEY").decode() == K[0]
    p = _peer(msg)
    assert p.get_attr("WGPEER_A_PUBLIC_KEY").decode() == K[1] and p.get_attr("WGPEER_A_PRESHARED_KEY").decode() == K[2]
    assert p.get_attr("WGPEER_A_FLAGS") == WGPEER_F_REPLACE_ALLOWEDIPS
    assert p.get_attr("WGPEER_A_ENDPOINT")["addr"] == "fd00::1" and p.get_attr("WGPEER_A_ENDPOINT")["port"] == 51821
    assert p.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") == 25
    assert len(p.get_attr("WGPEER_A_ALLOWEDIPS")) == 2
    assert _peer(msg, 1).get_attr("WGPEER_A_FLAGS") == WGPEER_F_REMOVE_ME
    third = _peer(msg, 2)
    assert third.get_attr("WGPEER_A_FLAGS") == WGPEER_F_UPDATE_ONLY
    assert third.get_attr("WGPEER_A_ENDPOINT")["addr"] == "1.2.3.4" and third.get_attr("WGPEER_A_ENDPOINT")["port"] == 5
    assert third.get_attr("WGPEER_A_PRESHARED_KEY").decode() == ZERO_KEY  # "" clears the key
    dev = parse_device([body])  # and plexd's parser reads what its builder wrote
    assert dev.private_key == K[0]
    assert dev.peers[K[1]].allowed_ips == frozenset({"10.0.0.0/24", "fd00::/64"})
    assert dev.peers[K[1]].psk == K[2] and dev.peers[K[4]].endpoint == "1.2.3.4:5"
    assert dev.peers[K[1]].endpoint == "[fd00::1]:51821" and dev.peers[K[1]].persistent_keepalive == 25


def test_large_updates_are_split_and_only_the_first_carries_device_fields() -> None:
    peers = tuple(PeerUpdate(public_key=k, allowed_ips=frozenset({f"10.1.{i}.0/24"})) for i, k in enumerate(K[:150]))
    msgs = [_decoded(b) for b in set_requests("wg0", DeviceUpdate(listen_port=1, peers=peers))]
    assert len(msgs) == 3
    assert msgs[0].get_attr("WGDEVICE_A_LISTEN_PORT") == 1
    assert all(m.get_attr("WGDEVICE_A_LISTEN_PORT") is None for m in msgs[1:])
    assert sum(len(m.get_attr("WGDEVICE_A_PEERS")) for m in msgs) == 150
    assert set_requests("wg0", DeviceUpdate()) == []


def test_the_dump_request_names_the_interface() -> None:
    msg = _decoded(get_request("plexd0"))
    assert msg["cmd"] == 0 and msg.get_attr("WGDEVICE_A_IFNAME") == "plexd0"


def test_split_dump_is_merged_by_public_key() -> None:
    """The kernel continues a peer with many allowed IPs in the next dump message under the same key."""
    first, second = wgmsg(), wgmsg()
    first["attrs"] += [["WGDEVICE_A_IFNAME", "wg0"], ["WGDEVICE_A_PRIVATE_KEY", K[0]],
                       ["WGDEVICE_A_LISTEN_PORT", 51820], ["WGDEVICE_A_FWMARK", 9]]
    ip = lambda a, m, f=2: {"attrs": [["WGALLOWEDIP_A_FAMILY", f], ["WGALLOWEDIP_A_IPADDR", bytes(a)],  # noqa: E731
                                      ["WGALLOWEDIP_A_CIDR_MASK", m]]}
    first["attrs"].append(["WGDEVICE_A_PEERS", [
        {"attrs": [["WGPEER_A_PUBLIC_KEY", K[1]], ["WGPEER_A_PRESHARED_KEY", ZERO_KEY],
                   ["WGPEER_A_ENDPOINT", {"addr": "10.0.0.9", "port": 51820}],
                   ["WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL", 25],
                   ["WGPEER_A_LAST_HANDSHAKE_TIME", {"tv_sec": 1700000000, "tv_nsec": 250000000}],
                   ["WGPEER_A_RX_BYTES", 10], ["WGPEER_A_TX_BYTES", 20],
                   ["WGPEER_A_ALLOWEDIPS", [ip([10, 0, 0, 1], 32)]]]}]])
    second["attrs"] += [["WGDEVICE_A_IFNAME", "wg0"], ["WGDEVICE_A_PEERS", [
        {"attrs": [["WGPEER_A_PUBLIC_KEY", K[1]], ["WGPEER_A_ALLOWEDIPS", [ip([10, 2, 0, 0], 16)]]]},
        {"attrs": [["WGPEER_A_PUBLIC_KEY", K[2]], ["WGPEER_A_PRESHARED_KEY", K[3]],
                   ["WGPEER_A_ENDPOINT", {"addr": "fd00::9", "port": 7}],
                   ["WGPEER_A_ALLOWEDIPS", [ip([0xfd] + [0] * 15, 64, 10)]]]}]]]
    dev = parse_device([_encoded(first), _encoded(second)])
    assert (dev.listen_port, dev.private_key, dev.fwmark) == (51820, K[0], 9)
    p = dev.peers[K[1]]
    assert p.allowed_ips == frozenset({"10.0.0.1/32", "10.2.0.0/16"})
    assert p.psk == "" and p.endpoint == "10.0.0.9:51820" and (p.rx, p.tx) == (10, 20) and p.persistent_keepalive == 25
    assert p.last_handshake == 1700000000.25
    q = dev.peers[K[2]]
    assert q.allowed_ips == frozenset({"fd00::/64"}) and q.psk == K[3] and q.endpoint == "[fd00::9]:7"


keys = st.binary(min_size=32, max_size=32).map(lambda b: base64.b64encode(b).decode())
v4 = st.tuples(st.binary(min_size=4, max_size=4), st.integers(0, 32)).map(
    lambda t: f"{'.'.join(map(str, t[0]))}/{t[1]}")
peer_updates = st.builds(
    PeerUpdate, public_key=keys, update_only=st.booleans(),
    endpoint=st.none() | st.tuples(st.binary(min_size=4, max_size=4), st.integers(1, 65535)).map(
        lambda t: f"{'.'.join(map(str, t[0]))}:{t[1]}"),
    allowed_ips=st.none() | st.frozensets(v4, max_size=4), psk=st.none() | keys,
    persistent_keepalive=st.none() | st.integers(0, 65535))


@settings(max_examples=200, deadline=None)
@given(st.lists(peer_updates, max_size=80, unique_by=lambda p: p.public_key), st.none() | st.integers(0, 65535))
def test_what_plexd_packs_pyroute2_reads_as_the_same_fields(peers, port) -> None:
    bodies = set_requests("plexd0", DeviceUpdate(listen_port=port, peers=tuple(peers)))
    seen = [p for body in bodies for p in (_decoded(body).get_attr("WGDEVICE_A_PEERS") or [])]
    assert len(seen) == len(peers)
    for want, got in zip(peers, seen, strict=True):
        assert got.get_attr("WGPEER_A_PUBLIC_KEY").decode() == want.public_key
        if want.endpoint:
            ep = got.get_attr("WGPEER_A_ENDPOINT")
            assert f"{ep['addr']}:{ep['port']}" == want.endpoint
        if want.persistent_keepalive is not None:
            assert got.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") == want.persistent_keepalive
    device = parse_device(bodies)  # and back: plexd's parser agrees with its builder
    for want in peers:
        have = device.peers[want.public_key]
        assert have.allowed_ips == ({str(ipaddress.ip_network(ip, strict=False)) for ip in want.allowed_ips}
                                    if want.allowed_ips else frozenset())
        assert have.psk == (want.psk or "")


def _attr(kind: int, value: bytes) -> bytes:
    return (4 + len(value)).to_bytes(2, "little") + kind.to_bytes(2, "little") + value + bytes(-len(value) % 4)


# attribute-shaped garbage: right types, wrong sizes (a 1-byte port, an empty mask), nested where the parser looks
fields = st.lists(st.tuples(st.integers(0, 10), st.binary(max_size=40)), max_size=6).map(
    lambda fs: b"".join(_attr(k, v) for k, v in fs))
allowed = st.lists(fields.map(lambda f: _attr(0x8000, f)), max_size=3).map(lambda a: _attr(0x8000 | 9, b"".join(a)))
peer_blobs = st.tuples(st.binary(min_size=32, max_size=32), fields, allowed).map(
    lambda t: _attr(0x8000, _attr(1, t[0]) + t[1] + t[2]))
dump_bodies = st.tuples(fields, st.lists(peer_blobs, max_size=3)).map(
    lambda t: bytes(4) + t[0] + _attr(0x8000 | 8, b"".join(t[1])))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=120) | dump_bodies, max_size=4))
def test_a_garbled_dump_is_read_without_raising(bodies) -> None:
    """Bounded parsing: whatever the socket hands over, the parser returns a device (what it could read)."""
    parse_device([bytes(4) + b if len(b) < 4 else b for b in bodies])


def test_peers_with_many_allowed_ips_are_split_by_size_not_only_by_count() -> None:
    """A netlink attribute's length is 16 bits: 64 peers of 40 allowed IPs each do not fit in one message."""
    peers = tuple(PeerUpdate(public_key=k, allowed_ips=frozenset(f"10.{i}.{j}.0/24" for j in range(40)))
                  for i, k in enumerate(K[:64]))
    bodies = set_requests("wg0", DeviceUpdate(peers=peers))
    assert len(bodies) > 1 and all(len(b) < 65_536 for b in bodies)
    assert sum(len(_decoded(b).get_attr("WGDEVICE_A_PEERS")) for b in bodies) == 64
    assert all(len(p.allowed_ips) == 40 for p in parse_device(bodies).peers.values())


def test_a_scoped_ipv6_endpoint_reads_back_as_the_model_writes_it() -> None:
    update = DeviceUpdate(peers=(PeerUpdate(public_key=K[1], endpoint="[fe80::1%lo]:51820"),))
    (body,) = set_requests("wg0", update)
    assert parse_device([body]).peers[K[1]].endpoint == "[fe80::1%lo]:51820"
    with pytest.raises(WireGuardError, match="no interface 'pxnosuch0'"):
        set_requests("wg0", DeviceUpdate(peers=(PeerUpdate(public_key=K[1], endpoint="[fe80::1%pxnosuch0]:1"),)))


def test_a_malformed_key_or_endpoint_is_a_wireguard_error_naming_it() -> None:
    with pytest.raises(WireGuardError, match="public key"):
        set_requests("wg0", DeviceUpdate(peers=(PeerUpdate(public_key="short"),)))
    with pytest.raises(WireGuardError, match="endpoint 'host:1'"):
        set_requests("wg0", DeviceUpdate(peers=(PeerUpdate(public_key=K[1], endpoint="host:1"),)))
    with pytest.raises(WireGuardError, match="private key"):
        set_requests("wg0", DeviceUpdate(private_key=base64.b64encode(os.urandom(16)).decode()))


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

    from plexd.converge.engine import Engine
    from plexd.machine.links import Links
    from plexd.machine.wireguard import genl
    from plexd.mesh.wireguard_domain import WireGuardDomain
    from plexd.state.desired import DesiredState

    desired = DesiredState.initial(interface="pxnokern0", listen_port=51820, mtu=1420, private_key=K[0],
                                   mesh_ip="10.100.0.1")
    converger = Engine([WireGuardDomain(KernelBackend("pxnokern0"), Links("pxnokern0"))])
    r = await converger.converge(desired)
    assert r.errors == ("the kernel has no WireGuard generic-netlink family (module not loaded)",) and not r.changes

    def no_permission(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(genl, "family_id", no_permission)
    r = await converger.converge(desired)
    assert r.errors == ("no permission for netlink: plexd must run as root or with CAP_NET_ADMIN",)


def test_both_backends_offer_what_the_engine_and_a_daemonless_deregister_call() -> None:
    """`plexd deregister` with no daemon running closed the backend it took the device down with; the kernel
    backend had no `close` (the systemd tier's first kernel run raised AttributeError there)."""
    from plexd.machine.wireguard import WireGuardBackend
    from plexd.machine.wireguard.userspace import UserspaceBackend

    assert isinstance(KernelBackend("pxnokern0"), WireGuardBackend)
    assert isinstance(UserspaceBackend("pxnokern0"), WireGuardBackend)
