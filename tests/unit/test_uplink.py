"""The uplink outbox: durable and ordered, bounded (oldest dropped and counted), one retry policy for every
report (transient → backoff, 429 → Retry-After, 401 → retry, other 4xx → dropped), never blocked by one entry."""

from __future__ import annotations

import asyncio

import pytest

from plexd.base.backoff import Backoff
from plexd.base.errors import PlexdError
from plexd.controlplane.client_errors import AlreadySettled, AuthError, PermanentError, RetryAfterError, TransientError
from plexd.controlplane.uplink import UplinkOutbox, by_kind, retry_verdict

NO_JITTER = dict(base=0.01, cap=0.05, jitter=0.0)


class ControlPlane:
    def __init__(self) -> None:
        self.taken: list[tuple[str, dict]] = []
        self.answers: list[Exception | None] = []

    async def send(self, kind: str, body: dict) -> None:
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise answer
        self.taken.append((kind, body))


@pytest.mark.parametrize("error, retry", [
    (TransientError("drift", 0, "connection refused"), True),
    (TransientError("drift", 503, "busy"), True),
    (TransientError("drift", 408, "timeout"), True),
    (AuthError("drift", 401, "who"), True),
    (RetryAfterError("drift", 429, "slow", retry_after=30.0), True),
    (TransientError("drift", 400, "bad"), False),
    (PermanentError("drift", 404, "no node"), False),
    (TransientError("drift", 409, "conflict"), False),
    (TransientError("drift", 422, "no"), False),
])
def test_one_policy_says_retry_or_drop(error, retry):
    verdict = retry_verdict(error, Backoff(**NO_JITTER))
    assert verdict.retry is retry and str(error) in verdict.reason


def test_retry_after_is_honoured_and_never_shorter_than_the_backoff():
    draws = [retry_verdict(RetryAfterError("d", 429, "", retry_after=30.0), Backoff(**NO_JITTER)).delay
             for _ in range(50)]
    assert all(30.0 <= d <= 45.0 for d in draws) and len(set(draws)) > 1  # never early, spread: no lock-step
    # a "Retry-After: 1" answered again and again still backs off: the hint is a floor, not the delay
    growing = Backoff(base=1.0, cap=60.0, jitter=0.0)
    waits = [retry_verdict(RetryAfterError("d", 503, "", retry_after=1.0), growing).delay for _ in range(8)]
    assert waits[0] < 2 and waits[-1] >= 60.0, waits
    assert retry_verdict(RetryAfterError("d", 429, "", retry_after=None), Backoff(**NO_JITTER)).delay == 0.01


async def test_entries_go_in_order_and_a_transient_failure_keeps_them_for_the_next_try(tmp_path):
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send, backoff=Backoff(**NO_JITTER))
    first, second = box.put("drift", {"n": 1}), box.put("drift", {"n": 2})
    cp.answers = [TransientError("drift", 503, "busy")]
    assert await box.deliver() == [] and box.size() == 2
    assert await box.deliver() == [first, second]
    assert cp.taken == [("drift", {"n": 1}), ("drift", {"n": 2})] and box.size() == 0


async def test_a_refused_entry_is_dropped_counted_and_does_not_block_the_next(tmp_path, caplog):
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send)
    box.put("drift", {"n": 1})
    second = box.put("drift", {"n": 2})
    cp.answers = [PermanentError("drift", 404, "no such node")]
    assert await box.deliver() == [second]
    assert box.status()["refused"] == 1 and "refused it for good" in caplog.text


async def test_a_report_the_control_plane_has_settled_already_is_dropped_quietly(tmp_path, caplog):
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send)
    box.put("actions", {"n": 1})
    cp.answers = [AlreadySettled("execution started callback", 409, "settled", "execution_already_terminal")]
    with caplog.at_level("INFO"):
        assert await box.deliver() == []
    assert box.size() == 0 and "has it settled already" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_what_was_queued_survives_a_restart_and_is_delivered_once(tmp_path):
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send)
    cp.answers = [TransientError("drift", 0, "down")]
    box.put("drift", {"n": 1})
    await box.deliver()
    box.close()
    again = UplinkOutbox(tmp_path / "uplink.db", cp.send)
    assert [e.body for e in again.pending()] == [{"n": 1}]
    await again.deliver()
    await again.deliver()
    assert cp.taken == [("drift", {"n": 1})]
    assert (tmp_path / "uplink.db").stat().st_mode & 0o777 == 0o600


def test_the_caps_drop_the_oldest_and_count_them(tmp_path, caplog):
    box = UplinkOutbox(tmp_path / "uplink.db", ControlPlane().send, max_entries=3)
    for n in range(5):
        box.put("drift", {"n": n})
    assert [e.body["n"] for e in box.pending()] == [2, 3, 4]
    assert box.status()["dropped_full"] == 2 and "uplink outbox full" in caplog.text
    small = UplinkOutbox(tmp_path / "small.db", ControlPlane().send, max_bytes=100)
    for n in range(10):
        small.put("drift", {"pad": "x" * 30, "n": n})
    assert sum(len(str(e.body)) for e in small.pending()) <= 200 and small.pending()[-1].body["n"] == 9


