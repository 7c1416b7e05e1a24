"""One retry policy for everything the node sends on its own: the drift-report outbox, action results, node-API
report sync and telemetry all classify a control-plane answer the same way (retry with backoff, wait out the
server's Retry-After, drop a 4xx that can never succeed). Drift reports, action messages, report changes and
telemetry are lanes of the one uplink outbox; each is driven with a send function standing in for
the control plane (the real POST paths run against the devplane in the e2e labs); what is checked here is that
the four agree, answer by answer."""

from __future__ import annotations

import time

import pytest

from plexd.actions.journal import ActionJournal
from plexd.actions.outbox import Outbox
from plexd.base.backoff import Backoff
from plexd.controlplane.client_errors import (
    AuthError,
    ControlPlaneError,
    PermanentError,
    RetryAfterError,
    TransientError,
)
from plexd.controlplane.uplink import UplinkOutbox
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.sync import ReportSync
from plexd.telemetry.queue import TelemetryQueue, lane

FAST = {"base": 0.01, "cap": 0.02, "jitter": 0}
ANSWERS = [
    (TransientError("x", 0, "connection refused"), True),
    (TransientError("x", 500, "oops"), True),
    (TransientError("x", 503, "busy"), True),
    (TransientError("x", 408, "slow"), True),
    (AuthError("x", 401, "who"), True),
    (RetryAfterError("x", 429, "later", retry_after=30.0), True),
    (RetryAfterError("x", 503, "shedding", retry_after=30.0), True),
    (ControlPlaneError("x", 400, "bad"), False),
    (PermanentError("x", 403, "no"), False),
    (PermanentError("x", 404, "gone"), False),
    (ControlPlaneError("x", 409, "conflict"), False),
    (ControlPlaneError("x", 413, "too big"), False),
    (ControlPlaneError("x", 422, "invalid"), False),
]


def failing_once(error: Exception):
    calls = []

    async def send(*args):
        calls.append(args)
        if len(calls) == 1:
            raise error

    return send, calls


async def uplink(tmp_path, error) -> tuple[bool, float]:
    send, _ = failing_once(error)
    box = UplinkOutbox(tmp_path / "uplink.db", send, backoff=Backoff(**FAST))
    box.put("drift", {"n": 1})
    before = time.monotonic()  # the retry is scheduled from a moment after this: never negative, however slow
    await box.deliver()
    kept = box.size() == 1
    return kept, box.retry_at("drift") - before if kept else 0.0


async def actions(tmp_path, error) -> tuple[bool, float]:
    send, _ = failing_once(error)
    journal = ActionJournal(tmp_path / "uplink.db")
    journal.queue("ack", "e1", {})
    Outbox(journal, send, backoff=Backoff(**FAST))
    before = time.monotonic()
    await journal.uplink.deliver()
    kept = journal.outbox_size() == 1
    return kept, journal.uplink.retry_at("actions") - before if kept else 0.0


async def reports(tmp_path, error) -> tuple[bool, float]:
    send, _ = failing_once(error)
    store = ReportStore(tmp_path)
    uplink = UplinkOutbox(tmp_path / "uplink.db", send)
    sync = ReportSync(store, send, uplink, backoff=Backoff(**FAST))
    store.subscribe(sync.changed)
    await store.put("a", "text/plain", "1", None)
    before = time.monotonic()
    await uplink.deliver()
    kept = sync.pending == 1
    return kept, uplink.retry_at("reports") - before if kept else 0.0


async def telemetry(tmp_path, error) -> tuple[bool, float]:
    send, _ = failing_once(error)
    box = UplinkOutbox(tmp_path / "uplink.db", send)
    queue = TelemetryQueue(box, {"logs": 1 << 20})
    queue.add_lane("logs", send, batch_size=10, interval=0.05)
    queue.append("logs", [{"n": 1}])
    before = time.monotonic()
    await box.deliver()
    kept = queue.status("logs")["pending"] == 1
    return kept, box.retry_at(lane("logs")) - before if kept else 0.0


@pytest.mark.parametrize("consumer", [uplink, actions, reports, telemetry])
@pytest.mark.parametrize(("error", "retried"), ANSWERS, ids=[f"{e.status}-{type(e).__name__}" for e, _ in ANSWERS])
async def test_every_uplink_consumer_answers_a_failure_the_same_way(tmp_path, consumer, error, retried):
    kept, delay = await consumer(tmp_path, error)
    assert kept == retried, f"{consumer.__name__}: {error.status} {'kept for a retry' if retried else 'dropped'}"
    if isinstance(error, RetryAfterError):
        assert delay >= 29.0, f"{consumer.__name__} did not wait out Retry-After: {delay}"
    elif retried:
        assert 0 < delay <= 5.0  # the backoff (0.01-0.02 s, plus a loaded machine's delay), not a 30 s Retry-After
