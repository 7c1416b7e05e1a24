"""Telemetry's lanes of the one uplink outbox (plexd.telemetry.queue) on a real SQLite file: order, byte caps that
drop the oldest of one stream only and count it, positions committed with their entries, batches of whole packed
rows sent as one array, appends from worker threads, a restart that loses nothing, and an older version's
telemetry.db taken over once."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3

import pytest

from plexd.base.gojson import EncodedJSON
from plexd.controlplane.uplink import UplinkOutbox
from plexd.telemetry.queue import TelemetryQueue, lane


def entries(start: int, count: int, pad: int = 0) -> list[dict]:
    return [{"n": i, "pad": "x" * pad} for i in range(start, start + count)]


class Control:
    """Stands in for the control plane: records each POSTed array."""

    def __init__(self) -> None:
        self.batches: list[list[dict]] = []

    async def send(self, batch) -> None:
        # a telemetry row is an array of entries; a plain lane's row, one object
        self.batches.append(json.loads(EncodedJSON.array([e.items if e.text[0] == "[" else e.text
                                                          for e in batch]).text))

    def numbers(self) -> list[int]:
        return [e["n"] for batch in self.batches for e in batch]


async def no_default_lane(kind, body):
    raise AssertionError(f"{kind} has no lane")


def open_queue(path, caps, control: Control, *, pack: int = 100, batch_size: int = 1000, adopt=(), **kw):
    box = UplinkOutbox(path, no_default_lane)
    queue = TelemetryQueue(box, caps, pack=pack, **kw)
    for stream in caps:
        queue.add_lane(stream, control.send, batch_size=batch_size, interval=0.05)
    queue.adopt(adopt)
    return box, queue


async def test_entries_come_out_in_order_per_stream_and_survive_a_restart(tmp_path):
    control = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"metrics": 1 << 20, "logs": 1 << 20}, control, pack=4,
                            batch_size=4)
    queue.append("metrics", entries(0, 10))
    queue.append("logs", entries(100, 3))
    queue.append("metrics", entries(10, 5))
    box.add_lane(lane("metrics"), control.send, batch=1)  # one row only, then "crash"
    entry = box.pending(lane("metrics"), 1)
    await control.send(entry)
    box._remove(lane("metrics"), entry)
    assert control.numbers() == [0, 1, 2, 3]
    queue.close()
    box.close()

    again = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"metrics": 1 << 20, "logs": 1 << 20}, again)
    assert queue.status("metrics")["pending"] == 11
    await box.deliver(lane("metrics"))
    await box.deliver(lane("logs"))
    assert again.numbers() == [*range(4, 15), 100, 101, 102]
    status = queue.status("metrics")
    assert (status["pending"], status["bytes"], status["dropped"], status["sent"]) == (0, 0, 0, 11)
    assert oct((tmp_path / "uplink.db").stat().st_mode & 0o777) == "0o600"


async def test_a_full_stream_drops_its_oldest_entries_counts_them_and_no_other_lane_loses_anything(tmp_path):
    drops = []
    control = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"logs": 2000, "audit": 1 << 20}, control,
                            on_drop=lambda *a: drops.append(a))
    box.put("drift_report", {"drift": 1}, lane="drift")
    queue.append("audit", entries(500, 2))
    for start in range(0, 100, 10):
        queue.append("logs", entries(start, 10, pad=30))
    await box.deliver(lane("logs"))
    left = control.numbers()
    assert left == list(range(100 - len(left), 100))  # the newest are kept, in order
    status = queue.status("logs")
    assert status["dropped"] == 100 - len(left) > 0 and status["dropped_bytes"] > 0
    assert sum(d[1] for d in drops) == status["dropped"] and {d[3] for d in drops} == {"full"}
    assert box.size("drift") == 1 and queue.status("audit")["pending"] == 2  # the cap is the logs lane's
    assert queue.unreported_drops() == {"logs": status["dropped"]}
    queue.drops_reported({"logs": status["dropped"]})
    queue.close()
    box.close()
    box, queue = open_queue(tmp_path / "uplink.db", {"logs": 2000, "audit": 1 << 20}, Control())
    assert queue.status("logs")["dropped"] == status["dropped"] and queue.unreported_drops() == {}


async def test_a_position_is_committed_with_the_entries_read_up_to_it(tmp_path):
    control = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"logs": 1 << 20}, control)
    assert queue.position("file:/x") is None
    queue.append("logs", entries(0, 2), position=("file:/x", {"ino": 5, "offset": 80}))
    assert queue.position("file:/x") == {"ino": 5, "offset": 80}
    # a write that fails moves neither: the entries are counted as lost, the position stays where it was
    box.db.execute("CREATE TRIGGER refuse BEFORE INSERT ON outbox BEGIN SELECT RAISE(FAIL, 'disk full'); END")
    assert queue.append("logs", entries(2, 2), position=("file:/x", {"ino": 5, "offset": 160})) is False
    assert queue.position("file:/x") == {"ino": 5, "offset": 80}
    assert queue.status("logs")["dropped"] == 2 and queue.unreported_drops() == {"logs": 2}
    box.db.execute("DROP TRIGGER refuse")
    assert queue.append("logs", entries(4, 1)) is True
    await box.deliver(lane("logs"))
    assert control.numbers() == [0, 1, 4]
    queue.close()
    box.close()
    box, queue = open_queue(tmp_path / "uplink.db", {"logs": 1 << 20}, control)
    assert queue.status("logs")["dropped"] == 2  # persisted once writes worked again


async def test_one_collection_is_stored_in_a_few_rows_and_sent_as_one_array_never_over_the_batch_size(tmp_path):
    control = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"metrics": 1 << 24}, control, batch_size=250)
    queue.append("metrics", entries(0, 1000))
    assert box.size(lane("metrics")) == 10  # rows
    assert queue.status("metrics")["pending"] == 1000
    await box.deliver(lane("metrics"))
    assert [len(b) for b in control.batches] == [200] * 5  # whole rows only: two of them a batch
    assert control.numbers() == list(range(1000))


async def test_a_batch_stays_under_its_byte_limit_unless_one_row_is_larger(tmp_path):
    control = Control()
    box = UplinkOutbox(tmp_path / "uplink.db", no_default_lane)
    box.add_lane("audit", control.send, batch=100, batch_bytes=1000)
    for n in range(5):
        box.put("audit", {"n": n, "pad": "x" * 400})
    box.put("audit", {"n": 5, "pad": "x" * 3000})
    await box.deliver("audit")
    assert [len(b) for b in control.batches] == [2, 2, 1, 1]


async def test_appends_from_worker_threads_are_delivered_by_the_outbox_service(tmp_path):
    control = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"metrics": 1 << 20, "logs": 1 << 20}, control)
    service = asyncio.create_task(box.run())
    try:
        await asyncio.gather(*(asyncio.to_thread(queue.append, "metrics", entries(i * 10, 10)) for i in range(8)),
                             asyncio.to_thread(queue.append, "logs", entries(900, 1), position=("journal", "c1")))
        async with asyncio.timeout(10):
            while len(control.numbers()) < 81:
                await asyncio.sleep(0.02)
    finally:
        service.cancel()
    assert sorted(control.numbers()) == [*range(80), 900] and queue.position("journal") == "c1"


def old_queue(path, *, packed: bool = True) -> None:
    old = sqlite3.connect(path)
    if not packed:  # the first version: one entry a row, no counts, no positions
        old.executescript("""
            CREATE TABLE entries (seq INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, size INTEGER NOT NULL,
                                  body TEXT NOT NULL);
            INSERT INTO entries (stream, size, body) VALUES ('logs', 7, '{"n":7}'), ('logs', 7, '{"n":8}');
        """)
    else:
        old.executescript("""
            CREATE TABLE entries (seq INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, size INTEGER NOT NULL,
                                  body TEXT NOT NULL, n INTEGER NOT NULL DEFAULT 1);
            CREATE TABLE streams (stream TEXT PRIMARY KEY, bytes INTEGER NOT NULL DEFAULT 0,
                                  count INTEGER NOT NULL DEFAULT 0, dropped INTEGER NOT NULL DEFAULT 0,
                                  dropped_bytes INTEGER NOT NULL DEFAULT 0, reported INTEGER NOT NULL DEFAULT 0);
            CREATE TABLE positions (source TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO entries (stream, size, body, n) VALUES ('logs', 15, '{"n":7},{"n":8}', 2),
                                                               ('metrics', 7, '{"n":1}', 1);
            INSERT INTO streams VALUES ('logs', 15, 2, 30, 900, 20), ('metrics', 7, 1, 0, 0, 0);
            INSERT INTO positions VALUES ('file:/var/log/x', '{"ino":5,"offset":80}');
        """)
    old.close()


async def test_an_older_versions_telemetry_db_is_taken_over_once_entries_counts_and_positions(tmp_path):
    old_queue(tmp_path / "telemetry.db")
    os.link(tmp_path / "telemetry.db", tmp_path / "same-file")
    control = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"metrics": 1 << 20, "logs": 1 << 20}, control,
                            adopt=[tmp_path / "telemetry.db"])
    assert not (tmp_path / "telemetry.db").exists()
    assert queue.position("file:/var/log/x") == {"ino": 5, "offset": 80}  # the next read resumes there
    assert queue.status("logs")["dropped"] == 30 and queue.unreported_drops() == {"logs": 10}
    queue.append("logs", entries(9, 1))
    await box.deliver(lane("logs"))
    await box.deliver(lane("metrics"))
    assert control.numbers() == [7, 8, 9, 1]
    # the very same file again (a crash between the takeover's commit and its removal): removed, not queued twice
    os.link(tmp_path / "same-file", tmp_path / "telemetry.db")
    queue._adopt(tmp_path / "telemetry.db")
    assert not (tmp_path / "telemetry.db").exists()
    assert queue.status("logs")["pending"] == queue.status("metrics")["pending"] == 0


async def test_a_telemetry_db_of_the_first_version_and_an_unreadable_one(tmp_path):
    old_queue(tmp_path / "telemetry.db", packed=False)
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "telemetry.db").write_bytes(b"this is not sqlite" * 100)
    control = Control()
    box, _ = open_queue(tmp_path / "uplink.db", {"logs": 1 << 20}, control,
                        adopt=[tmp_path / "telemetry.db", tmp_path / "q" / "telemetry.db"])
    await box.deliver(lane("logs"))
    assert control.numbers() == [7, 8]
    assert not (tmp_path / "telemetry.db").exists() and (tmp_path / "q" / "telemetry.db.unreadable").exists()


async def test_a_taken_over_backlog_keeps_to_telemetrys_caps_not_the_outboxs_defaults(tmp_path):
    old = sqlite3.connect(tmp_path / "telemetry.db")
    old.executescript("""
        CREATE TABLE entries (seq INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, size INTEGER NOT NULL,
                              body TEXT NOT NULL, n INTEGER NOT NULL DEFAULT 1);
    """)
    old.executemany("INSERT INTO entries (stream, size, body) VALUES ('logs', 9, ?)",
                    [(f'{{"n":{i}}}',) for i in range(12_000)])  # more rows than the outbox's default cap
    old.commit()
    old.close()
    control = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"logs": 64 << 20}, control, batch_size=5000,
                            adopt=[tmp_path / "telemetry.db"])
    assert queue.status("logs")["pending"] == 12_000 and queue.status("logs")["dropped"] == 0
    await box.deliver(lane("logs"))
    assert control.numbers() == list(range(12_000))


async def test_a_batch_the_control_plane_took_is_not_sent_again_when_its_delete_fails(tmp_path):
    control = Control()
    box, queue = open_queue(tmp_path / "uplink.db", {"logs": 1 << 20}, control)
    queue.append("logs", entries(0, 3))
    real_remove = box._remove
    failures = []

    def full_disk_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise sqlite3.OperationalError("database or disk is full")
        return real_remove(*args, **kwargs)

    box._remove = full_disk_once
    with pytest.raises(sqlite3.OperationalError):
        await box.deliver(lane("logs"))
    assert control.numbers() == [0, 1, 2] and box.size(lane("logs")) == 1  # taken, still on disk
    queue.append("logs", entries(3, 1))
    await box.deliver(lane("logs"))
    assert control.numbers() == [0, 1, 2, 3] and box.size(lane("logs")) == 0  # the leftover went, unsent


async def test_news_goes_out_with_nothing_queued(tmp_path):
    sent = []
    news = [True]

    async def send(batch):
        sent.append(list(batch))
        news[0] = False

    box = UplinkOutbox(tmp_path / "uplink.db", no_default_lane)
    box.add_lane("telemetry_logs", send, has_news=lambda: news[0])
    await box.deliver()
    assert sent == [[]] and not news[0]
    await box.deliver()
    assert sent == [[]]  # nothing more to say


def test_the_lane_totals_follow_every_change_and_are_recounted_at_open(tmp_path):
    box = UplinkOutbox(tmp_path / "uplink.db", no_default_lane, max_entries=3)
    for i in range(5):
        box.put("drift", {"i": i})  # two dropped by the cap
    box.put("report", {"v": 1}, lane="reports", key="a")
    box.put("report", {"v": 2}, lane="reports", key="a")  # replaces
    box._remove("drift", box.pending("drift", 1))
    assert (box.size("drift"), box.size("reports"), box.size()) == (2, 1, 3)
    rows = {lane: (n, size) for lane, n, size in box.db.execute(
        "SELECT lane, sum(n), sum(size) FROM outbox GROUP BY lane")}
    assert {lane: (box.status(lane)["pending"], box.status(lane)["bytes"]) for lane in rows} == rows
    box.db.execute("DELETE FROM outbox WHERE lane = 'reports'")  # behind its back
    box.close()
    again = UplinkOutbox(tmp_path / "uplink.db", no_default_lane)
    assert (again.size("drift"), again.size("reports")) == (2, 0)


async def test_a_configured_queue_dir_is_taken_over_and_said_to_be_unused(tmp_path, caplog):
    from dataclasses import replace

    from plexd.config.settings import TelemetryConfig
    from plexd.telemetry.service import Telemetry, telemetry_db_paths

    old_queue(tmp_path / "telemetry.db")
    cfg = replace(TelemetryConfig(), queue_dir=str(tmp_path))
    box = UplinkOutbox(tmp_path / "data" / "uplink.db", no_default_lane)

    async def nothing(*_):
        return None

    with caplog.at_level("WARNING", logger="plexd.telemetry.service"):
        telemetry = Telemetry(cfg, box, "host", nothing, read_counters=nothing, desired_peers=dict,
                              older_queues=telemetry_db_paths(cfg, str(tmp_path / "data")))
    assert [r.getMessage() for r in caplog.records] == [
        f"telemetry.queue_dir ({tmp_path}) is no longer used: telemetry waits in the uplink outbox, "
        f"{tmp_path / 'data' / 'uplink.db'}; a telemetry.db found there is taken over"]
    assert not (tmp_path / "telemetry.db").exists() and telemetry.status()["logs"]["pending"] == 2
