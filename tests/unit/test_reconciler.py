"""Reconciler cycle logic with fakes for fetch/apply/converge/post (the real path is in tests/e2e)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime

from plexd.base import gojson
from plexd.base.clock import FakeClock
from plexd.converge.change import Correction
from plexd.services.pull_freshness import PullFreshness
from plexd.services.reconciler import Reconciler

NOW = datetime(2025, 1, 15, 10, 30, tzinfo=UTC)


@dataclass
class Change:
    correction_type: str
    detail: str

    def correction(self) -> Correction:
        return Correction(self.correction_type, self.detail)


@dataclass
class Result:
    changes: list = field(default_factory=list)
    held_back: bool = False  # as ConvergeResult says of a hold or a keep


class World:
    def __init__(self):
        self.fetches = 0
        self.applied = []
        self.drift = []
        self.next_changes = []
        self.fail_fetch = False
        self.fail_post = False
        self.dry_runs = 0

    async def fetch(self):
        self.fetches += 1
        if self.fail_fetch:
            raise ConnectionError("control plane unreachable")
        return {"state": self.fetches}

    def apply(self, state):
        self.applied.append(state)

    async def converge(self, dry_run=False):
        self.converges = getattr(self, "converges", 0) + 1
        if dry_run:
            self.dry_runs += 1
            return Result(list(self.next_changes))  # a dry run: planned, not held back
        changes, self.next_changes = self.next_changes, []
        return Result(changes)

    async def post(self, report):
        if self.fail_post:
            raise ConnectionError("no")
        self.drift.append(report)


class Parts:
    """The reconciler's state source and converger (`StateSource`, `Converger`), from the test's functions."""

    def __init__(self, fetch, apply, converge, *, refusals=None, apply_events=None, events_pending=lambda: 0):
        self._fetch, self._apply, self.converge_fn = fetch, apply, converge
        self._refusals, self._apply_events, self._events_pending = refusals, apply_events, events_pending

    async def fetch(self):
        return await self._fetch()

    def apply(self, pulled):
        return self._apply(pulled)

    async def plan(self, pulled):  # the pulled state applied, then a dry converge
        self._apply(pulled)
        return await self.converge_fn(dry_run=True)

    def take_refusals(self):
        return self._refusals() if self._refusals is not None else []

    async def between_pulls(self):  # what the model reads of the machine between pulls changed (when set)
        changed, self.local_change = getattr(self, "local_change", False), False
        return changed

    async def converge(self, *, dry_run=False):
        return await self.converge_fn(dry_run=dry_run)

    async def apply_events(self):
        assert self._apply_events is not None, "this test gave no event path"
        return await self._apply_events()

    @property
    def pending(self):
        return self._events_pending()


def make(fetch, apply, converge, post, *, clock=None, interval=60, **parts):
    both = Parts(fetch, apply, converge, **parts)
    return Reconciler(both, both, post, clock=clock, interval=interval)


def reconciler(world, clock=None, interval=60):
    clock = clock or FakeClock(NOW)
    return make(world.fetch, world.apply, world.converge, world.post, clock=clock, interval=interval), clock


async def spin(n=30):
    for _ in range(n):
        await asyncio.sleep(0)


async def test_drift_posted_only_when_corrected():
    w = World()
    r, _ = reconciler(w)
    res = await r.run_once()
    assert res.ok and res.corrections == [] and w.drift == []
    w.next_changes = [Change("peer_updated", "peer n_x: endpoint 1.2.3.4:1 != 5.6.7.8:1"),
                      Change("peer_added", "peer n_y")]
    res = await r.run_once()
    assert w.drift == [{"timestamp": w.drift[0]["timestamp"], "corrections": [
        {"type": "peer_updated", "detail": "peer n_x: endpoint 1.2.3.4:1 != 5.6.7.8:1"},
        {"type": "peer_added", "detail": "peer n_y"}]}]
    assert gojson.parse_time(w.drift[0]["timestamp"]) == NOW
    assert w.applied == [{"state": 1}, {"state": 2}]


async def test_changes_from_the_new_state_are_updates_not_drift():
    w = World()

    async def converge(dry_run=False):
        # phase 1 (the model we had) finds the drift; phase 2 (after the new state) applies a new peer
        w.calls = getattr(w, "calls", 0) + 1
        return Result([Change("peer_updated", "peer n_x: endpoint drifted")] if w.calls % 2 else
                      [Change("peer_added", "peer n_new: missing from the device")])
    r = make(w.fetch, lambda s: [Correction("signing_keys_updated", "signing keys rotated")], converge,
                   w.post, clock=FakeClock(NOW))
    res = await r.run_once()
    assert [c.type for c in res.corrections] == ["peer_updated"]
    assert [c.type for c in res.updates] == ["signing_keys_updated", "peer_added"]
    assert w.drift[0]["corrections"] == [{"type": "peer_updated", "detail": "peer n_x: endpoint drifted"}]


async def test_first_cycle_after_start_is_not_drift_and_works_offline():
    w = World()
    w.fail_fetch = w.fail_post = True
    w.next_changes = [Change("interface_created", "interface plexd0: missing, created")]
    r, clock = reconciler(w)
    task = asyncio.create_task(r.run())
    try:
        await spin()
        assert r.cycles == 1 and w.next_changes == [] and w.drift == []  # brought up, offline, not reported
        w.next_changes = [Change("address_added", "interface plexd0: address 10.100.0.1/32 missing")]
        clock.advance(60)
        await spin()
        assert r.cycles == 2 and not r.last.ok  # still offline: the drift is corrected, the report queued
        assert w.drift == [] and r.last.corrections
        w.fail_fetch = w.fail_post = False
        clock.advance(60)
        await spin()
        assert [d["corrections"][0]["type"] for d in w.drift] == ["address_added"]
    finally:
        task.cancel()


async def test_dry_run_changes_nothing_and_posts_nothing():
    w = World()
    w.next_changes = [Change("peer_added", "peer n_y")]
    r, _ = reconciler(w)
    res = await r.run_once(dry_run=True)
    assert res.dry_run and [c.type for c in res.corrections] == ["peer_added"]
    assert w.dry_runs == 1 and w.drift == [] and w.next_changes


async def test_fetch_failure_logged_and_loop_goes_on(caplog):
    w = World()
    w.fail_fetch = True
    r, clock = reconciler(w)
    task = asyncio.create_task(r.run())
    try:
        await spin()
        assert r.failures == 1 and "fetching the state failed" in caplog.text
        w.fail_fetch = False
        clock.advance(60)
        await spin()
        assert r.cycles == 2 and r.last.ok
    finally:
        task.cancel()


async def test_unsent_report_retried_next_cycle():
    w = World()
    w.fail_post = True
    w.next_changes = [Change("peer_removed", "peer n_z")]
    r, _ = reconciler(w)
    await r.run_once()
    assert w.drift == []
    w.fail_post = False
    await r.run_once()
    assert [d["corrections"] for d in w.drift] == [[{"type": "peer_removed", "detail": "peer n_z"}]]


async def test_first_cycle_at_start_then_interval_and_coalesced_triggers():
    w = World()
    r, clock = reconciler(w, interval=60)
    task = asyncio.create_task(r.run())
    try:
        await spin()
        assert w.fetches == 1 and r.last.reasons == ("start",)
        clock.advance(60)
        await spin()
        assert w.fetches == 2 and r.last.reasons == ("interval",)
        for reason in ("reconnect", "policy_updated", "reconnect"):
            r.trigger(reason)
        await spin()
        assert w.fetches == 3  # three triggers, one cycle
        assert r.last.reasons == ("reconnect", "policy_updated")
        await spin()
        assert w.fetches == 3
        clock.advance(59)
        await spin()
        assert w.fetches == 3  # the interval restarted after the triggered cycle
        clock.advance(1)
        await spin()
        assert w.fetches == 4
    finally:
        task.cancel()


async def test_trigger_during_a_cycle_causes_one_more():
    w = World()
    gate = asyncio.Event()

    async def slow_fetch():
        w.fetches += 1
        await gate.wait()
        return {}
    r = make(slow_fetch, w.apply, w.converge, w.post, clock=FakeClock(NOW))
    task = asyncio.create_task(r.run())
    try:
        await spin()
        r.trigger("a")
        r.trigger("b")
        gate.set()
        await spin()
        assert w.fetches == 2
    finally:
        task.cancel()


async def test_refused_peers_and_routes_are_reported_once_with_the_drift():
    w = World()
    pending = [[Correction("allowed_ip_rejected", "peer n_x: 0.0.0.0/0 a default route")], []]
    r = make(w.fetch, w.apply, w.converge, w.post, clock=FakeClock(NOW), refusals=lambda: pending.pop(0))
    res = await r.run_once()
    assert res.refused == [Correction("allowed_ip_rejected", "peer n_x: 0.0.0.0/0 a default route")]
    assert w.drift[0]["corrections"] == [{"type": "allowed_ip_rejected",
                                          "detail": "peer n_x: 0.0.0.0/0 a default route"}]
    await r.run_once()
    assert len(w.drift) == 1  # nothing new refused, no drift: no report


async def test_a_report_that_can_never_be_delivered_does_not_block_the_next():
    from plexd.controlplane.client_errors import PermanentError

    w = World()
    sent = []
    answers = [PermanentError("drift", 404, "no such node"), None]

    async def post(report):
        outcome = answers.pop(0) if answers else None
        if outcome is not None:
            raise outcome
        sent.append(report)

    r = make(w.fetch, w.apply, w.converge, post, clock=FakeClock(NOW))
    w.next_changes = [Change("peer_added", "peer n_a: missing")]
    first = await r.run_once()
    assert first.report is not None and not first.reported  # dropped, with an error logged
    w.next_changes = [Change("peer_added", "peer n_b: missing")]
    second = await r.run_once()
    assert second.reported and [c["detail"] for c in sent[0]["corrections"]] == ["peer n_b: missing"]


async def test_a_refresh_pulls_and_applies_through_the_event_path_without_reading_the_machine():
    w = World()
    deltas = []

    async def apply_events(dry_run=False):
        deltas.append(w.applied[-1])
        return Result([Change("policy_added", "policy p: rule missing")])

    r = make(w.fetch, w.apply, w.converge, w.post, clock=FakeClock(NOW), apply_events=apply_events)
    converges = []
    real = w.converge

    async def counted(dry_run=False):
        converges.append(dry_run)
        return await real(dry_run)

    r._gate.converge_fn = counted
    task = asyncio.create_task(r.run())
    try:
        await spin()
        assert len(converges) == 2 and w.fetches == 1  # the start cycle: both phases
        r.refresh("policy_updated")
        r.refresh("policy_updated")
        await spin()
        assert w.fetches == 2 and deltas == [{"state": 2}] and len(converges) == 2  # no full converge
        assert r.refreshes == 1 and w.drift == []  # nothing read, so no drift to report
        # a refresh and a trigger together: the full cycle covers both
        r.refresh("policy_updated")
        r.trigger("reconnect")
        await spin()
        assert w.fetches == 3 and len(converges) == 4 and r.refreshes == 1
        assert r.last.reasons == ("reconnect", "policy_updated")
        # the pull fails: a full cycle is asked for (and runs, and fails to fetch too, reported as such)
        w.fail_fetch = True
        r.refresh("policy_updated")
        await spin()
        assert r.refreshes == 2 and r.last.reasons == ("policy_updated: the state refresh failed",)
    finally:
        task.cancel()


async def test_events_in_the_model_not_yet_applied_are_applied_as_events_not_reported_as_drift():
    """A peer_added edited into the model whose apply is still queued when a cycle starts (a stream reconnect
    triggered it): phase 1 applies it on the event path first, so only what the machine lost is drift."""
    w = World()
    pending = [Change("peer_added", "peer n_new: missing from the device")]
    order = []

    async def apply_events(dry_run=False):
        order.append("events")
        applied, pending[:] = list(pending), []
        return Result(applied)

    async def converge(dry_run=False):
        order.append("converge")
        return Result(list(pending))  # without the event path first, the event's peer would be found missing

    r = make(w.fetch, w.apply, converge, w.post, clock=FakeClock(NOW), apply_events=apply_events,
                   events_pending=lambda: len(pending))
    res = await r.run_once(reasons=("event stream (re)connected",))
    assert res.corrections == [] and w.drift == []
    assert order[:2] == ["events", "converge"]
    w.next_changes = []
    order.clear()
    await r.run_once(reasons=("interval",))  # nothing pending: no event apply, which could repair drift unseen
    assert order[0] == "converge" and "events" not in order
    pending.append(Change("peer_added", "peer n_new: missing from the device"))
    start = await r.run_once(reasons=("start",), startup=True)  # at start there is no event path yet
    assert order[-2:] == ["converge", "converge"] and start.corrections == []


# -- the pull skipped while the event stream keeps the model current ------------------------------------------------


class Stream:
    """What PullFreshness reads of the event stream: its continuity (None while not connected)."""

    def __init__(self):
        self.connected, self.connects, self.rejected = True, 1, 0

    def continuity(self):
        return (self.connects, self.rejected) if self.connected else None


def leaning_on(stream, w, pull_interval=600):
    r, clock = reconciler(w, interval=60)
    r.freshness = PullFreshness(stream.continuity, clock, pull_interval)
    return r, clock


async def interval_cycle(r, clock):
    clock.advance(60)
    await spin()
    return r.last


async def test_an_interval_cycle_skips_the_pull_while_the_stream_carried_every_event():
    w, s = World(), Stream()
    r, clock = leaning_on(s, w)
    task = asyncio.create_task(r.run())
    try:
        await spin()
        assert w.fetches == 1  # the start pulls
        w.next_changes = [Change("peer_removed", "peer n_z")]  # someone removed a peer from the device
        last = await interval_cycle(r, clock)
        # the machine is still diffed (the drift is corrected and reported) but the state is not pulled
        assert w.fetches == 1 and last.reasons == ("interval",) and not last.pulled and last.ok
        assert [d["corrections"] for d in w.drift] == [[{"type": "peer_removed", "detail": "peer n_z"}]]
        assert last.to_json()["state_pulled"] is False and r.pulls_skipped == 1
        r.trigger("heartbeat asked for a reconcile")  # a cycle with a reason of its own always pulls
        await spin()
        assert w.fetches == 2 and r.last.pulled
    finally:
        task.cancel()


async def test_a_reconnect_a_refused_event_or_a_lost_stream_makes_the_next_interval_cycle_pull():
    w, s = World(), Stream()
    r, clock = leaning_on(s, w)
    task = asyncio.create_task(r.run())
    try:
        await spin()
        await interval_cycle(r, clock)
        assert w.fetches == 1
        s.rejected += 1  # an event refused: its change is not in the model
        assert (await interval_cycle(r, clock)).pulled and w.fetches == 2
        assert not (await interval_cycle(r, clock)).pulled and w.fetches == 2
        s.connects += 1  # a new connection (the stream's own trigger is not sent here)
        assert (await interval_cycle(r, clock)).pulled and w.fetches == 3
        s.connected = False  # polling: every cycle pulls
        for expected in (4, 5):
            assert (await interval_cycle(r, clock)).pulled and w.fetches == expected
    finally:
        task.cancel()


async def test_the_pull_interval_bounds_how_long_the_stream_stands_in_and_a_failed_pull_counts_for_nothing():
    w, s = World(), Stream()
    r, clock = leaning_on(s, w, pull_interval=180)
    task = asyncio.create_task(r.run())
    try:
        await spin()
        pulled = [(await interval_cycle(r, clock)).pulled for _ in range(6)]
        assert pulled == [False, False, True, False, False, True]  # at 180 s, 360 s
    finally:
        task.cancel()


async def test_an_asked_for_pull_that_fails_leaves_the_next_interval_cycle_pulling():
    """policy_updated asks for a refresh; GET /state fails once: the change is still to be pulled, so the cycles
    after it pull until one succeeds (and the stream, connected all along, does not stand in for it)."""
    w, s = World(), Stream()
    r, clock = leaning_on(s, w)
    task = asyncio.create_task(r.run())
    try:
        await spin()
        assert not (await interval_cycle(r, clock)).pulled
        w.fail_fetch = True
        r.refresh("policy_updated")
        await spin()
        # the refresh failed and asked for a full cycle, which failed too
        assert w.fetches == 3 and r.refreshes == 1 and not r.last.ok and r.last.pulled
        assert (await interval_cycle(r, clock)).pulled and not r.last.ok  # still failing: still pulling
        w.fail_fetch = False
        assert (await interval_cycle(r, clock)).pulled and r.last.ok
        assert not (await interval_cycle(r, clock)).pulled  # and only then does the stream stand in again
        r.stale("an action put off until the state offers it again")
        assert (await interval_cycle(r, clock)).pulled
    finally:
        task.cancel()


async def test_a_cycle_that_skips_the_pull_still_takes_what_the_machine_says_for_the_model():
    """The route guard's protected addresses are read at every pull; between pulls they are read again, and a change
    is converged in the same cycle (an update, not drift)."""
    w, s = World(), Stream()
    r, clock = leaning_on(s, w)
    task = asyncio.create_task(r.run())
    try:
        await spin()
        before = w.converges
        assert not (await interval_cycle(r, clock)).pulled
        assert w.converges == before + 1  # phase 1 only: nothing new read
        r._source.local_change = True
        last = await interval_cycle(r, clock)
        assert not last.pulled and last.ok and w.fetches == 1
        assert w.converges == before + 3  # phase 1, then the model's new limits converged
    finally:
        task.cancel()


def test_an_invalidation_only_counts_pulls_that_started_after_it():
    s, clock = Stream(), FakeClock(NOW)
    f = PullFreshness(s.continuity, clock, 600)
    mark = f.mark()  # a pull starts ...
    f.invalidate()  # ... a refresh is asked for while it is in flight ...
    f.pulled(mark)  # ... and the pull lands: it may predate the change the refresh is about
    assert f.due() == "a pull was asked for since the last one"
    f.pulled(f.mark())
    assert f.due() == ""


def test_without_a_connected_stream_the_freshness_is_always_due():
    s, clock = Stream(), FakeClock(NOW)
    f = PullFreshness(s.continuity, clock, 600)
    assert f.due() == "no state pulled yet"
    s.connected = False
    f.pulled(f.mark())  # a pull while the stream was down
    s.connected = True
    assert f.due() == "the event stream may have missed an event since the last pull"
    f.pulled(f.mark())
    assert f.due() == ""
    clock.advance(600)
    assert f.due() == "the last pull is older than reconcile.pull_interval"
