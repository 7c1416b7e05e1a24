"""A new domain plugged into the engine of a running daemon (in-process, against the real devplane) with no change
outside its module (tests/toy_domain.py) and the list of domains: observed, diffed, repaired and reported."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
from recording_device import RecordingDomain, in_process_config
from toy_domain import HostsFile
from waiting import wait_for

from plexd.converge.engine import Engine
from plexd.devplane.harness import Devplane
from plexd.node import assembly
from plexd.node.mesh import MeshHandle
from plexd.state.desired import DesiredState


@pytest.fixture
def devplane(tmp_path):
    # liveness long enough that the second node, which never heartbeats, stays a peer however slow the machine
    with Devplane(tmp_path / "dp", heartbeat_interval="30s", keepalive="1s") as dp:
        yield dp


def register_other(devplane) -> dict:
    token = devplane.admin.create_token()
    public = base64.b64encode(b"\x07" * 32).decode()
    return httpx.post(f"{devplane.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                      json={"token": token, "public_key": public, "hostname": "px-other"}).json()


async def test_a_toy_domain_is_observed_diffed_repaired_and_reported(devplane, tmp_path):
    config = in_process_config(devplane, tmp_path)
    hosts = HostsFile(tmp_path / "mesh-hosts")
    connected = {}

    def install(agent):
        desired = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420,
                                       private_key=base64.b64encode(agent.identity.private_key).decode(),
                                       mesh_ip=agent.identity.mesh_ip)
        # The list of domains: the device (a recording stand-in here: no namespaces) and the toy.
        connected["mesh"] = mesh = MeshHandle(Engine([RecordingDomain(), hosts]), desired)
        connected["node"] = assembly.assemble(agent, mesh=mesh)
        return connected["node"]

    stop = asyncio.Event()
    run = asyncio.create_task(assembly.run(config, stop_event=stop, assemble=install))
    try:
        await wait_for(lambda: "node" in connected and connected["node"].stream.connected.is_set(), what="stream")
        node_id = devplane.admin.nodes()[0]["id"]
        other = register_other(devplane)
        line = f"{other['mesh_ip']} {other['node_id']}"
        # observed and converged: the peer announced by an event reaches the toy's file
        await wait_for(lambda: hosts.path.exists() and hosts.path.read_text() == f"{line}\n",
                       what="the peer's line in the toy file")

        # drift behind plexd's back: the line deleted, a stranger added; the reconcile repairs and reports both
        hosts.path.write_text("10.9.9.9 n_stranger\n")

        def reported() -> list[dict]:
            return [c for r in devplane.admin.drift(node_id) for c in r["corrections"]
                    if c["type"].startswith("hosts_line")]

        await wait_for(lambda: len(reported()) >= 2, what="the toy's drift lines at the control plane")
        assert hosts.path.read_text() == f"{line}\n"
        assert reported()[:2] == [
            {"type": "hosts_line_added", "detail": f"hosts file: line {line!r} missing"},
            {"type": "hosts_line_removed", "detail": "hosts file: line '10.9.9.9 n_stranger' is no peer's"}]
        assert connected["mesh"].engine.status()["hosts_file"] == {"path": str(hosts.path)}
        assert connected["mesh"].engine.corrections["hosts_line_added"] >= 1
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0
