"""Heartbeat body shape ([C] §1.4), schedule, response handling and failure logging, with fakes for the sender."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import httpx

from plexd.base.clock import FakeClock
from plexd.services.heartbeat import HeartbeatService, HeartbeatSnapshot, MeshInfo, NatInfo, http_status

NOW = datetime(2025, 1, 15, 10, 30, tzinfo=UTC)


class Refused(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


def _async(fn):
    """The service takes coroutine functions; these tests write plain functions."""
    if fn is None or asyncio.iscoroutinefunction(fn):
        return fn

    async def call(*args):
        return fn(*args)
    return call


def service(send, clock=None, **kw):
    clock = clock or FakeClock(NOW)
    send = _async(send)
    if "on_auth_failure" in kw:
        kw["on_auth_failure"] = _async(kw["on_auth_failure"])
    snap = HeartbeatSnapshot(status="healthy", binary_checksum="ab" * 32, mesh=MeshInfo("plexd0", 3, 51820),
                             nat=NatInfo("203.0.113.10:51820", "full_cone"))
    return HeartbeatService("n_1", send, lambda: snap, clock=clock, **kw), clock


def test_body_shape_and_order():
    hb, clock = service(lambda b: {})
    clock.advance(72 * 3600 + 15 * 60)
    body = hb.build()
    assert list(body) == ["node_id", "timestamp", "status", "uptime", "binary_checksum", "mesh", "nat"]
    assert body["uptime"] == "72h15m0s"
    assert body["timestamp"] == "2025-01-18T10:45:00Z"
    assert body["mesh"] == {"interface": "plexd0", "peer_count": 3, "listen_port": 51820}
    assert body["nat"] == {"public_endpoint": "203.0.113.10:51820", "type": "full_cone"}


def test_nat_and_mesh_omitted_when_unknown():
    hb = HeartbeatService("n_1", lambda b: {}, lambda: HeartbeatSnapshot(), clock=FakeClock(NOW))
    assert set(hb.build()) == {"node_id", "timestamp", "status", "uptime", "binary_checksum"}
    assert hb.build()["uptime"] == "0s"


def test_the_body_names_the_node_id_of_now():
    # A fresh registration after a 401 brings another node id; the heartbeat must not go on naming the old one.
    ids = ["n_old"]
    hb = HeartbeatService(lambda: ids[-1], lambda b: {}, lambda: HeartbeatSnapshot(), clock=FakeClock(NOW))
    assert hb.build()["node_id"] == "n_old"
    ids.append("n_new")
    assert hb.build()["node_id"] == "n_new"


def test_uptime_is_the_daemons_when_given():
    # plexd up passes agent.uptime: registration may have taken a while before the heartbeat service existed
    hb = HeartbeatService("n_1", lambda b: {}, lambda: HeartbeatSnapshot(), clock=FakeClock(NOW),
                          uptime=lambda: 3725.9)
    assert hb.build()["uptime"] == "1h2m5s"


async def test_first_at_start_then_every_interval():
    sent = []
    hb, clock = service(lambda b: sent.append(b["timestamp"]) or {}, interval=30)
    task = asyncio.create_task(hb.run())
    try:
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(sent) == 1
        for n in (2, 3, 4):
            clock.advance(30)
            for _ in range(20):
                await asyncio.sleep(0)
            assert len(sent) == n
        assert clock.sleeps == [30, 30, 30, 30]  # fixed schedule, no drift
    finally:
        task.cancel()


async def test_reconcile_and_rotate_keys_trigger_reconcile():
    reasons = []
    answers = iter([{"reconcile": True, "rotate_keys": False}, {"reconcile": False, "rotate_keys": True},
                    {"reconcile": False, "rotate_keys": False}])
    hb, _ = service(lambda b: next(answers), trigger_reconcile=reasons.append)
    for _ in range(3):
        assert await hb.beat()
    assert reasons == ["heartbeat asked for reconcile", "heartbeat asked for key rotation"]


async def test_rotate_keys_starts_a_key_rotation_when_one_is_wired_in():
    reasons, rotations = [], []
    answers = iter([{"reconcile": False, "rotate_keys": True}])
    hb, _ = service(lambda b: next(answers), trigger_reconcile=reasons.append, rotate_keys=rotations.append)
    assert await hb.beat()
    assert rotations == ["the heartbeat response asked for it"] and reasons == []


async def test_401_starts_reauthentication():
    auth = []

    def send(body):
        raise Refused(401)
    hb, _ = service(send, on_auth_failure=lambda: auth.append(1))
    assert not await hb.beat()
    assert auth == [1]


async def test_three_failures_warn_once_and_recovery_logged_once(caplog):
    caplog.set_level(logging.DEBUG, "plexd.services.heartbeat")
    fail = {"on": True}

    def send(body):
        if fail["on"]:
            raise Refused(503)
        return {}
    hb, _ = service(send)
    for _ in range(5):
        await hb.beat()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3 times in a row" in warnings[0].getMessage()
    fail["on"] = False
    await hb.beat()
    await hb.beat()
    recovered = [r for r in caplog.records if "recovered" in r.getMessage()]
    assert len(recovered) == 1


async def test_async_sender():
    async def send(body):
        await asyncio.sleep(0)
        return {"reconcile": False}
    hb, _ = service(send)
    assert await hb.beat()
    assert hb.sent == 1


def test_http_status_of_various_errors():
    req = httpx.Request("POST", "http://x")
    assert http_status(httpx.HTTPStatusError("x", request=req, response=httpx.Response(401, request=req))) == 401
    assert http_status(Refused(403)) == 403
    assert http_status(ValueError()) is None
