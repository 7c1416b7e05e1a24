"""The event stream, verifier, handlers and heartbeat against the REAL reference control plane (plexd-devplane).

Every bad input of issue 5 is published through the devplane's admin API and must be refused with a log line
naming the event id and the reason while the stream keeps going; every fault (kill/restart, 500/503/429, close
after every event, silence) must end in a reconnect with bounded rate and no missed event. Backoff is shortened
(0.1 s → 1 s) so the suite stays fast; the timing rules themselves are covered with a fake clock in
tests/unit/test_events_backoff.py.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import sqlite3
import time
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import httpx
import nacl.signing
import pytest
from nacl.public import PrivateKey
from waiting import wait_for

from plexd.base import gojson
from plexd.base.backoff import Backoff
from plexd.base.clock import Clock
from plexd.controlplane.event_signing import NonceStore, Verifier
from plexd.controlplane.event_stream import EventStream
from plexd.controlplane.ledger import EventLedger
from plexd.devplane.harness import Devplane
from plexd.services.event_handlers import EventHandlers
from plexd.services.heartbeat import HeartbeatService, HeartbeatSnapshot, MeshInfo, NatInfo
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore
from plexd.state.model import SigningKeys

EVENTS_LOG = "plexd.controlplane.event_stream"


def wg_public() -> str:
    return base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()


@pytest.fixture(scope="module")
def devplane(tmp_path_factory):
    dp = Devplane(tmp_path_factory.mktemp("devplane"), keepalive="1s")
    dp.start()
    try:
        yield dp
    finally:
        dp.stop()


@pytest.fixture(autouse=True)
def no_faults(devplane):
    if not devplane.running:
        devplane.start()
    devplane.admin.clear_faults()
    yield
    if not devplane.running:
        devplane.start()
    devplane.admin.clear_faults()


@pytest.fixture
def node(devplane):
    """A freshly registered node: (node_id, node secret, signing public key)."""
    token = devplane.admin.create_token()
    resp = httpx.post(f"{devplane.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                      json={"token": token, "public_key": wg_public(), "hostname": f"px-ev-{time.monotonic_ns()}"})
    assert resp.status_code in (200, 201), resp.text
    body = resp.json()
    return body["node_id"], body["node_secret_key"], body["signing_public_key"]


class Consumer:
    """The real EventStream + Verifier + EventHandlers, as `plexd up` wires them, on a real clock."""

    def __init__(self, devplane, node, data_dir: Path, keys: SigningKeys | None = None, **kw):
        node_id, secret, signing_key = node
        clock = Clock()
        self.ledger = EventLedger(data_dir / "events.db")
        self.verifier = Verifier(keys or SigningKeys(current=signing_key), NonceStore(clock, self.ledger), clock)
        self.store = DesiredStore(DesiredState.initial(
            interface="plexd0", listen_port=51820, mtu=1420,
            private_key=base64.b64encode(bytes(PrivateKey.generate())).decode(), mesh_ip="10.100.0.250"))
        self.dispatched: list[str] = []
        self.reconnects = 0
        self.reconciles: list[str] = []
        self.handlers = EventHandlers(self.store, lambda why: None, self.reconciles.append, self.verifier, data_dir)

        async def dispatch(env):
            self.dispatched.append(env.event_id)
            await self.handlers.dispatch(env)

        def connected():
            self.reconnects += 1

        kw.setdefault("backoff", Backoff(base=0.1, cap=1.0))
        kw.setdefault("storm_backoff", Backoff(base=0.1, cap=1.0))
        self.stream = EventStream(devplane.url, node_id, lambda: secret, self.ledger, self.verifier, dispatch,
                                  clock=clock, on_connected=connected, **kw)

    @property
    def desired(self):
        return self.store.value

    @asynccontextmanager
    async def running(self):
        task = asyncio.create_task(self.stream.run())
        try:
            yield self
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            self.ledger.close(time.time())  # a clean stop commits what was noted


async def publish(devplane, *args, **kw) -> str:
    return await asyncio.to_thread(devplane.admin.publish_event, *args, **kw)


def peer_payload(i: int) -> dict:
    return {"id": f"n_p{i}", "public_key": wg_public(), "mesh_ip": f"10.100.9.{i}", "endpoint": "",
            "allowed_ips": [f"10.100.9.{i}/32"], "psk": ""}


def rejection(caplog, event_id: str, reason: str) -> bool:
    return any(event_id in r.getMessage() and f"[{reason}]" in r.getMessage() for r in caplog.records)


# --- bad input ---------------------------------------------------------------------------------------------------


async def test_every_bad_event_is_refused_by_id_and_the_stream_goes_on(devplane, node, tmp_path, caplog):
    caplog.set_level(logging.INFO, EVENTS_LOG)
    node_id = node[0]
    now = gojson.now_utc()
    c = Consumer(devplane, node, tmp_path)
    async with c.running():
        await wait_for(c.stream.connected.is_set, what="connect")
        good1 = await publish(devplane, node_id, "peer_added", peer_payload(1))
        forged = await publish(devplane, node_id, "peer_added", peer_payload(2), signature="forge")
        stale = await publish(devplane, node_id, "peer_added", peer_payload(3),
                              issued_at=gojson.format_time(now - timedelta(minutes=6)))
        future = await publish(devplane, node_id, "peer_added", peer_payload(4),
                               issued_at=gojson.format_time(now + timedelta(minutes=6)))
        first = await publish(devplane, node_id, "peer_added", peer_payload(5), nonce="px-same-nonce")
        replay = await publish(devplane, node_id, "peer_added", peer_payload(6), nonce="px-same-nonce")
        malformed = await publish(devplane, node_id, "peer_added", raw_data='{"event_type": "peer_added", oops')
        no_type = await publish(devplane, node_id, "x", raw_data='{"event_id":"evt_fake","payload":{}}')
        huge = await publish(devplane, node_id, "peer_added", raw_data="x" * (1 << 20))  # one 1 MiB data: line
        wrong_shape = await publish(devplane, node_id, "peer_added", [1, 2, 3])
        unknown = await publish(devplane, node_id, "px_from_the_future", {"x": 1})
        good2 = await publish(devplane, node_id, "peer_added", peer_payload(7))
        await wait_for(lambda: c.stream.last_event_id == good2, what="the last event")

    assert c.dispatched == [good1, first, wrong_shape, unknown, good2]
    assert set(c.desired.peers) == {"n_p1", "n_p5", "n_p7"}
    for eid, reason in [(forged, "bad_signature"), (stale, "stale"), (future, "future"),
                        (replay, "duplicate_nonce"), (malformed, "malformed"), (no_type, "malformed"),
                        (huge, "oversize"), (wrong_shape, "bad_payload")]:
        assert rejection(caplog, eid, reason), f"no rejection log for {eid} ({reason})"
    assert c.reconnects == 1  # nothing above broke the connection
    assert EventLedger(tmp_path / "events.db").cursor == good2  # committed at the stop


async def test_replayed_nonce_after_a_restart_is_refused(devplane, node, tmp_path, caplog):
    caplog.set_level(logging.INFO, EVENTS_LOG)
    node_id = node[0]
    c1 = Consumer(devplane, node, tmp_path)
    async with c1.running():
        await wait_for(c1.stream.connected.is_set)
        original = await publish(devplane, node_id, "peer_added", peer_payload(1), nonce="px-restart-nonce")
        await wait_for(lambda: c1.dispatched == [original])
    # "Restart the daemon" with the same data_dir, and forget the cursor so the devplane replays the event too.
    with sqlite3.connect(tmp_path / "events.db") as db:
        db.execute("DELETE FROM meta WHERE key = 'cursor'")
    c2 = Consumer(devplane, node, tmp_path)
    async with c2.running():
        await wait_for(c2.stream.connected.is_set)
        again = await publish(devplane, node_id, "peer_added", peer_payload(2), nonce="px-restart-nonce")
        after = await publish(devplane, node_id, "peer_added", peer_payload(3))
        await wait_for(lambda: c2.stream.last_event_id == after)
    assert c2.dispatched == [after]
    assert rejection(caplog, original, "duplicate_nonce")  # the replayed original
    assert rejection(caplog, again, "duplicate_nonce")  # a new event reusing the nonce


async def test_resume_from_persisted_cursor_misses_nothing(devplane, node, tmp_path):
    node_id = node[0]
    c1 = Consumer(devplane, node, tmp_path)
    async with c1.running():
        await wait_for(c1.stream.connected.is_set)
        e1 = await publish(devplane, node_id, "peer_added", peer_payload(1))
        await wait_for(lambda: c1.dispatched == [e1])
    offline = [await publish(devplane, node_id, "peer_added", peer_payload(i)) for i in (2, 3, 4)]
    c2 = Consumer(devplane, node, tmp_path)
    async with c2.running():
        await wait_for(lambda: c2.dispatched == offline, what="replay of the events published while down")


async def test_previous_key_only_inside_its_transition(devplane, node, tmp_path, caplog):
    caplog.set_level(logging.INFO, EVENTS_LOG)
    node_id, _, devplane_key = node
    other = base64.b64encode(bytes(nacl.signing.SigningKey.generate().verify_key)).decode()
    expired = SigningKeys(current=other, previous=devplane_key,
                          transition_expires=gojson.format_time(gojson.now_utc() - timedelta(seconds=1)))
    c = Consumer(devplane, node, tmp_path / "a", keys=expired)
    async with c.running():
        await wait_for(c.stream.connected.is_set)
        late = await publish(devplane, node_id, "peer_added", peer_payload(1))
        await wait_for(lambda: c.stream.last_event_id == late)
    assert c.dispatched == []
    assert rejection(caplog, late, "bad_signature")

    open_transition = SigningKeys(current=other, previous=devplane_key,
                                  transition_expires=gojson.format_time(gojson.now_utc() + timedelta(hours=1)))
    c = Consumer(devplane, node, tmp_path / "b", keys=open_transition)
    async with c.running():
        await wait_for(c.stream.connected.is_set)
        ok = await publish(devplane, node_id, "peer_added", peer_payload(2))
        # a fresh consumer has no cursor, so the devplane replays recent events: the same event is now accepted
        await wait_for(lambda: c.dispatched == [late, ok])


async def test_signing_key_rotation_is_applied_and_persisted(devplane, node, tmp_path):
    node_id = node[0]
    c = Consumer(devplane, node, tmp_path)
    async with c.running():
        await wait_for(c.stream.connected.is_set)
        keys = await asyncio.to_thread(devplane.admin.rotate_signing_key, "1h")
        await wait_for(lambda: c.verifier.keys.current == keys["current"], what="the rotated key")
        signed_by_new = await publish(devplane, node_id, "peer_added", peer_payload(1))
        await wait_for(lambda: signed_by_new in c.dispatched)
    assert (tmp_path / "signing_public_key").read_text() == keys["current"]


# --- faults ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [{"events_status": 500}, {"events_status": 503},
                                   {"events_status": 429, "retry_after": "1"}])
async def test_error_statuses_back_off_then_recover_without_missing_events(devplane, node, tmp_path, fault):
    node_id = node[0]
    devplane.admin.set_faults(**fault)
    c = Consumer(devplane, node, tmp_path)
    async with c.running():
        published = [await publish(devplane, node_id, "peer_added", peer_payload(i)) for i in (1, 2)]
        await asyncio.sleep(2.0)
        attempts = c.stream.attempts
        # 0.1, 0.2, 0.4, 0.8 s (±25 %) fit in 2 s; a 429 with Retry-After: 1 allows two. Never a hot loop.
        assert 1 <= attempts <= (3 if fault["events_status"] == 429 else 6), attempts
        assert not c.stream.connected.is_set()
        devplane.admin.clear_faults()
        await wait_for(c.stream.connected.is_set, what="reconnect after the fault")
        published.append(await publish(devplane, node_id, "peer_added", peer_payload(3)))
        await wait_for(lambda: c.dispatched == published, what="every event")


async def test_close_after_every_event(devplane, node, tmp_path):
    node_id = node[0]
    devplane.admin.set_faults(close_after_events=1)
    c = Consumer(devplane, node, tmp_path)
    async with c.running():
        await wait_for(c.stream.connected.is_set)
        published = [await publish(devplane, node_id, "peer_added", peer_payload(i)) for i in range(1, 11)]
        await wait_for(lambda: c.dispatched == published, what="all 10 events, in order, once each")
    assert c.reconnects >= 10


async def test_poison_event_with_closes_is_read_once(devplane, node, tmp_path):
    # An oversize event, and the devplane closing the stream after it: the Go agent would reconnect with the
    # same cursor and re-read it forever. We skip it, advance the cursor, and the next stream stays open.
    node_id = node[0]
    huge = await publish(devplane, node_id, "peer_added", raw_data="y" * (1 << 20))
    devplane.admin.set_faults(close_after_events=1)
    c = Consumer(devplane, node, tmp_path)
    async with c.running():
        await wait_for(lambda: c.stream.last_event_id == huge)
        await asyncio.sleep(1.0)
        assert c.stream.attempts <= 3  # the poison event was skipped once, never re-read in a loop


async def test_silent_stream_is_detected_by_the_watchdog(devplane, node, tmp_path, caplog):
    caplog.set_level(logging.INFO, EVENTS_LOG)
    node_id = node[0]
    devplane.admin.set_faults(silent=True)
    c = Consumer(devplane, node, tmp_path, idle_timeout=1.0)
    async with c.running():
        await wait_for(c.stream.connected.is_set)
        await wait_for(lambda: "idle" in caplog.text, timeout=5, what="the idle watchdog")
        devplane.admin.clear_faults()
        e = await publish(devplane, node_id, "peer_added", peer_payload(1))
        await wait_for(lambda: c.dispatched == [e], what="the event after the silence")
        # once the devplane talks again, its keepalive comments feed the watchdog: no reconnect loop
        attempts = c.stream.attempts
        await asyncio.sleep(1.5)
        assert c.stream.attempts - attempts <= 2


async def test_devplane_killed_and_restarted_mid_stream(devplane, node, tmp_path):
    node_id = node[0]
    c = Consumer(devplane, node, tmp_path)
    async with c.running():
        await wait_for(c.stream.connected.is_set)
        published = [await publish(devplane, node_id, "peer_added", peer_payload(i)) for i in (1, 2, 3)]
        await asyncio.to_thread(devplane.kill)
        await wait_for(lambda: not c.stream.connected.is_set(), what="the disconnect")
        await asyncio.sleep(1.5)
        attempts_while_down = c.stream.attempts
        assert attempts_while_down <= 8, attempts_while_down  # backoff while the port is closed
        await asyncio.to_thread(devplane.start)
        await wait_for(c.stream.connected.is_set, what="reconnect after restart")
        published += [await publish(devplane, node_id, "peer_added", peer_payload(i)) for i in (4, 5)]
        await wait_for(lambda: c.dispatched == published, what="every event, once")
    assert c.reconnects == 2  # the reconciler trigger fired after the reconnect too


async def test_graceful_restart_mid_stream(devplane, node, tmp_path):
    node_id = node[0]
    c = Consumer(devplane, node, tmp_path)
    async with c.running():
        await wait_for(c.stream.connected.is_set)
        e1 = await publish(devplane, node_id, "peer_added", peer_payload(1))
        await wait_for(lambda: c.dispatched == [e1])
        await asyncio.to_thread(devplane.restart)
        e2 = await publish(devplane, node_id, "peer_added", peer_payload(2))
        await wait_for(lambda: c.dispatched == [e1, e2], what="the event after a restart")


async def test_401_calls_reauthentication_and_keeps_going(devplane, node, tmp_path):
    node_id = node[0]
    devplane.admin.set_faults(events_status=401)
    auth = []
    async def reauthenticate():
        auth.append(1)

    c = Consumer(devplane, node, tmp_path, on_auth_failure=reauthenticate)
    async with c.running():
        await wait_for(lambda: len(auth) >= 2, what="repeated re-authentication")
        devplane.admin.clear_faults()
        await wait_for(c.stream.connected.is_set)
        e = await publish(devplane, node_id, "peer_added", peer_payload(1))
        await wait_for(lambda: c.dispatched == [e])


# --- heartbeat ---------------------------------------------------------------------------------------------------


async def test_heartbeat_wire_shape_recorded_by_devplane(devplane, node):
    node_id, secret, _ = node

    async with httpx.AsyncClient(base_url=devplane.url, timeout=10) as http:
        async def send(body):
            resp = await http.post(f"/v1/nodes/{node_id}/heartbeat", json=body,
                                   headers={"Authorization": f"Bearer {secret}"})
            resp.raise_for_status()
            return resp.json()

        snap = HeartbeatSnapshot(status="healthy", binary_checksum="0f" * 32, mesh=MeshInfo("plexd0", 2, 51820),
                                 nat=NatInfo("198.51.100.7:51820", "full_cone"))
        reasons = []
        hb = HeartbeatService(node_id, send, lambda: snap, trigger_reconcile=reasons.append)
        assert await hb.beat()
        await asyncio.to_thread(devplane.admin.request_heartbeat_flags, node_id, reconcile=True)
        assert await hb.beat()
        assert reasons == ["heartbeat asked for reconcile"]

    recorded = devplane.admin.heartbeats(node_id)
    body = recorded[-1]
    assert list(body) == ["node_id", "timestamp", "status", "uptime", "binary_checksum", "mesh", "nat"]
    assert body["node_id"] == node_id and body["status"] == "healthy"
    assert body["mesh"] == {"interface": "plexd0", "peer_count": 2, "listen_port": 51820}
    assert body["nat"] == {"public_endpoint": "198.51.100.7:51820", "type": "full_cone"}
    assert gojson.parse_duration(body["uptime"]) >= 0
    gojson.parse_time(body["timestamp"])
    assert devplane.admin.node(node_id).get("nat_type", "full_cone") == "full_cone"


async def test_heartbeat_401_from_devplane(devplane, node):
    node_id = node[0]
    auth = []

    async with httpx.AsyncClient(base_url=devplane.url, timeout=10) as http:
        async def send(body):
            resp = await http.post(f"/v1/nodes/{node_id}/heartbeat", json=body,
                                   headers={"Authorization": "Bearer wrong-secret"})
            resp.raise_for_status()
            return resp.json()
        async def reauthenticate():
            auth.append(1)

        hb = HeartbeatService(node_id, send, HeartbeatSnapshot, on_auth_failure=reauthenticate)
        assert not await hb.beat()
    assert auth == [1]



@pytest.mark.parametrize("retry_after", ["9" * 400, "Fri, 31 Dec 9999 23:59:59 GMT", "-1", "soon", "١٢٣"])
async def test_a_429_with_an_absurd_retry_after_is_capped_not_a_crash(devplane, node, tmp_path, retry_after, caplog):
    """The header crashed the event service with OverflowError: now any value is read (or ignored) and the wait
    is bounded by RETRY_AFTER_MAX; the stream keeps trying and comes back when the fault ends."""
    from plexd.controlplane.event_stream import RETRY_AFTER_MAX

    devplane.admin.set_faults(events_status=429, retry_after=retry_after)
    c = Consumer(devplane, node, tmp_path)
    async with c.running():
        await wait_for(lambda: c.stream.attempts >= 1 and c.stream.delays, what="the refused attempt")
        delay = c.stream.delays[-1]
        assert 0 < delay <= RETRY_AFTER_MAX
        if retry_after.startswith("9") or retry_after.startswith("Fri"):
            assert delay == RETRY_AFTER_MAX  # honoured up to the cap
        assert "Traceback" not in caplog.text
