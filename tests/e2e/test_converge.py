"""The converge engine against real wireguard-go in namespaces: drift made by hand is corrected and named.

Each case changes the live machine behind plexd's back (with `wg set`, `ip addr del`, `kill -9`), runs the next
converge, and checks both the result's corrections and the device as the real `wg show wg0 dump` sees it.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from mesh_helpers import keypair, mesh_node, ping

from plexd.lab import Lab
from plexd.model import Peer


@pytest.fixture
async def pair():
    lab = Lab().up(2)
    a = b = None
    try:
        a, b = mesh_node(lab, 1), mesh_node(lab, 2)
        yield lab, a, b
    finally:
        for n in (a, b):
            if n is not None:
                await n.backend.close()
        lab.down()
        assert lab.leaks() == []



def corrections(result) -> list[tuple[str, str]]:
    return [(c.type, c.detail) for c in result.corrections()]


async def test_drift_is_corrected_and_named(pair) -> None:
    lab, a, b = pair
    # n_3 is a peer that never answers (no handshake): its endpoint is not protected by the roaming window
    _, ghost_key = keypair()
    ghost = Peer(id="n_ghost", public_key=ghost_key, mesh_ip="10.100.0.77", endpoint="10.231.255.77:51820",
                 allowed_ips=("10.100.0.77/32",))
    da = a.desired([b]).with_peer(ghost)
    db = b.desired([a])
    assert (await b.converger.converge(db)).ok  # responder first (environment.md gotcha)
    first = await a.converger.converge(da)
    assert first.ok and ("interface_created", "interface wg0: missing, created") in corrections(first)
    assert {"peer n_2: missing from the device", "peer n_ghost: missing from the device"} <= {
        c.detail for c in first.changes}
    assert ping(lab, a, b.mesh_ip)
    assert (await a.converger.converge(da)).changes == ()  # nothing to do: nothing reported

    # 1. a peer removed by hand
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", b.public_key, "remove"])
    r = await a.converger.converge(da)
    assert corrections(r) == [("peer_added", "peer n_2: missing from the device")]
    assert b.public_key in {row[0] for row in a.wg_dump(lab)[1:]}

    # 2. a changed endpoint (the ghost never handshakes, so the endpoint is corrected)
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", ghost_key, "endpoint", "10.231.255.78:4444"])
    r = await a.converger.converge(da)
    assert corrections(r) == [("peer_updated", "peer n_ghost: endpoint 10.231.255.78:4444 != 10.231.255.77:51820")]
    assert {row[0]: row[2] for row in a.wg_dump(lab)[1:]}[ghost_key] == "10.231.255.77:51820"
    # ... but a peer that handshook within 180 s roamed: its endpoint is left alone
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", b.public_key, "endpoint", f"{b.lab_node.address}:51820"])
    assert ping(lab, a, b.mesh_ip)
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", b.public_key, "endpoint", "10.231.255.79:51820"])
    assert (await a.converger.converge(da)).changes == ()

    # 3. an extra peer added by hand
    _, stranger = keypair()
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", stranger, "allowed-ips", "10.100.0.99/32"])
    r = await a.converger.converge(da)
    assert corrections(r) == [("peer_removed", f"peer {stranger[:8]}…: on the device but not desired")]
    assert stranger not in {row[0] for row in a.wg_dump(lab)[1:]}

    # 4. the address deleted
    lab.exec(a.lab_node, ["ip", "addr", "del", f"{a.mesh_ip}/32", "dev", "wg0"])
    r = await a.converger.converge(da)
    # (the kernel drops a link's IPv4 routes with its last IPv4 address, so those come back too)
    assert corrections(r) == [("address_added", f"interface wg0: address {a.mesh_ip}/32 missing"),
                              ("route_added", f"interface wg0: route {b.mesh_ip}/32 missing"),
                              ("route_added", "interface wg0: route 10.100.0.77/32 missing")]
    assert f"inet {a.mesh_ip}/32" in lab.exec(a.lab_node, ["ip", "addr", "show", "wg0"]).stdout

    # 5. the userspace process killed: restarted and fully re-configured
    old_pid = a.backend.pid
    os.kill(old_pid, signal.SIGKILL)
    for _ in range(200):
        if a.backend.process_gone():
            break
        await asyncio.sleep(0.01)
    r = await a.converger.converge(da)
    types = [t for t, _ in corrections(r)]
    assert types[0] == "userspace_restarted" and types.count("peer_added") == 2
    assert {"address_added", "route_added", "link_up", "private_key_updated"} <= set(types)
    assert a.backend.pid not in (None, old_pid)
    assert {row[0] for row in a.wg_dump(lab)[1:]} == {b.public_key, ghost_key}
    assert ping(lab, a, b.mesh_ip)
    assert (await a.converger.converge(da)).changes == ()


async def test_invalid_peers_skipped_rest_configured_and_dry_run(pair) -> None:
    lab, a, b = pair
    bad = Peer(id="n_bad", public_key="AAAA", mesh_ip="10.100.0.9", allowed_ips=("10.100.0.9/32",))
    da = a.desired([b]).with_peer(bad)
    plan = await a.converger.converge(da, dry_run=True)
    assert plan.dry_run and plan.changes and await a.backend.observe() is None  # nothing applied
    r = await a.converger.converge(da)
    assert r.ok and r.skipped_peers == (("n_bad", "public key 'AAAA' is not base64 of 32 bytes"),)
    assert [row[0] for row in a.wg_dump(lab)[1:]] == [b.public_key]
    # concurrent converges are serialised: the second finds nothing left to do
    r1, r2 = await asyncio.gather(a.converger.converge(da), a.converger.converge(da))
    assert r1.ok and r2.ok and r1.changes == r2.changes == ()


async def test_interface_taken_by_another_link_is_a_clear_error(pair) -> None:
    lab, a, b = pair
    lab.exec(a.lab_node, ["ip", "link", "add", "wg0", "type", "bridge"])
    r = await a.converger.converge(a.desired([b]))
    assert not r.ok and r.changes == ()
    assert r.errors == ("interface wg0 already exists and is a bridge link, not WireGuard: delete it or set "
                        "mesh.interface to another name",)
    assert a.backend.pid is None
