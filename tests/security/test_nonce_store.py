"""Attack: fill the nonce store so that it forgets, then replay. The store used to evict its oldest nonce at
100,000 entries: a burst of genuine events (or a control plane tricked into sending them) pushed a nonce out while
its event was still inside the 5-minute window, and that event could then be replayed. Now a full store refuses
new events and forgets nothing unexpired, in memory and in the ledger on disk (after a restart too).

Real parts: Ed25519-signed events (the devplane's `sign_event`), the real event stream's per-frame path
(`EventStream.handle_frame`: parse, verify, dispatch, note), the real SQLite ledger committed to disk and reopened.
The cap is lowered to 50 (a constructor argument) so the store fills without 100,000 events."""

from __future__ import annotations

import base64
import logging
from datetime import UTC, datetime, timedelta

import nacl.signing
import pytest

from plexd.base.clock import FakeClock
from plexd.base.gojson import format_time
from plexd.controlplane.envelope import Envelope, sign_event
from plexd.controlplane.event_signing import NONCE_STORE_FULL, NonceStore, Verifier
from plexd.controlplane.event_stream import EventStream
from plexd.controlplane.ledger import EventLedger
from plexd.controlplane.sse import SSEEvent
from plexd.state.model import SigningKeys

CAP = 50
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
KEY = nacl.signing.SigningKey.generate()
KEYS = SigningKeys(current=base64.b64encode(bytes(KEY.verify_key)).decode())


def frame(n: int, issued: datetime) -> SSEEvent:
    data = sign_event(KEY, "peer_added", f"evt_{n}", {"id": f"n_{n}"}, issued_at=format_time(issued),
                      nonce=f"nonce-{n}")
    return SSEEvent(data=data, id=f"evt_{n}")


class Node:
    """The event path of one daemon over `events.db` in `data_dir`: what it applied, what it refused."""

    def __init__(self, data_dir, clock: FakeClock, on_clock_agrees=None) -> None:
        self.applied: list[str] = []
        self.ledger = EventLedger(data_dir / "events.db", max_nonces=CAP)
        self.nonces = NonceStore(clock, self.ledger, max_entries=CAP)
        self.stream = EventStream("http://cp.invalid", "n_1", lambda: "t", self.ledger,
                                  Verifier(KEYS, self.nonces, clock), self._apply, clock=clock,
                                  on_clock_agrees=on_clock_agrees)

    async def _apply(self, env: Envelope) -> None:
        self.applied.append(env.event_id)

    async def deliver(self, f: SSEEvent) -> bool:
        """True when the event was applied."""
        before = len(self.applied)
        self.stream._seen_ids.clear()  # a new connection: the id cache is not what stops a replay
        await self.stream.handle_frame(f)
        return len(self.applied) > before


@pytest.fixture
def clock():
    return FakeClock(NOW)


async def test_a_full_store_refuses_new_events_and_forgets_none(tmp_path, clock, caplog):
    node = Node(tmp_path, clock)
    frames = [frame(i, NOW - timedelta(seconds=60) + timedelta(seconds=i)) for i in range(CAP + 20)]
    for f in frames[:CAP]:
        assert await node.deliver(f), f.id
    caplog.set_level(logging.DEBUG)
    for f in frames[CAP:]:  # the flood past the cap: refused, and one warning line for all of them
        assert not await node.deliver(f), f"{f.id} accepted by a full nonce store"
    assert node.stream.rejected_by_reason[NONCE_STORE_FULL] == 20
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "nonce store full" in warnings[0], warnings
    # nothing was forgotten: every accepted event's replay is still refused, the oldest first
    for f in frames[:CAP]:
        assert not await node.deliver(f), f"{f.id} replayed after the store filled"
    assert node.stream.rejected_by_reason["duplicate_nonce"] == CAP
    assert node.applied == [f.id for f in frames[:CAP]]


async def test_nothing_unexpired_is_dropped_from_disk_and_a_replay_after_restart_is_refused(tmp_path, clock):
    node = Node(tmp_path, clock)
    frames = [frame(i, NOW - timedelta(seconds=30)) for i in range(CAP)]
    for f in frames:
        assert await node.deliver(f)
    node.ledger.commit(clock.now().timestamp())
    assert len(node.ledger.stored()[1]) == CAP
    node.ledger.close(clock.now().timestamp())

    again = Node(tmp_path, clock)  # a restart within the window
    assert len(again.nonces) == CAP
    for f in frames:
        assert not await again.deliver(f), f"{f.id} replayed after a restart"
    assert not await again.deliver(frame(CAP, NOW)), "a full store accepted a new event after a restart"
    again.ledger.close(clock.now().timestamp())


async def test_expired_nonces_make_room_and_stay_refused_by_the_window(tmp_path, clock):
    node = Node(tmp_path, clock)
    old = [frame(i, NOW - timedelta(seconds=290)) for i in range(CAP)]
    for f in old:
        assert await node.deliver(f)
    assert not await node.deliver(frame(CAP, NOW))  # full
    clock.advance(11)  # the old ones are now 301 s old: expired, and outside the window
    fresh = frame(CAP + 1, clock.now())
    assert await node.deliver(fresh), "expired nonces did not make room"
    assert not await node.deliver(old[0])  # its nonce is gone, the window check refuses it
    assert node.stream.rejected_by_reason["stale"] == 1
    node.ledger.commit(clock.now().timestamp())
    assert node.ledger.stored()[1] == {"nonce-51"}  # expired nonces left the table, the unexpired one did not
    node.ledger.close(clock.now().timestamp())
