"""The telemetry spool (plexd.telemetry.queue) on a real SQLite file: order, byte caps that drop the oldest and
count it, positions committed with their entries, and a restart that loses nothing."""

from __future__ import annotations

import json
import sqlite3

from plexd.base.gojson import EncodedJSON
from plexd.telemetry.queue import TelemetryQueue


def entries(start: int, count: int, pad: int = 0) -> list[dict]:
    return [{"n": i, "pad": "x" * pad} for i in range(start, start + count)]


def drain(queue: TelemetryQueue, stream: str, limit: int = 7) -> list[int]:
    seen = []
    while (batch := queue.batch(stream, limit)) is not None:
        seen += [e["n"] for e in batch.entries]
        queue.delivered(batch)
    return seen


def test_entries_come_out_in_order_per_stream_and_survive_a_reopen(tmp_path):
    queue = TelemetryQueue(tmp_path / "t.db", {"metrics": 1 << 20, "logs": 1 << 20}, pack=4)
    queue.append("metrics", entries(0, 10))
    queue.append("logs", entries(100, 3))
    queue.append("metrics", entries(10, 5))
    batch = queue.batch("metrics", 4)
    assert [e["n"] for e in batch.entries] == [0, 1, 2, 3]
    queue.delivered(batch)
    queue.close()

    again = TelemetryQueue(tmp_path / "t.db", {"metrics": 1 << 20, "logs": 1 << 20})
    assert again.status("metrics")["pending"] == 11
    assert drain(again, "metrics") == list(range(4, 15))
    assert drain(again, "logs") == [100, 101, 102]
    assert again.status("metrics") | {"cap_bytes": 0} == {"pending": 0, "bytes": 0, "dropped": 0,
                                                          "dropped_bytes": 0, "cap_bytes": 0}
    assert oct((tmp_path / "t.db").stat().st_mode & 0o777) == "0o600"


def test_a_full_stream_drops_its_oldest_entries_and_counts_them(tmp_path):
    drops = []
    queue = TelemetryQueue(tmp_path / "t.db", {"logs": 2000}, on_drop=lambda *a: drops.append(a))
    for start in range(0, 100, 10):
        queue.append("logs", entries(start, 10, pad=30))
    left = drain(queue, "logs", 1000)
    assert left == list(range(100 - len(left), 100))  # the newest are kept, in order
    status = queue.status("logs")
    assert status["dropped"] == 100 - len(left) > 0
    assert sum(d[1] for d in drops) == status["dropped"] and {d[3] for d in drops} == {"full"}
    queue.close()
    assert TelemetryQueue(tmp_path / "t.db", {"logs": 2000}).status("logs")["dropped"] == status["dropped"]


def test_a_position_is_committed_with_the_entries_read_up_to_it(tmp_path):
    queue = TelemetryQueue(tmp_path / "t.db", {"logs": 1 << 20})
    assert queue.position("file:/x") is None
    queue.append("logs", entries(0, 2), position=("file:/x", {"ino": 5, "offset": 80}))
    assert queue.position("file:/x") == {"ino": 5, "offset": 80}
    # a write that fails moves neither: the entries are counted as lost, the position stays where it was
    queue._db.execute("CREATE TRIGGER refuse BEFORE INSERT ON entries BEGIN SELECT RAISE(FAIL, 'disk full'); END")
    assert queue.append("logs", entries(2, 2), position=("file:/x", {"ino": 5, "offset": 160})) is False
    assert queue.position("file:/x") == {"ino": 5, "offset": 80}
    assert queue.status("logs")["dropped"] == 2
    queue._db.execute("DROP TRIGGER refuse")
    assert queue.append("logs", entries(4, 1)) is True
    assert drain(queue, "logs") == [0, 1, 4]
    assert queue.status("logs")["dropped"] == 2  # persisted once writes work again


def test_a_batch_stays_under_the_byte_limit_unless_one_entry_is_larger(tmp_path):
    queue = TelemetryQueue(tmp_path / "t.db", {"audit": 1 << 24})
    for n in range(5):  # five appends: five rows
        queue.append("audit", entries(n, 1, pad=400))
    assert len(queue.batch("audit", 100, max_bytes=1000).entries) == 2
    assert len(queue.batch("audit", 100, max_bytes=10).entries) == 1


def test_one_collection_is_stored_in_a_few_rows_and_sent_as_one_array_never_over_the_batch_size(tmp_path):
    queue = TelemetryQueue(tmp_path / "t.db", {"metrics": 1 << 24}, pack=100)
    queue.append("metrics", entries(0, 1000))
    assert queue._db.execute("SELECT count(*) FROM entries").fetchone()[0] == 10
    assert queue.status("metrics")["pending"] == 1000
    batch = queue.batch("metrics", 250)  # whole rows only: two of them
    assert batch.count == 200 and [e["n"] for e in batch.entries] == list(range(200))
    assert json.loads(EncodedJSON.array(batch.texts).text) == batch.entries  # what the shipper sends
    queue.delivered(batch)
    assert queue.status("metrics")["pending"] == 800 and drain(queue, "metrics", 1000) == list(range(200, 1000))


def test_a_file_of_an_older_version_one_entry_a_row_is_read_and_extended(tmp_path):
    old = sqlite3.connect(tmp_path / "t.db")
    old.executescript("""
        CREATE TABLE entries (seq INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, size INTEGER NOT NULL,
                              body TEXT NOT NULL);
        INSERT INTO entries (stream, size, body) VALUES ('logs', 8, '{"n":7}');
    """)
    old.close()
    queue = TelemetryQueue(tmp_path / "t.db", {"logs": 1 << 20})
    queue.append("logs", entries(8, 2))
    assert drain(queue, "logs") == [7, 8, 9]


def test_a_damaged_queue_file_is_moved_aside_and_a_fresh_one_started(tmp_path):
    (tmp_path / "t.db").write_bytes(b"this is not sqlite" * 100)
    queue = TelemetryQueue(tmp_path / "t.db", {"logs": 1 << 20})
    queue.append("logs", entries(0, 1))
    assert (tmp_path / "t.db.corrupt").exists()
    assert drain(queue, "logs") == [0]
    assert (tmp_path / "t.db").read_bytes()[:16] == b"SQLite format 3\x00"  # a new database in its place
