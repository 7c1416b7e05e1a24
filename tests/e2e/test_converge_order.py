"""The order of a full apply's writes, against real wireguard-go and the real routing table in a namespace: the
link's new routes go beside the device's transaction, a removed peer's route leaves only once the device has
dropped the peer (in between, its packets are dropped by the device, never sent to the default route)."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from mesh_helpers import mesh_node

from plexd.devplane.lab import Lab
from plexd.machine.links import DEFAULT_TABLE

pytestmark = pytest.mark.root


@pytest.fixture
async def lab3():
    lab = Lab().up(3)
    nodes = []
    try:
        nodes = [mesh_node(lab, i) for i in (1, 2, 3)]
        yield lab, nodes
    finally:
        for n in nodes:
            await n.backend.close()
        lab.down()
        assert lab.leaks() == []


async def test_a_removed_peers_route_leaves_only_after_the_device_dropped_the_peer(lab3) -> None:
    lab, (a, b, c) = lab3
    assert (await a.converger.converge(a.desired([b, c]))).ok

    def mesh_routes() -> list[ipaddress.IPv4Network]:  # (routes are merged: one prefix may cover two peers)
        out = lab.exec(a.lab_node, ["ip", "route", "show", "table", str(DEFAULT_TABLE), "dev", "wg0"]).stdout
        return [ipaddress.ip_network(line.split()[0]) for line in out.splitlines()]

    def routed(ip: str, routes: list[ipaddress.IPv4Network]) -> bool:
        return any(ipaddress.ip_address(ip) in net for net in routes)

    # (this device write removes a peer, the mesh table at that moment)
    seen: list[tuple[bool, list[ipaddress.IPv4Network]]] = []
    real_apply = a.backend.apply

    async def watched_apply(update):
        # Time enough for any link write started beside this one to land, so a removal sent too early shows.
        await asyncio.sleep(0.3)
        seen.append((any(p.remove for p in update.peers), mesh_routes()))
        await real_apply(update)

    a.backend.apply = watched_apply
    result = await a.converger.converge(a.desired([b]))
    assert result.ok, result.errors
    removals = [routes for removes, routes in seen if removes]
    assert removals, seen
    assert all(routed(c.mesh_ip, routes) for routes in removals), removals  # still routed to the device
    assert not routed(c.mesh_ip, mesh_routes())  # and gone once the device had dropped the peer
    assert routed(b.mesh_ip, mesh_routes())
    assert {line[0] for line in a.wg_dump(lab)[1:]} == {b.public_key}
