"""Timing logic of the deployment with an injected clock (no sleeping): liveness and mesh-IP cooldown.

These drive `Deployment` in-process with a FakeClock; the HTTP layer around it is covered by the other files.
One test at the end checks the same behaviour end to end on a real server with a short heartbeat interval.
"""

from __future__ import annotations

import json
import time

import pytest
from devplane_helpers import addressed, new_public_key, register

from plexd.base.clock import FakeClock
from plexd.devplane.deployment import Deployment
from plexd.devplane.harness import Devplane
from plexd.devplane.store import Store


@pytest.fixture
def deployment(tmp_path):
    store = Store(tmp_path / "dp.db")
    dep = Deployment(store, clock=FakeClock(), heartbeat_interval=30.0, ip_cooldown=60.0)
    yield dep
    store.close()


def _register(dep: Deployment, hostname: str):
    token = f"tok-{hostname}"
    dep.store.add_token(token, dep.now_text())
    body = {"token": token, "public_key": new_public_key(), "hostname": hostname}
    return dep.nodes[dep.register(body, None)["node_id"]]


def _events(dep: Deployment, node_id: str) -> list[tuple[str, dict]]:
    rows = dep.store.events_after(dep.nodes[node_id].num, 0)
    return [(etype, addressed(json.loads(data)["payload"], node_id)) for _, etype, data in rows]


def test_unreachable_after_3_offline_after_10_and_back(deployment):
    dep, clock = deployment, deployment.clock
    a, b = _register(dep, "a"), _register(dep, "b")
    clock.advance(89)
    dep.heartbeat(b, {})
    dep.check_liveness()
    assert a.status == "online"
    clock.advance(1)  # 90 s = 3 intervals without a heartbeat
    dep.check_liveness()
    assert a.status == "unreachable" and b.status == "online"
    assert b.id in {p.id for p in dep.visible_peers(a)}
    assert a.id in {p.id for p in dep.visible_peers(b)}  # unreachable peers stay configured
    dep.heartbeat(b, {})
    clock.advance(210)  # 300 s = 10 intervals
    dep.check_liveness()
    assert a.status == "offline"
    assert ("peer_removed", {"peer_id": a.id}) in _events(dep, b.id)
    assert a.id not in {p.id for p in dep.visible_peers(b)}
    dep.heartbeat(a, {})
    assert a.status == "online"
    assert _events(dep, b.id)[-1] == ("peer_added", a.peer())
    dep.check_liveness()
    assert a.status == "online"


async def test_liveness_task_runs_on_the_clock(deployment):
    import asyncio

    dep, clock = deployment, deployment.clock
    a = _register(dep, "a")
    task = asyncio.create_task(dep.run_liveness())
    try:
        await asyncio.sleep(0)
        for _ in range(20):
            clock.advance(15)
            await asyncio.sleep(0)
        assert a.status == "offline"
    finally:
        task.cancel()


def test_released_ip_rests_for_the_cooldown(deployment):
    dep, clock = deployment, deployment.clock
    a = _register(dep, "a")
    first_ip = a.mesh_ip
    assert first_ip == "10.100.0.1"
    dep.remove(a, "deregistered")
    b = _register(dep, "b")
    assert b.mesh_ip != first_ip
    clock.advance(61)
    c = _register(dep, "c")
    assert c.mesh_ip == first_ip


def test_allocation_skips_zero_and_broadcast_octets(deployment):
    dep = deployment
    dep.used_ips.update(f"10.100.0.{i}" for i in range(1, 255))
    assert _register(dep, "x").mesh_ip == "10.100.1.1"


def test_state_reloads_from_the_database(tmp_path):
    store = Store(tmp_path / "dp.db")
    dep = Deployment(store, clock=FakeClock())
    a = _register(dep, "a")
    dep.set_secret(a, "k", "v")
    key = dep.signer.public_key
    store.close()
    store = Store(tmp_path / "dp.db")
    again = Deployment(store, clock=FakeClock())
    assert again.nodes[a.id].secrets == {"k": {"value": "v", "version": 1}}
    assert again.by_secret[a.secret].id == a.id
    assert again.signer.public_key == key
    assert again.hub.seq == dep.hub.seq
    store.close()


def test_offline_end_to_end(tmp_path, readers):
    """A real server with a 200 ms heartbeat interval: a silent node goes offline and its peer is told."""
    with Devplane(tmp_path, heartbeat_interval="200ms") as dp:
        a, b = register(dp), register(dp)
        reader = readers(b, last_event_id="evt_999999")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            b.post("heartbeat", {})
            if dp.admin.node(a.id)["status"] == "offline":
                break
            time.sleep(0.1)
        assert dp.admin.node(a.id)["status"] == "offline"
        assert addressed(json.loads(reader.wait_for("peer_removed").data)["payload"], b.id) == {"peer_id": a.id}
        assert a.post("heartbeat", {}).status_code == 200
        assert json.loads(reader.wait_for("peer_added").data)["payload"]["id"] == a.id


