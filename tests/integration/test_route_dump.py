"""Raw rtnetlink (plexd.machine.rtnl) against the real kernel: what it decodes from a dump is what pyroute2 decodes of
the same tables (tables past 255, IPv6, default routes with one gateway and with several, kernel and unicast
routes), links, addresses and rules; what it writes is what pyroute2 wrote; and the mesh link (plexd.machine.links)
reads and changes its routes, addresses, MTU, state and rules through it."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import subprocess

import pytest
from pyroute2 import IPRoute

from plexd.machine.links import Links
from plexd.machine.rtnl import dump_addresses, dump_links, dump_routes, dump_rules, link_names, route_write, write

pytestmark = pytest.mark.root

TABLE = 51820


def _ip(netns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", netns, *args], check=True)


@pytest.fixture
def netns():
    name = f"pxt-rtdump-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        _ip(name, "link", "add", "mesh0", "type", "veth", "peer", "name", "mesh1")
        for link in ("mesh0", "mesh1"):
            _ip(name, "link", "set", link, "up")
        _ip(name, "addr", "add", "10.99.0.1/24", "dev", "mesh1")
        _ip(name, "addr", "add", "fd00::1/64", "dev", "mesh1", "nodad")
        _ip(name, "route", "add", "default", "nexthop", "via", "10.99.0.2", "nexthop", "via", "10.99.0.3")
        _ip(name, "-6", "route", "add", "default", "via", "fd00::2")
        batch = [f"route add 10.100.{i // 250}.{i % 250 + 1}/32 dev mesh0 table {TABLE}" for i in range(600)]
        batch += ["route add 10.100.200.0/24 dev mesh0", "route add fd01::/64 dev mesh0 table 51820",
                  "route add blackhole 10.100.201.0/24 table 51820"]
        subprocess.run(["ip", "-n", name, "-batch", "-"], input="\n".join(batch) + "\n", text=True, check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _gateways(route) -> tuple[str, ...]:
    """A route's gateway, or each of its multipath hops', as pyroute2 decodes them."""
    hops = [route, *(route.get("RTA_MULTIPATH") or ())]
    return tuple(str(hop.get("RTA_GATEWAY")) for hop in hops if hop.get("RTA_GATEWAY"))


def test_the_raw_dump_reads_what_pyroute2_reads(netns):
    for family in (socket.AF_INET, socket.AF_INET6):
        ours = {(r.table, r.dst, r.oif, r.protocol, r.type, r.gateways) for r in dump_routes(family, netns)}
        with IPRoute(netns=netns) as ipr:
            theirs = {(r.get("RTA_TABLE"), str(ipaddress.ip_network(
                f"{r.get('RTA_DST') or ('0.0.0.0' if family == socket.AF_INET else '::')}/{r['dst_len']}")),
                r.get("RTA_OIF"), r["proto"], r["type"], _gateways(r)) for r in ipr.get_routes(family=family)}
        assert ours == theirs and len(ours) > (600 if family == socket.AF_INET else 1)
    assert ("10.99.0.2", "10.99.0.3") in {r.gateways for r in dump_routes(socket.AF_INET, netns) if r.default}


async def test_the_mesh_link_reads_its_routes_from_the_dump(netns):
    state = await Links("mesh0", netns=netns, table=TABLE).observe()
    assert state is not None
    assert len(state.routes) == 601 and "10.100.0.1/32" in state.routes and "fd01::/64" in state.routes
    assert "10.100.201.0/24" not in state.routes  # a blackhole route is not via the interface
    assert state.main_routes == frozenset({"10.100.200.0/24"})  # the kernel's own (link) routes are left out


async def test_the_machines_gateways_are_read_from_the_dump(netns):
    underlay = await Links("mesh0", netns=netns, table=TABLE).underlay()
    assert underlay.gateways == frozenset({"10.99.0.2", "10.99.0.3", "fd00::2"})


def test_links_addresses_and_rules_are_what_pyroute2_reads(netns):
    _ip(netns, "addr", "add", "192.0.2.7/32", "peer", "192.0.2.8", "dev", "mesh0")  # point-to-point: IFA_ADDRESS
    _ip(netns, "link", "set", "mesh1", "mtu", "1380")
    _ip(netns, "rule", "add", "table", str(TABLE), "priority", "5182")
    _ip(netns, "-6", "rule", "add", "table", "100", "priority", "77")
    with IPRoute(netns=netns) as ipr:
        links = {(link["index"], link.get_attr("IFLA_IFNAME"),
                  link.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND") or "", link.get_attr("IFLA_MTU"),
                  bool(link["flags"] & 1)) for link in ipr.get_links()}
        addresses = {(a["index"], a["family"], a["prefixlen"], a["scope"], a.get("IFA_ADDRESS"))
                     for a in ipr.get_addr() if a.get("IFA_ADDRESS")}
        rules = {family: {(r.get("FRA_TABLE") or r["table"], r.get("FRA_PRIORITY") or 0, r["action"])
                          for r in ipr.get_rules(family=family)} for family in (socket.AF_INET, socket.AF_INET6)}
    assert {(k.index, k.name, k.kind, k.mtu, k.up) for k in dump_links(netns)} == links
    assert ("veth", 1380) in {(k.kind, k.mtu) for k in dump_links(netns) if k.name == "mesh1"}
    assert {(a.index, a.family, a.prefixlen, a.scope, a.address) for a in dump_addresses(netns)} == addresses
    assert len(addresses) >= 4
    for family, theirs in rules.items():
        assert {(r.table, r.priority, r.action) for r in dump_rules(family, netns)} == theirs
    assert (TABLE, 5182, 1) in rules[socket.AF_INET] and (100, 77, 1) in rules[socket.AF_INET6]


async def test_the_machines_addresses_leave_out_the_mesh_link_and_ipv6_link_local(netns):
    _ip(netns, "addr", "add", "10.100.0.9/32", "dev", "mesh0")
    underlay = await Links("mesh0", netns=netns, table=TABLE).underlay()
    assert {"10.99.0.1/24", "fd00::1/64"} <= underlay.addresses
    assert "10.100.0.9/32" not in underlay.addresses and not any(a.startswith("fe80") for a in underlay.addresses)
    assert ("10.99.0.1/24", "mesh1") in underlay.on


def test_route_writes_in_one_batch_put_routes_as_pyroute2_did_and_name_each_failure(netns):
    index = next(i for i, name in link_names(netns).items() if name == "mesh0")
    with IPRoute(netns=netns) as ipr:  # the reference: how plexd wrote routes before
        ipr.route("replace", dst="10.98.0.1/32", oif=index, table=TABLE)
    writes = [route_write(True, f"10.97.{i // 250}.{i % 250 + 1}/32", index, TABLE) for i in range(300)]
    writes += [route_write(True, "fd02::7/128", index, TABLE), route_write(True, "10.96.0.0/24", index, 254),
               route_write(True, "10.97.0.1/32", index, TABLE),  # again: replace is idempotent
               route_write(False, "10.95.0.1/32", index, TABLE),  # not there
               route_write(False, "10.97.0.2/32", index, TABLE)]
    codes = write(writes, netns)
    assert codes[:-2] == [0] * (len(writes) - 2) and codes[-2] == errno.ESRCH and codes[-1] == 0
    routes = {r.dst: r for family in (socket.AF_INET, socket.AF_INET6) for r in dump_routes(family, netns)}
    ours, theirs = routes["10.97.0.1/32"], routes["10.98.0.1/32"]
    assert (ours.table, ours.oif, ours.protocol, ours.type) == (theirs.table, theirs.oif, theirs.protocol,
                                                                theirs.type) == (TABLE, index, 4, 1)
    assert "10.97.0.2/32" not in routes and "10.97.1.50/32" in routes and routes["fd02::7/128"].table == TABLE
    assert routes["10.96.0.0/24"].table == 254


async def test_the_mesh_link_writes_routes_in_order_and_reports_only_real_failures(netns):
    from plexd.machine.links import LinkOp

    links = Links("mesh0", netns=netns, table=TABLE)
    failures = await links.apply([LinkOp("route_add", "10.94.0.1/32"), LinkOp("route_add", "fd03::1/128"),
                                  LinkOp("route_del", "10.94.9.9/32"),  # already gone: the goal is met
                                  LinkOp("mtu", 1380), LinkOp("route_del", "10.94.0.1/32"),
                                  LinkOp("route_add", "not-a-prefix")])
    assert [(op.value, "is not an IP network" in why) for op, why in failures] == [("not-a-prefix", True)]
    state = await links.observe()
    assert "fd03::1/128" in state.routes and "10.94.0.1/32" not in state.routes and state.mtu == 1380
    assert await Links("nope0", netns=netns, table=TABLE).apply([LinkOp("route_add", "10.94.0.2/32")]) == [
        (LinkOp("route_add", "10.94.0.2/32"), "interface nope0 does not exist")]


async def test_the_mesh_link_sets_its_state_addresses_and_rules_and_goes_with_them(netns):
    from plexd.machine.links import LinkOp

    _ip(netns, "link", "add", "mesh9", "type", "veth", "peer", "name", "mesh8")
    links = Links("mesh9", netns=netns, table=TABLE, rule_priority=5190)
    before = await links.observe()
    assert before is not None and not before.up and before.kind == "veth" and before.rules == frozenset()
    ops = [LinkOp("mtu", 1300), LinkOp("up"), LinkOp("addr_add", "10.93.0.1/16"), LinkOp("addr_add", "fd09::1/64"),
           LinkOp("addr_add", "10.93.0.1/16"),  # there already: the goal is met
           LinkOp("rule_add", 4), LinkOp("rule_add", 6), LinkOp("route_add", "10.93.5.0/24")]
    assert await links.apply(ops) == []
    state = await links.observe()
    assert (state.mtu, state.up, state.rules) == (1300, True, frozenset({4, 6}))
    assert state.addresses == frozenset({"10.93.0.1/16", "fd09::1/64"}) and state.routes == frozenset({"10.93.5.0/24"})
    assert await links.apply([LinkOp("addr_del", "fd09::1/64")]) == []
    assert (await links.observe()).addresses == frozenset({"10.93.0.1/16"})

    await links.delete_link()  # the mesh table still holds mesh0's routes: the rules stay for them
    assert await links.observe() is None and await links.observe_rules() == frozenset({4, 6})
    _ip(netns, "route", "flush", "table", str(TABLE))
    _ip(netns, "-6", "route", "flush", "table", str(TABLE))
    await links.delete_link()  # nothing left in the table: the rules go too
    assert await links.observe_rules() == frozenset()