def test_an_unreadable_file_is_moved_aside_and_a_new_one_started(tmp_path, caplog):
    path = tmp_path / "uplink.db"
    path.write_bytes(b"this is not sqlite" * 100)
    box = UplinkOutbox(path, ControlPlane().send)
    box.put("drift", {"n": 1})
    assert box.size() == 1
    assert (tmp_path / "uplink.db.corrupt").exists() and "moved to" in caplog.text


async def test_the_service_delivers_what_is_put_and_retries_on_its_backoff(tmp_path):
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send, backoff=Backoff(**NO_JITTER))
    service = asyncio.create_task(box.run())
    try:
        cp.answers = [TransientError("drift", 502, "x"), TransientError("drift", 502, "x")]
        box.put("drift", {"n": 1})
        async with asyncio.timeout(5):
            while not cp.taken:
                await asyncio.sleep(0.005)
        assert cp.taken == [("drift", {"n": 1})] and box.size() == 0
    finally:
        service.cancel()
        await asyncio.gather(service, return_exceptions=True)


async def test_a_lane_the_control_plane_refuses_for_a_while_does_not_hold_up_another(tmp_path):
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send, backoff=Backoff(**NO_JITTER))
    taken: list[list[dict]] = []
    answers: list[Exception | None] = [TransientError("report", 503, "busy")]

    async def reports(entries):
        if answers and (answer := answers.pop(0)) is not None:
            raise answer
        taken.append([e.body for e in entries])

    box.add_lane("reports", reports, batch=2)
    box.put("report", {"key": "a"}, lane="reports", key="a")
    box.put("drift", {"n": 1})
    box.put("report", {"key": "b"}, lane="reports", key="b")
    box.put("report", {"key": "a", "again": True}, lane="reports", key="a")  # replaces a's entry, moves it last
    await box.deliver()
    assert cp.taken == [("drift", {"n": 1})] and box.size("reports") == 2 and box.size("drift") == 0
    assert "503" in box.status("reports")["last_error"] and box.status("drift")["last_error"] == ""
    await box.deliver("reports")
    assert taken == [[{"key": "b"}, {"key": "a", "again": True}]] and box.size() == 0


async def test_a_lane_waits_its_debounce_so_a_burst_goes_in_one_batch(tmp_path):
    box = UplinkOutbox(tmp_path / "uplink.db", ControlPlane().send)
    batches: list[int] = []

    async def reports(entries):
        batches.append(len(entries))

    box.add_lane("reports", reports, batch=100, debounce=0.2)
    service = asyncio.create_task(box.run())
    try:
        for key in "abcde":
            box.put("report", {"key": key}, lane="reports", key=key)
            await asyncio.sleep(0.01)
        async with asyncio.timeout(5):
            while not batches:
                await asyncio.sleep(0.01)
        assert batches == [5]
    finally:
        service.cancel()
        await asyncio.gather(service, return_exceptions=True)


def test_a_file_of_the_first_version_gets_lanes_and_keeps_its_entries(tmp_path):
    import sqlite3

    old = sqlite3.connect(tmp_path / "uplink.db")
    old.executescript("""
        CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, body TEXT NOT NULL,
                             size INTEGER NOT NULL, queued_at REAL NOT NULL, attempts INTEGER DEFAULT 0);
        INSERT INTO outbox (kind, body, size, queued_at) VALUES ('drift', '{"n":1}', 7, 1.0);
    """)
    old.close()
    box = UplinkOutbox(tmp_path / "uplink.db", ControlPlane().send)
    assert box.size("drift") == 1 and [e.body for e in box.pending("drift")] == [{"n": 1}]


async def test_a_lane_nobody_here_sends_stays_queued_for_the_daemon(tmp_path):
    """`plexd reconcile --once` opens the daemon's file to send drift reports only: the action results and report
    changes queued there are neither sent nor dropped."""
    taken: list[dict] = []

    async def post_drift(body):
        taken.append(body)

    box = UplinkOutbox(tmp_path / "uplink.db", by_kind({"drift": post_drift}))
    box.put("result", {"execution_id": "e1", "body": {}}, lane="actions")
    writer = box.writer(durable=False)  # telemetry: packed rows, queued from the daemon's threads
    with writer.transaction():
        writer.put_texts("telemetry_logs", "logs", [('[{"n":1},{"n":2}]', 2), ('[{"n":3}]', 1)])
    box.put("drift", {"n": 1})
    assert await box.deliver() != [] and taken == [{"n": 1}]
    assert box.size("actions") == 1 and box.status()["refused"] == 0
    assert box.status("telemetry_logs")["pending"] == 3
    assert box.retry_at("actions") > 0 and box.retry_at("telemetry_logs") > 0  # parked: the service won't spin


