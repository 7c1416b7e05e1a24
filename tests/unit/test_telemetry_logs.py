"""Journal entries as §1.14 log entries (plexd.telemetry.logs), the system sampler on this machine's /proc, and
a stream's lane of the uplink outbox delivered through failures (plexd.telemetry.queue)."""

from __future__ import annotations

import asyncio
import json

import pytest

from plexd.base.gojson import EncodedJSON
from plexd.controlplane.client_errors import PermanentError, TransientError
from plexd.controlplane.uplink import UplinkOutbox
from plexd.telemetry.logs import JournalLogs, journal_entry, severity
from plexd.telemetry.queue import TelemetryQueue, lane
from plexd.telemetry.system import SystemSampler
from plexd.telemetry.tail import MAX_LINE, TRUNCATED


def test_priorities_map_to_syslog_names_and_anything_else_is_info():
    assert [severity(p) for p in range(8)] == ["emerg", "alert", "crit", "err", "warning", "notice", "info",
                                               "debug"]
    assert {severity(x) for x in ("8", "-1", None, "high", 3.5)} == {"info", "err"}


def test_a_journal_record_becomes_a_log_entry():
    doc = {"__REALTIME_TIMESTAMP": "1700000000123456", "_SYSTEMD_UNIT": "sshd.service", "PRIORITY": "3",
           "MESSAGE": "Failed password for root", "_HOSTNAME": "web-01", "__CURSOR": "s=1"}
    assert journal_entry(doc, "fallback") == {
        "timestamp": "2023-11-14T22:13:20.123456Z", "source": "journald", "unit": "sshd",
        "message": "Failed password for root", "severity": "err", "hostname": "web-01"}


def test_a_binary_or_huge_journal_message_is_decoded_and_capped():
    binary = journal_entry({"MESSAGE": [104, 105, 255], "SYSLOG_IDENTIFIER": "app"}, "h")
    assert binary["message"] == "hi\ufffd" and binary["unit"] == "app" and binary["hostname"] == "h"
    huge = journal_entry({"MESSAGE": "x" * (1 << 20), "PRIORITY": 9}, "h")
    assert huge["message"] == "x" * MAX_LINE + TRUNCATED and huge["severity"] == "info"


def test_journalctl_resumes_after_the_stored_cursor_or_starts_at_the_end():
    fresh = JournalLogs(None, "h", units=("sshd",), priority="warning").command()
    assert "--lines=0" in fresh and "--unit=sshd" in fresh and "--priority=warning" in fresh
    assert "--after-cursor=s=abc" in JournalLogs("s=abc", "h").command()


def test_the_system_sample_reads_this_machine():
    sampler = SystemSampler()
    first = sampler.sample()
    assert first["cpu_usage_percent"] == 0.0  # no interval yet
    sum(i * i for i in range(200_000))
    second = sampler.sample()
    assert 0.0 <= second["cpu_usage_percent"] <= 100.0
    assert 0 < second["memory_used_bytes"] < second["memory_total_bytes"]
    assert 0 < second["disk_used_bytes"] < second["disk_total_bytes"]
    assert second["network_rx_bytes"] >= 0 and second["network_tx_bytes"] >= 0


@pytest.mark.asyncio
async def test_a_stream_is_sent_in_order_transient_failures_retried_and_refused_batches_dropped(tmp_path):
    received, answers = [], [TransientError("logs batch", 503, "busy"), None,
                              PermanentError("logs batch", 404, "gone"), None, None]

    async def send(entries):  # the JSON array as the queue stored its entries: sent without decoding them
        answer = answers.pop(0) if answers else None
        if answer is not None:
            raise answer
        received.append([e["n"] for e in json.loads(EncodedJSON.array([e.items for e in entries]).text)])

    box = UplinkOutbox(tmp_path / "uplink.db", send)
    queue = TelemetryQueue(box, {"logs": 1 << 20}, pack=3)  # as the service sizes it: ≤ a batch
    queue.add_lane("logs", send, batch_size=3, interval=0.05)
    queue.append("logs", [{"n": i} for i in range(10)])
    await box.deliver(lane("logs"))
    assert received == [] and queue.status("logs")["pending"] == 10  # the 503: kept, retried later
    await asyncio.sleep(0.07)
    await box.deliver(lane("logs"))
    assert received == [[0, 1, 2], [6, 7, 8], [9]]  # [3, 4, 5] was refused for good and dropped
    status = queue.status("logs")
    assert (status["refused"], status["sent"], status["pending"]) == (3, 7, 0)
