"""Filling the node with reports: 10,000 PUTs against the report store's caps over the real socket. The store
stops at its caps with a clear 507 (full) or 413 (too large), keeps what it has on disk, and the daemon's socket
goes on answering."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess

import pytest
from node_api_helpers import node_api_fixture  # noqa: F401 - provides the node_api fixture

from plexd.nodeapi import reports as reports_mod
from plexd.nodeapi.reports import ReportStore

pytestmark = pytest.mark.root  # the socket's group is a real group (groupadd)


def put_many(sock_path: str, count: int, payload: str = "v") -> list[tuple[int, dict]]:
    """`count` PUTs on one keep-alive connection (what a runaway workload does); the answers in order."""
    conn = http.client.HTTPConnection("localhost", timeout=30)
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    conn.sock = s
    answers = []
    try:
        for i in range(count):
            body = json.dumps({"content_type": "text/plain", "payload": payload}).encode()
            conn.request("PUT", f"/v1/state/report/r{i}", body=body)
            resp = conn.getresponse()
            answers.append((resp.status, json.loads(resp.read())))
    finally:
        conn.close()
    return answers


async def test_ten_thousand_reports_stop_at_the_count_cap_with_a_clear_507(node_api):
    served = await node_api()  # the default caps, as `plexd up` has them without configuration
    assert served.reports.max_entries == reports_mod.MAX_ENTRIES == 1000

    answers = await asyncio.to_thread(put_many, served.api.socket_path, 10_000)
    assert [s for s, _ in answers[:1000]] == [200] * 1000
    refused = answers[1000:]
    assert {s for s, _ in refused} == {507}, {s for s, _ in refused}
    assert refused[0][1] == {"error": "report store full: 1000 entries, at most 1000 "
                                      "(node_api.report_max_entries); delete entries that are no longer needed"}

    # the store kept exactly its 1000 on disk, the socket still answers, and an update of a kept key still works
    files = os.listdir(os.path.join(served.base, "data/state/report"))
    assert len(files) == 1000 and len(served.reports) == 1000
    status, doc = await asyncio.to_thread(served.call, "GET", "/v1/state")
    assert status == 200 and len(doc["report_keys"]) == 1000
    body = json.dumps({"content_type": "text/plain", "payload": "updated"}).encode()
    assert (await asyncio.to_thread(served.call, "PUT", "/v1/state/report/r7", body))[0] == 200
    # a delete makes room for exactly one more
    assert (await asyncio.to_thread(served.call, "DELETE", "/v1/state/report/r0"))[0] == 204
    assert (await asyncio.to_thread(served.call, "PUT", "/v1/state/report/new", body))[0] == 200
    assert (await asyncio.to_thread(served.call, "PUT", "/v1/state/report/one-more", body))[0] == 507

    # what was acknowledged survives a restart
    again = ReportStore(os.path.join(served.base, "data"))
    assert again.load() == 1000 and again.get("r7").payload == "updated" and again.get("r0") is None


async def test_reports_stop_at_the_byte_cap_and_an_oversize_entry_is_413(node_api):
    served = await node_api(reports={"max_bytes": 64 << 10, "max_entry_bytes": 8 << 10})
    big = "x" * (16 << 10)
    body = json.dumps({"content_type": "text/plain", "payload": big}).encode()
    status, doc = await asyncio.to_thread(served.call, "PUT", "/v1/state/report/big", body)
    assert status == 413 and doc["error"].startswith("report entry too large: ")
    assert doc["error"].endswith("bytes stored, at most 8192 (node_api.report_max_entry_bytes)")
    assert served.reports.get("big") is None

    answers = await asyncio.to_thread(put_many, served.api.socket_path, 20, "y" * (6 << 10))
    statuses = [s for s, _ in answers]
    kept = statuses.count(200)
    assert statuses == [200] * kept + [507] * (20 - kept) and 8 <= kept <= 10, statuses
    assert "(node_api.report_max_bytes)" in answers[-1][1]["error"]
    assert served.reports.total_bytes <= 64 << 10
    assert (await asyncio.to_thread(served.call, "GET", "/v1/state/metadata"))[0] == 200


async def test_lowered_caps_keep_what_is_on_disk_and_refuse_new_entries(tmp_path):
    store = ReportStore(tmp_path)
    for i in range(5):
        await store.put(f"k{i}", "text/plain", i, None)
    smaller = ReportStore(tmp_path, max_entries=3)
    assert smaller.load() == 5  # nothing thrown away
    with pytest.raises(reports_mod.StoreFull, match="5 entries, at most 3"):
        await smaller.put("k9", "text/plain", 9, None)
    assert (await smaller.put("k1", "text/plain", "updated", None)).version == 2  # updates of kept keys go on


async def test_a_full_data_dir_is_a_clear_507_and_the_entry_keeps_its_version(node_api):
    """Found by `python -m bench chaos` (disk_full, read_only): a report PUT the disk could not hold answered 500
    "internal error". Now 507 with the reason, the entry keeps its last version, and a write goes through once
    there is room. The data_dir is a real 1 MiB tmpfs, filled."""
    served = await node_api()
    data = os.path.join(served.base, "data")
    os.makedirs(data, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", data], check=True)
    try:
        body = json.dumps({"content_type": "text/plain", "payload": "first"}).encode()
        assert (await asyncio.to_thread(served.call, "PUT", "/v1/state/report/app", body))[0] == 200
        subprocess.run(["dd", "if=/dev/zero", f"of={data}/filler", "bs=64k"], capture_output=True)
        body = json.dumps({"content_type": "text/plain", "payload": "second"}).encode()
        status, doc = await asyncio.to_thread(served.call, "PUT", "/v1/state/report/app", body)
        assert status == 507 and "not stored: No space left on device" in doc["error"], doc
        assert doc["error"].endswith("the entry keeps version 1")
        assert served.reports.get("app").payload == "first" and served.reports.get("app").version == 1
        os.remove(f"{data}/filler")
        status, doc = await asyncio.to_thread(served.call, "PUT", "/v1/state/report/app", body)
        assert status == 200 and doc["version"] == 2
    finally:
        subprocess.run(["umount", "-l", data], check=False)
