"""This node's wall clock stepped an hour away from the control plane's: every signed event is outside the 5-minute
window. Before, each was refused and the cursor moved past it, so an action requested meanwhile was never answered
(found by `python -m bench chaos`, clock faults). Now an authentic event refused only by the window is held, and
handled once the clock agrees; forgeries and replays are refused as before, and the hold is bounded.

Real parts: Ed25519-signed events, the real stream's per-frame path and its SQLite ledger (the harness of
test_nonce_store.py); the clock is the injectable FakeClock, its wall clock stepped alone as NTP would."""

from __future__ import annotations

import asyncio

import nacl.signing
import pytest
from test_nonce_store import NOW, Node, frame

from plexd.base.clock import FakeClock
from plexd.base.gojson import format_time
from plexd.controlplane import clock_hold
from plexd.controlplane.envelope import sign_event
from plexd.controlplane.event_stream import HELD_RETRY
from plexd.controlplane.sse import SSEEvent

HOUR = 3600.0


@pytest.fixture
def clock():
    return FakeClock(NOW)


@pytest.mark.parametrize("step", [HOUR, -HOUR], ids=["clock ahead", "clock behind"])
async def test_an_event_refused_by_a_stepped_clock_is_handled_once_the_clock_agrees(tmp_path, clock, step):
    node = Node(tmp_path, clock)
    clock.step_wall(step)
    event = frame(1, NOW)  # issued by the control plane at the real time
    assert not await node.deliver(event)
    assert node.stream.rejected_by_reason["stale" if step > 0 else "future"] == 1
    assert node.stream.status()["events_held_for_clock"] == 1
    assert node.stream.status()["clock_offset_seconds"] == step

    await node.stream.retry_held()  # the clock still disagrees: still held, not handled
    assert node.applied == [] and len(node.stream.clock_hold) == 1

    clock.step_wall(-step + 20)  # NTP sets it right (20 s later)
    await node.stream.retry_held()
    assert node.applied == ["evt_1"] and len(node.stream.clock_hold) == 0
    assert not await node.deliver(event)  # its nonce was recorded when it was handled: a replay is refused
    assert node.stream.rejected_by_reason["duplicate_nonce"] == 1
    node.ledger.commit(clock.now().timestamp())
    assert "nonce-1" in node.ledger.stored()[1]
    node.ledger.close(clock.now().timestamp())


async def test_the_stream_tries_the_held_events_again_by_itself(tmp_path, clock):
    node = Node(tmp_path, clock)
    clock.step_wall(HOUR)
    await node.deliver(frame(1, NOW))
    await asyncio.sleep(0)
    clock.step_wall(-HOUR)
    clock.advance(HELD_RETRY)
    for _ in range(100):
        await asyncio.sleep(0)
    assert node.applied == ["evt_1"]
    for _ in range(10):
        await asyncio.sleep(0)
    assert node.stream._retrying is not None and node.stream._retrying.done()  # nothing held: the task ended
    node.ledger.close(clock.now().timestamp())


async def test_a_fresh_event_the_window_takes_lets_the_held_ones_go_first_and_asks_for_a_pull(tmp_path, clock):
    """Once the clock is corrected, the first event the window takes proves it: the held events, older, are
    handled before it (not up to HELD_RETRY later, after it), and the reconciler is asked to pull the state once,
    for anything the hold dropped."""
    pulls: list[str] = []
    node = Node(tmp_path, clock, on_clock_agrees=lambda: pulls.append("pull"))
    clock.step_wall(-HOUR)
    assert not await node.deliver(frame(1, NOW))
    assert not await node.deliver(frame(2, NOW))
    assert pulls == []  # still held: nothing agrees yet
    clock.step_wall(HOUR)
    assert await node.deliver(frame(3, clock.now()))
    assert node.applied == ["evt_1", "evt_2", "evt_3"]
    assert pulls == ["pull"] and len(node.stream.clock_hold) == 0
    assert await node.deliver(frame(4, clock.now()))  # nothing held any more: no second pull
    assert pulls == ["pull"]
    node.ledger.close(clock.now().timestamp())


async def test_no_pull_is_asked_while_the_clock_still_disagrees(tmp_path, clock):
    pulls: list[str] = []
    node = Node(tmp_path, clock, on_clock_agrees=lambda: pulls.append("pull"))
    clock.step_wall(HOUR)
    await node.deliver(frame(1, NOW))
    await node.stream.retry_held()
    assert pulls == [] and len(node.stream.clock_hold) == 1
    node.ledger.close(clock.now().timestamp())


async def test_a_forgery_is_not_held(tmp_path, clock):
    node = Node(tmp_path, clock)
    clock.step_wall(HOUR)
    other = nacl.signing.SigningKey.generate()
    forged = SSEEvent(data=sign_event(other, "peer_added", "evt_f", {"id": "x"}, issued_at=format_time(NOW),
                                      nonce="nonce-f"), id="evt_f")
    assert not await node.deliver(forged)
    assert len(node.stream.clock_hold) == 0
    node.ledger.close(clock.now().timestamp())


async def test_the_hold_is_bounded_and_lets_go_after_its_time(tmp_path, clock, monkeypatch, caplog):
    monkeypatch.setattr(clock_hold, "MAX_EVENTS", 3)
    node = Node(tmp_path, clock)
    clock.step_wall(HOUR)
    for i in range(5):
        await node.deliver(frame(i, NOW))
    assert len(node.stream.clock_hold) == 3
    assert sum("dropped: the hold is full" in r.getMessage() for r in caplog.records) == 2
    clock.advance(clock_hold.HOLD_FOR + 1)  # and the clock never agrees
    await node.stream.retry_held()
    assert len(node.stream.clock_hold) == 0 and node.applied == []
    assert sum("still outside the 5-minute window" in r.getMessage() for r in caplog.records) == 3
    node.ledger.close(clock.now().timestamp())
