"""The connected stage wired into a real `Agent` (in-process) against the real devplane.

The mesh here is a recording stand-in for the WireGuard domain (a dict of peers as "the device"), so this
test needs no namespaces; the same wiring against real wireguard-go in a lab is tests/e2e/test_connected_lab.py.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path

import httpx
import pytest
from nacl.public import PrivateKey
from recording_device import RecordingDomain, in_process_config
from waiting import wait_for

from plexd.base import gojson
from plexd.converge.engine import Engine
from plexd.devplane.harness import Devplane
from plexd.node import assembly
from plexd.node.mesh import MeshHandle
from plexd.state.desired import DesiredState


def wg_public() -> str:
    return base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()


def initial_desired(agent) -> DesiredState:
    """The model a mesh starts from, for the agent's own identity."""
    return DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, mesh_ip=agent.identity.mesh_ip,
                                private_key=base64.b64encode(agent.identity.private_key).decode())


@pytest.fixture
def devplane(tmp_path):
    # liveness at 5 s: the second node below only registers (it never heartbeats), and must not go offline (and
    # be removed from our peers) during the test, however slow the machine
    with Devplane(tmp_path / "dp", heartbeat_interval="5s", keepalive="1s") as dp:
        yield dp


async def test_agent_connected_stage_end_to_end(devplane, tmp_path, monkeypatch, caplog):
    config = in_process_config(devplane, tmp_path)
    domain = RecordingDomain()
    connected = {}

    def install(agent):
        connected["agent"] = agent
        desired = initial_desired(agent)
        connected["mesh"] = MeshHandle(Engine([domain]), desired)
        connected["c"] = assembly.assemble(agent, mesh=connected["mesh"])
        return connected["c"]

    caplog.set_level(logging.DEBUG, "plexd")
    bootstrap = (tmp_path / "token").read_text()
    stop = asyncio.Event()
    run = asyncio.create_task(assembly.run(config, stop_event=stop, assemble=install))
    try:
        await wait_for(lambda: "c" in connected and connected["c"].stream.connected.is_set(), what="stream")
        c = connected["c"]
        node_id = devplane.admin.nodes()[0]["id"]
        await wait_for(lambda: len(devplane.admin.heartbeats(node_id)) >= 2, what="heartbeats")
        hb = devplane.admin.heartbeats(node_id)[-1]
        assert hb["node_id"] == node_id and hb["mesh"]["interface"] == "plexd0" and hb["binary_checksum"]

        # a second node registers: the devplane announces it through the stream
        token = devplane.admin.create_token()
        other = httpx.post(f"{devplane.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                           json={"token": token, "public_key": wg_public(), "hostname": "px-other"}).json()
        await wait_for(lambda: other["node_id"] in domain.peers, what="the new peer on the device")
        # heartbeat values are real: the daemon's code checksum, its uptime, the peers it has
        await wait_for(lambda: devplane.admin.heartbeats(node_id)[-1]["mesh"]["peer_count"] == 1,
                       what="a heartbeat counting the new peer")
        hb = devplane.admin.heartbeats(node_id)[-1]
        checksum = connected["agent"].binary_checksum
        assert hb["binary_checksum"] == checksum and len(checksum) == 64 and int(checksum, 16) >= 0
        assert hb["mesh"]["listen_port"] == 51820
        assert 1 <= gojson.parse_duration(hb["uptime"]) <= connected["agent"].uptime() + 1

        # drift: the peer disappears from the "device" behind plexd's back; the reconciler reports it
        domain.peers.pop(other["node_id"])
        await wait_for(lambda: any(other["node_id"] in corr["detail"] for report in devplane.admin.drift(node_id)
                                   for corr in report["corrections"]), what="a drift report")
        report = devplane.admin.drift(node_id)[-1]
        assert report["corrections"] == [{"type": "peer_added",
                                          "detail": f"peer {other['node_id']}: missing from the device"}]

        # a heartbeat answer with reconcile:true triggers a cycle with that reason
        devplane.admin.request_heartbeat_flags(node_id, reconcile=True)
        await wait_for(lambda: c.reconciler.last is not None
                       and "heartbeat asked for reconcile" in c.reconciler.last.reasons, what="triggered cycle")

        # 401 on the stream (after the devplane restarts): the agent re-registers with its node secret (same
        # node id) and the stream comes back once the control plane accepts it again
        caplog.set_level(logging.INFO, "plexd.identity.registrar")
        await asyncio.to_thread(devplane.stop)
        await asyncio.to_thread(devplane.start)
        devplane.admin.set_faults(events_status=401)
        await wait_for(lambda: "re-registering with the stored identity" in caplog.text, timeout=20,
                       what="re-registration after the 401")
        connects = c.stream.connects
        triggers = []
        real_trigger = c.reconciler.trigger
        c.reconciler.trigger = lambda reason="triggered": (triggers.append((reason, c.reconciler.cycles)),
                                                           real_trigger(reason))
        devplane.admin.clear_faults()
        await wait_for(lambda: c.stream.connects > connects, timeout=20, what="reconnect after 401")
        # and every reconnect is followed by a reconcile (catch up on whatever the stream missed)
        await wait_for(lambda: ("event stream (re)connected" in [r for r, _ in triggers]), what="the trigger")
        cycles_then = dict(triggers)["event stream (re)connected"]
        await wait_for(lambda: c.reconciler.cycles > cycles_then, what="the post-reconnect cycle")
        assert [n["id"] for n in devplane.admin.nodes()] == [node_id, other["node_id"]]
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0
    # nothing secret in any log record, debug included (message or structured fields)
    secret = connected["agent"].identity.node_secret_key
    for record in caplog.records:
        text = record.getMessage() + repr(vars(record))
        assert secret not in text and bootstrap not in text, record.getMessage()


async def test_a_reregistration_answering_another_signing_key_is_trusted_at_once(devplane, tmp_path):
    """A node that missed a signing-key rotation learns the new key from its next registration's answer. The
    running verifier took no notice: every event was refused, and the key file's domain wrote the old key back
    over the new file. The one stand-in: the registration's answer is the devplane's own with its key swapped
    (a devplane announces every rotation, so it cannot make a node miss one)."""
    import dataclasses

    from nacl.signing import SigningKey

    from plexd.config import datadir
    from plexd.controlplane.envelope import parse_envelope, sign_event
    from plexd.node.mesh import trusted_key
    from plexd.trust.signing_key_domain import SigningKeyFile

    config = in_process_config(devplane, tmp_path)
    new_key = SigningKey.generate()
    new_b64 = base64.b64encode(bytes(new_key.verify_key)).decode()
    built = {}

    def install(agent):
        built["agent"] = agent
        desired = initial_desired(agent)
        real_recover = agent.registrar.recover

        async def recover_answering_a_new_key(current, **kw):
            identity = dataclasses.replace(await real_recover(current, **kw), signing_public_key=new_b64)
            agent.store.save(identity)  # as the registrar saves what the control plane answered
            return identity
        agent.registrar.recover = recover_answering_a_new_key
        built["c"] = assembly.assemble(agent, mesh=MeshHandle(Engine([RecordingDomain()]), desired))
        return built["c"]

    stop = asyncio.Event()
    run = asyncio.create_task(assembly.run(config, stop_event=stop, assemble=install))
    try:
        await wait_for(lambda: "c" in built and built["c"].stream.connected.is_set(), what="stream")
        c, agent = built["c"], built["agent"]
        old = c.verifier.keys.current
        devplane.admin.set_faults(events_status=401)
        await wait_for(lambda: agent.identity.signing_public_key == new_b64, timeout=20, what="the re-registration")
        devplane.admin.clear_faults()
        assert c.verifier.keys.current == new_b64 != old
        key_file = Path(config.data_dir) / datadir.SIGNING_KEY
        assert key_file.read_text().strip() == new_b64
        # the key file's domain finds nothing to put back
        domain = SigningKeyFile(key_file.parent, trusted_key(c.verifier))
        assert domain.plan(None, await domain.observe(None)).changes == ()
        # and an event signed with the new key passes
        node_id = agent.identity.node_id
        fresh = parse_envelope(sign_event(new_key, "peer_removed", "e-new", {"id": "n_x", "node_id": node_id}))
        c.verifier.verify(fresh)
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0


async def test_a_dry_run_through_the_daemon_leaves_its_model_alone(devplane, tmp_path):
    """`plexd reconcile --once --dry-run` answered by the daemon applied the pulled state to the daemon's model
    (only the converge was dry): the next cycle found the machine behind the model and reported the control
    plane's news as drift."""
    config = in_process_config(devplane, tmp_path)
    built = {}

    def install(agent):
        built["mesh"] = MeshHandle(Engine([RecordingDomain()]), initial_desired(agent))
        built["c"] = assembly.assemble(agent, mesh=built["mesh"])
        return built["c"]

    stop = asyncio.Event()
    run = asyncio.create_task(assembly.run(config, stop_event=stop, assemble=install))
    try:
        await wait_for(lambda: "c" in built and built["c"].stream.connected.is_set(), what="stream")
        c = built["c"]
        await wait_for(lambda: c.reconciler.cycles >= 1 and c.reconciler.last is not None, what="the first cycle")
        devplane.admin.set_faults(events_status=503)  # the news comes by the state pull only
        await wait_for(lambda: not c.stream.connected.is_set(), what="the stream to drop")
        token = devplane.admin.create_token()
        other = httpx.post(f"{devplane.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                           json={"token": token, "public_key": wg_public(), "hostname": "px-news"}).json()
        plan = await c.reconciler.run_once(dry_run=True, reasons=("plexd reconcile --once",))
        assert any(other["node_id"] in x.detail for x in plan.corrections), plan
        assert other["node_id"] not in c.mesh.store.value.peers  # the plan only
        cycle = await c.reconciler.run_once(reasons=("the next cycle",))
        assert cycle.corrections == [] and any(other["node_id"] in x.detail for x in cycle.updates), cycle
        devplane.admin.clear_faults()
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0


async def test_a_connected_node_lets_its_event_stream_stand_in_for_the_state_pull(devplane, tmp_path):
    """The reconcile (every second here) diffs the machine every cycle but asks the control plane for the state
    only when the stream may have missed something: counted at the devplane, by route."""
    config = in_process_config(devplane, tmp_path)
    built = {}

    def install(agent):
        built["domain"] = RecordingDomain()
        built["c"] = assembly.assemble(agent, mesh=MeshHandle(Engine([built["domain"]]), initial_desired(agent)))
        return built["c"]

    def state_pulls() -> int:
        return devplane.admin.requests().get(node_id, {}).get("GET /v1/nodes/{node_id}/state", 0)

    async def cycles(n: int) -> None:
        start = c.reconciler.cycles
        await wait_for(lambda: c.reconciler.cycles >= start + n, what=f"{n} reconcile cycles")

    stop = asyncio.Event()
    run = asyncio.create_task(assembly.run(config, stop_event=stop, assemble=install))
    try:
        await wait_for(lambda: "c" in built and built["c"].stream.connected.is_set(), what="stream")
        c = built["c"]
        node_id = devplane.admin.nodes()[0]["id"]
        await wait_for(lambda: c.reconciler.last is not None and not c.reconciler.last.pulled,
                       what="an interval cycle that skipped the pull")
        devplane.admin.clear_requests()
        await cycles(4)
        assert state_pulls() == 0 and c.reconciler.last.ok
        assert devplane.admin.requests()[node_id]["POST /v1/nodes/{node_id}/heartbeat"] >= 2  # the node is there

        # drift is still found at every cycle's pace, without a pull
        token = devplane.admin.create_token()
        other = httpx.post(f"{devplane.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                           json={"token": token, "public_key": wg_public(), "hostname": "px-drift"}).json()
        await wait_for(lambda: other["node_id"] in built["domain"].peers, what="the new peer, by its event")
        built["domain"].peers.pop(other["node_id"])
        await wait_for(lambda: any(other["node_id"] in corr["detail"] for report in devplane.admin.drift(node_id)
                                   for corr in report["corrections"]), what="the drift report")
        assert state_pulls() == 0

        # an event the node refused: its change is not in the model, so the next cycle pulls
        devplane.admin.publish_event(node_id, "peer_removed", {"id": other["node_id"]}, signature="forge")
        await wait_for(lambda: state_pulls() == 1, what="a pull after the refused event")
        await cycles(3)
        assert state_pulls() == 1

        # no stream: every cycle pulls, as the polling fallback always did
        devplane.admin.set_faults(events_status=503)
        await wait_for(lambda: not c.stream.connected.is_set(), what="the stream to drop")
        pulled = state_pulls()
        await cycles(3)
        assert state_pulls() >= pulled + 3
        devplane.admin.clear_faults()
        await wait_for(lambda: c.stream.connected.is_set(), timeout=30, what="the stream back")
        assert other["node_id"] in c.mesh.store.value.peers  # the forged removal never took
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0
