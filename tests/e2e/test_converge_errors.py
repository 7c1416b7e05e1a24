"""Bad input through the engine and its WireGuard domain, against real wireguard-go in namespaces: a UAPI `errno`
reply for a setting or for one peer, and no permission to create the device. Each is one clear log line naming the
setting or peer, the rest of the configuration is still applied, and the next converge tries again (nothing raises)."""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import replace

import pytest
from mesh_helpers import keypair, mesh_node, ping

from plexd.converge.engine import Engine
from plexd.devplane.lab import Lab
from plexd.machine.links import Links
from plexd.machine.wireguard import DeviceUpdate
from plexd.machine.wireguard.userspace import UserspaceBackend
from plexd.mesh.wireguard_domain import WireGuardDomain
from plexd.state.model import Peer

HOLD_PORT = ("import socket, sys\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.bind(('0.0.0.0', 51820))\n"
             "print('bound', flush=True)\nsys.stdin.read()\n")


@pytest.fixture
async def pair():
    lab = Lab().up(2)
    nodes = []
    try:
        nodes = [mesh_node(lab, 1), mesh_node(lab, 2)]
        yield lab, *nodes
    finally:
        for n in nodes:
            await n.backend.close()
        lab.down()
        assert lab.leaks() == []



def errors_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and r.name in ("plexd.converge.engine", "plexd.mesh.wireguard_domain")]


async def test_listen_port_refused_is_named_and_the_peers_are_still_configured(pair, caplog) -> None:
    lab, a, b = pair
    holder = lab.spawn(["ip", "netns", "exec", a.lab_node.netns, sys.executable, "-c", HOLD_PORT],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "bound"
    assert (await b.converger.converge(b.desired([a]))).ok
    da = a.desired([b])
    r = await a.converger.converge(da)
    assert len(r.errors) == 1 and "listen_port=51820 on wg0: errno=" in r.errors[0], r.errors
    assert "private key" not in r.errors[0] and "peer" not in r.errors[0]  # only the refused setting is named
    assert errors_logged(caplog) == [r.errors[0]]
    types = [c.type for c in r.corrections()]
    assert "listen_port_updated" not in types and "peer_added" in types and "private_key_updated" in types
    assert [row[0] for row in a.wg_dump(lab)[1:]] == [b.public_key]

    # the next converge tries again (level-triggered); once the port is free it is corrected
    again = await a.converger.converge(da)
    assert again.errors == r.errors and again.changes == ()
    holder.stdin.close()
    holder.wait(5)
    fixed = await a.converger.converge(da)
    assert fixed.ok and [c.type for c in fixed.corrections()] == ["listen_port_updated"]
    assert a.wg_dump(lab)[0][2] == "51820"
    assert ping(lab, a, b.mesh_ip)


class RefusingBackend(UserspaceBackend):
    """Real wireguard-go; one peer's endpoint is sent in a form it refuses, so the errno reply is the real one."""

    refuse_key = ""

    async def apply(self, update: DeviceUpdate) -> None:
        peers = tuple(replace(p, endpoint="bogus") if p.public_key == self.refuse_key and p.endpoint else p
                      for p in update.peers)
        await super().apply(replace(update, peers=peers))


async def test_a_peer_the_device_refuses_is_named_and_the_rest_configured(pair, caplog) -> None:
    lab, a, b = pair
    backend = RefusingBackend("wg0", socket_dir=a.lab_node.sock_dir, launch_prefix=a.lab_node.wrap([]))
    a.backend = backend  # closed by the fixture
    a.converger = converger = Engine([WireGuardDomain(backend, Links("wg0", netns=a.lab_node.netns))])
    _, ghost_key = keypair()
    backend.refuse_key = ghost_key
    ghost = Peer(id="n_ghost", public_key=ghost_key, mesh_ip="10.100.0.77", endpoint="10.231.255.77:51820",
                 allowed_ips=("10.100.0.77/32",))
    assert (await b.converger.converge(b.desired([a]))).ok
    da = a.desired([b]).with_peer(ghost)

    r = await converger.converge(da)
    assert len(r.errors) == 1 and r.errors[0].startswith("peer n_ghost: WireGuard refused peer "), r.errors
    assert "errno=" in r.errors[0] and "endpoint=bogus" in r.errors[0]
    assert errors_logged(caplog) == [r.errors[0]]
    details = [c.detail for c in r.corrections()]
    assert "peer n_2: missing from the device" in details and not any("n_ghost" in d for d in details)
    # wireguard-go creates the peer at its public_key line and stops at the refused one: a bare peer without
    # allowed IPs (it routes nothing) is all that is left of it
    dump = {row[0]: row for row in a.wg_dump(lab)[1:]}
    assert dump[b.public_key][3] == f"{b.mesh_ip}/32" and dump[ghost_key][3] == "(none)"
    assert ping(lab, a, b.mesh_ip)

    again = await converger.converge(da)  # tried again, refused again, the rest untouched
    assert len(again.errors) == 1 and again.errors[0].startswith("peer n_ghost: WireGuard refused peer ")
    assert again.changes == () and backend.pid is not None and ping(lab, a, b.mesh_ip)
    backend.refuse_key = ""
    fixed = await converger.converge(da)
    assert fixed.ok and fixed.changes and all(c.peer_id == "n_ghost" for c in fixed.changes)
    assert {row[0]: row[3] for row in a.wg_dump(lab)[1:]}[ghost_key] == "10.100.0.77/32"


async def test_no_permission_to_create_the_device_is_one_clear_error(pair) -> None:
    _, a, b = pair
    # root without CAP_NET_ADMIN (dropped from the bounding set before exec): wireguard-go cannot create its TUN
    node = a.lab_node
    backend = UserspaceBackend("wg0", socket_dir=node.sock_dir,
                               launch_prefix=node.wrap(["setpriv", "--bounding-set", "-net_admin", "--"]))
    converger = Engine([WireGuardDomain(backend, Links("wg0", netns=node.netns))])
    try:
        r = await converger.converge(a.desired([b]))
        assert not r.ok and r.changes == () and len(r.errors) == 1
        assert r.errors[0].startswith("wireguard-go for wg0 exited with status"), r.errors
        assert "not permitted" in r.errors[0], r.errors
        assert backend.pid is None and await backend.observe() is None
        assert not (await converger.converge(a.desired([b]))).ok  # and again, without raising
    finally:
        await backend.close()