def test_event_log_is_pruned(deployment, monkeypatch):
    import plexd.devplane.deployment as deployment_module

    dep = deployment
    a = _register(dep, "a")
    monkeypatch.setattr(deployment_module, "EVENTS_KEPT", 5)
    for i in range(12):
        dep.hub.publish([a.id], "custom", {"i": i})
    assert dep.prune_events() > 0
    seqs = [seq for seq, _, _ in dep.store.events_after(a.num, 0)]
    assert len(seqs) == 5 and seqs[-1] == dep.hub.seq


def test_restart_gives_nodes_a_fresh_heartbeat_window(tmp_path):
    store = Store(tmp_path / "dp.db")
    clock = FakeClock()
    dep = Deployment(store, clock=clock, heartbeat_interval=30.0)
    a = _register(dep, "a")
    store.close()
    clock.advance(3600)  # the devplane was down for an hour
    store = Store(tmp_path / "dp.db")
    again = Deployment(store, clock=clock, heartbeat_interval=30.0)
    again.check_liveness()
    assert again.nodes[a.id].status == "online"
    clock.advance(300)
    again.check_liveness()
    assert again.nodes[a.id].status == "offline"
    store.close()


def test_a_used_token_answers_the_same_registration_only_within_the_retry_window(deployment):
    """A spent token plus the public key every peer sees handed out the node's secret for ever."""
    from plexd.devplane.deployment import REGISTER_RETRY_WINDOW
    from plexd.devplane.wire import DevplaneAPIError

    dep = deployment
    dep.store.add_token("tok-once", dep.now_text())
    body = {"token": "tok-once", "public_key": new_public_key(), "hostname": "once"}
    first = dep.register(body, None)
    assert dep.register(dict(body), None)["node_secret_key"] == first["node_secret_key"]  # a lost answer, again
    dep.clock.advance(REGISTER_RETRY_WINDOW + 1)
    with pytest.raises(DevplaneAPIError) as refused:
        dep.register(dict(body), None)
    assert refused.value.status == 401 and "already used" in refused.value.message


def test_a_key_another_node_holds_is_refused_at_registration_and_rotation(deployment):
    from plexd.devplane.wire import DevplaneAPIError

    dep = deployment
    a, b = _register(dep, "key-a"), _register(dep, "key-b")
    dep.store.add_token("tok-thief", dep.now_text())
    with pytest.raises(DevplaneAPIError) as refused:
        dep.register({"token": "tok-thief", "public_key": a.public_key, "hostname": "thief"}, None)
    assert refused.value.status == 409 and a.id in refused.value.message
    with pytest.raises(DevplaneAPIError) as refused:
        dep.rotate_node_key(b, a.public_key)
    assert refused.value.status == 409 and b.public_key != a.public_key


def test_a_node_removed_while_its_request_was_read_is_not_written_back_to_life(deployment):
    from plexd.devplane.wire import DevplaneAPIError

    dep = deployment
    node = _register(dep, "gone")
    dep.remove(node, "deregistered", rejoinable=True)
    assert node.removed
    for call in (lambda: dep.heartbeat(node, {}), lambda: dep.set_endpoint(node, "203.0.113.9:51820"),
                 lambda: dep.record_reports(node, [], [])):
        with pytest.raises(DevplaneAPIError) as refused:
            call()
        assert refused.value.status == 401
    assert node.status != "online" and node.endpoint != "203.0.113.9:51820"


def test_a_kept_labs_down_never_signals_a_process_that_reused_one_of_its_pids(tmp_path):
    """`demo --down` killed the process group of every pid in the state file that was alive: a lab process that
    had died long before could have handed its pid to anyone. Only the process the lab started, by start time."""
    import json
    import subprocess
    import sys

    from plexd.base.procstat import process_stat
    from plexd.devplane.lab import Lab

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        ticks = process_stat(stranger.pid).start_ticks
        state = tmp_path / "lab.json"
        state.write_text(json.dumps({"tag": "zq9", "pids": [stranger.pid], "starts": {str(stranger.pid): ticks - 1}}))
        assert Lab.down_from_state(str(state)) is True
        assert stranger.poll() is None  # the pid is not the lab's process any more: left alone
    finally:
        stranger.kill()
        stranger.wait()


def test_a_node_repeating_acks_or_posting_new_ids_cannot_grow_the_executions_table_without_bound(deployment):
    from plexd.devplane.deployment import EXECUTION_COPIES_KEPT, EXECUTIONS_KEPT_PER_NODE

    dep = deployment
    node = _register(dep, "chatty")
    for _ in range(EXECUTION_COPIES_KEPT + 20):
        dep.record_execution(node, "exec_same", "ack", {"execution_id": "exec_same", "status": "accepted"})
    [doc] = dep.store.executions(node.id)
    assert doc["ack"]["status"] == "accepted" and len(doc["acks"]) == EXECUTION_COPIES_KEPT
    for i in range(EXECUTIONS_KEPT_PER_NODE + 5):
        dep.record_execution(node, f"exec_{i}", "result", {"execution_id": f"exec_{i}", "status": "success"})
    kept = dep.store.executions(node.id)
    assert len(kept) == EXECUTIONS_KEPT_PER_NODE and kept[-1]["execution_id"] == f"exec_{EXECUTIONS_KEPT_PER_NODE + 4}"