async def test_a_failed_re_registration_keeps_the_entries_for_a_retry(tmp_path):
    """`agent.authed` raises a PlexdError that is not a control-plane answer when it cannot register again: the
    node could not send, the control plane refused nothing."""
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send, backoff=Backoff(**NO_JITTER))
    cp.answers = [PlexdError("re-registration impossible: the bootstrap token was used")]
    box.put("drift", {"n": 1})
    assert await box.deliver() == [] and box.size() == 1 and box.status()["refused"] == 0
    assert await box.deliver() != [] and cp.taken == [("drift", {"n": 1})]


async def test_a_lane_whose_request_hangs_holds_up_no_other_in_the_service(tmp_path):
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send)
    hung = asyncio.Event()

    async def reports(entries):
        hung.set()
        await asyncio.sleep(3600)  # a request waiting for its timeout

    box.add_lane("reports", reports)
    box.put("report", {"key": "a"}, lane="reports", key="a")
    service = asyncio.create_task(box.run())
    try:
        async with asyncio.timeout(5):
            await hung.wait()
            box.put("drift", {"n": 1})
            while not cp.taken:
                await asyncio.sleep(0.01)
        assert cp.taken == [("drift", {"n": 1})] and box.size("reports") == 1
    finally:
        service.cancel()
        await asyncio.gather(service, return_exceptions=True)


def test_the_caps_hold_per_lane_and_text_that_is_not_unicode_is_still_queued(tmp_path):
    box = UplinkOutbox(tmp_path / "uplink.db", ControlPlane().send, max_entries=2)
    box.put("result", {"n": 0}, lane="actions")
    for n in range(5):
        box.put("drift", {"n": n})
    assert box.size("actions") == 1 and box.size("drift") == 2 and box.counter("dropped_full", "drift") == 3
    box.put("drift", {"name": "bad \udc80 byte"})  # a lone surrogate, as json.loads of outside input can give
    assert box.pending("drift")[-1].body == {"name": "bad \udc80 byte"}


async def test_a_file_that_cannot_be_written_while_delivering_makes_the_lane_wait_not_spin(tmp_path, caplog):
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send, backoff=Backoff(base=30.0, cap=60.0, jitter=0.0))
    box.put("drift", {"n": 1})
    box.db.execute("CREATE TRIGGER refuse BEFORE DELETE ON outbox BEGIN SELECT RAISE(FAIL, 'disk I/O error'); END")
    service = asyncio.create_task(box.run())
    try:
        async with asyncio.timeout(5):
            while "cannot be delivered now (disk I/O error)" not in caplog.text:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert len(cp.taken) == 1 and box.retry_at("drift") > 0  # sent once, then waiting on the backoff
    finally:
        service.cancel()
        await asyncio.gather(service, return_exceptions=True)


async def test_the_service_stops_when_cancelled_even_as_an_entry_wakes_it(tmp_path):
    """asyncio.wait_for on Python 3.11 returns instead of raising when the awaited event is set as the
    cancellation comes: the service went on waiting (an hour) and the daemon's stop hung."""
    cp = ControlPlane()
    for settle in range(6):  # the cancellation lands at a different step of the wake-up each time
        box = UplinkOutbox(tmp_path / f"u{settle}.db", cp.send)
        service = asyncio.create_task(box.run())
        await asyncio.sleep(0.01)
        box.put("drift", {"n": settle})
        for _ in range(settle):
            await asyncio.sleep(0)
        service.cancel()
        done, _ = await asyncio.wait({service}, timeout=2)
        assert service in done, f"the service did not stop (cancelled {settle} steps after the wake-up)"


async def test_a_lane_that_failed_through_an_outage_goes_as_soon_as_the_control_plane_is_back(tmp_path):
    """Found by `python -m bench chaos` (cp_500): after a 30 s outage, action acks waited out a backoff grown to
    most of a minute. The stream's reconnect (`control_plane_back`) ends that wait."""
    cp = ControlPlane()
    box = UplinkOutbox(tmp_path / "uplink.db", cp.send, backoff=Backoff(base=3600.0, cap=3600.0, jitter=0.0))
    service = asyncio.create_task(box.run())
    try:
        cp.answers = [TransientError("ack", 500, "outage")]
        box.put("ack", {"n": 1})
        async with asyncio.timeout(5):
            while box.status("ack")["last_error"] == "":
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        assert cp.taken == []  # an hour's backoff ahead
        box.control_plane_back(spread=0.05)
        async with asyncio.timeout(5):
            while not cp.taken:
                await asyncio.sleep(0.005)
        assert cp.taken == [("ack", {"n": 1})] and box.size() == 0
    finally:
        service.cancel()
        await asyncio.gather(service, return_exceptions=True)
