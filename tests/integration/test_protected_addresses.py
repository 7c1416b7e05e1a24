"""What the route guard protects is read from the live machine (a namespace of its own, real netlink): its
addresses and LANs, the gateways of its default routes (an on-link one outside every LAN included), the
resolvers of its resolv.conf and the control plane; and the mesh table's rule goes away with the last interface
that routes through it, not before."""

from __future__ import annotations

import ipaddress
import os
import subprocess

import pytest

from plexd.machine.links import DEFAULT_TABLE, LinkOp, Links
from plexd.node.protected import ProtectedAddresses, parse_nameservers

pytestmark = pytest.mark.root


@pytest.fixture
def netns():
    name = f"pxt-guard-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def ip(netns: str, *args: str) -> str:
    return subprocess.run(["ip", "-n", netns, *args], check=True, capture_output=True, text=True).stdout


async def test_the_guard_reads_addresses_lans_gateways_and_resolvers(netns, tmp_path):
    ip(netns, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    ip(netns, "addr", "add", "10.9.0.2/24", "dev", "v0")
    ip(netns, "-6", "addr", "add", "fd00:9::2/64", "dev", "v0", "nodad")
    ip(netns, "link", "set", "v0", "up")
    ip(netns, "link", "set", "v1", "up")
    ip(netns, "route", "add", "default", "via", "10.9.0.1")
    ip(netns, "route", "add", "default", "via", "203.0.113.1", "dev", "v0", "onlink", "metric", "200")
    ip(netns, "-6", "route", "add", "default", "via", "fd00:9::1")
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("# a comment\nsearch lab\nnameserver 198.18.0.53\nnameserver fe80::53%v0\noptions ndots:2\n")
    guard = ProtectedAddresses("https://198.51.100.7:8443", Links("plexd0", netns=netns), resolv_conf=str(resolv))
    limits = await guard.refresh()
    named = {g.what: g.net for g in limits.guarded}
    assert named["the default gateway 10.9.0.1"] == ipaddress.ip_network("10.9.0.1/32")
    assert named["the default gateway 203.0.113.1"] == ipaddress.ip_network("203.0.113.1/32")  # outside any LAN
    assert "the default gateway fd00:9::1" in named
    assert named["the DNS resolver 198.18.0.53"] == ipaddress.ip_network("198.18.0.53/32")
    assert "the DNS resolver fe80::53" in named
    assert named["this node's LAN 10.9.0.0/24"] == ipaddress.ip_network("10.9.0.0/24")
    assert "this node's LAN fd00:9::/64" in named
    assert {"the cloud metadata service 169.254.169.254", "the link-local range 169.254.0.0/16"} <= set(named)
    assert {ipaddress.ip_address(a) for a in ("10.9.0.2", "fd00:9::2", "198.51.100.7")} <= limits.protected

    # a resolver that changes is picked up by the next refresh; a resolv.conf that cannot be read keeps the last
    resolv.write_text("nameserver 198.18.0.54\n")
    assert "the DNS resolver 198.18.0.54" in {g.what for g in (await guard.refresh()).guarded}
    resolv.unlink()
    resolv.mkdir()  # reading a directory fails
    assert "the DNS resolver 198.18.0.54" in {g.what for g in (await guard.refresh()).guarded}


def test_nameservers_are_read_from_resolv_conf_lines_only():
    text = "nameserver 10.0.0.1\n nameserver 10.0.0.2\nnameserver not-an-ip\n#nameserver 10.0.0.3\nnameserver\n"
    assert parse_nameservers(text) == {"10.0.0.1", "10.0.0.2"}


async def test_mesh_routes_go_to_their_own_table_and_its_rule_leaves_with_the_last_route(netns):
    ip(netns, "tuntap", "add", "mesh0", "mode", "tun")
    ip(netns, "tuntap", "add", "mesh1", "mode", "tun")
    for dev in ("mesh0", "mesh1"):
        ip(netns, "link", "set", dev, "up")
    ip(netns, "route", "add", "10.50.0.0/24", "dev", "mesh1")  # a main-table route another tool owns
    one, two = Links("mesh0", netns=netns), Links("mesh1", netns=netns)
    assert await one.apply([LinkOp("rule_add", 4), LinkOp("route_add", "10.50.0.0/24"),
                            LinkOp("rule_add", 6), LinkOp("route_add", "fd00:50::/64")]) == []
    assert await two.apply([LinkOp("route_add", "10.60.0.0/24")]) == []
    state = await one.observe()
    assert state is not None
    assert state.routes == {"10.50.0.0/24", "fd00:50::/64"} and state.rules == {4, 6} and state.main_routes == set()
    # the main table's own route for the same prefix was not replaced
    assert "10.50.0.0/24 dev mesh1" in ip(netns, "route", "show", "table", "main")
    assert (await two.observe()).main_routes == {"10.50.0.0/24"}  # type: ignore[union-attr]
    await one.delete_link()  # mesh1 still routes through the table: the rules stay
    assert f"lookup {DEFAULT_TABLE}" in ip(netns, "rule", "show")
    await two.delete_link()
    assert f"lookup {DEFAULT_TABLE}" not in ip(netns, "rule", "show") + ip(netns, "-6", "rule", "show")
