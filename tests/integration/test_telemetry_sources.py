"""Telemetry's sources against the real thing: a real systemd-journald (in a private mount namespace, writing to
a directory of this test) read through the real journalctl with its cursor kept across a restart, real ICMP over
loopback, and a queue directory on a real tmpfs that fills up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plexd.controlplane.uplink import UplinkOutbox
from plexd.telemetry.logs import JournalLogs
from plexd.telemetry.queue import TelemetryQueue, lane
from plexd.telemetry.tail import MAX_LINE, TRUNCATED

pytestmark = pytest.mark.root
JOURNALD = "/lib/systemd/systemd-journald"

# journald in its own mount namespace: private /run/systemd (its sockets) and /run/log/journal bound to $1
_JOURNALD_NS = """
set -e
mount -t tmpfs tmpfs /run/systemd
mkdir -p /run/systemd/journal
mount -t tmpfs tmpfs /run/log
mkdir -p /run/log/journal
mount --bind "$1" /run/log/journal
exec {journald}
"""


@contextlib.contextmanager
def private_journald(directory: Path):
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                             _JOURNALD_NS.format(journald=JOURNALD), "sh", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not list(directory.glob("*/system.journal")):
            assert proc.poll() is None and time.monotonic() < deadline, "journald did not start"
            time.sleep(0.05)

        def write(text: bytes, priority: str = "info") -> None:
            # systemd-cat in journald's mount namespace: the entry goes through journald's stdout socket
            subprocess.run(["nsenter", "-t", str(proc.pid), "-m", "systemd-cat", "-t", "pxtest", "-p", priority],
                           input=text, check=True)

        yield write, next(directory.glob("*/system.journal")).parent
    finally:
        proc.terminate()
        proc.wait(10)


async def collect_until(source: JournalLogs, count: int, timeout: float = 10.0) -> list[dict]:
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        for entries, _ in source.collect():
            got += [e for e in entries if e["unit"] == "pxtest"]
    return got


async def until_following(source: JournalLogs, write, timeout: float = 10.0) -> None:
    """journalctl started at the end of the journal sees only what is written after it opened it: write numbered
    markers until one comes through, then collect until the last one written has (none is left to arrive)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        if not seen:
            n += 1
            write(f"marker {n}\n".encode())
        await asyncio.sleep(0.1)
        seen |= {e["message"] for entries, _ in source.collect() for e in entries if e["unit"] == "pxtest"}
        if f"marker {n}" in seen:
            return
    raise AssertionError(f"journalctl never followed: markers seen {sorted(seen)} of {n}")


@pytest.mark.skipif(not shutil.which("journalctl") or not Path(JOURNALD).exists(), reason="no systemd-journald")
async def test_the_journal_is_followed_with_a_cursor_that_survives_a_restart(tmp_path):
    with private_journald(tmp_path) as (write, journal_dir):
        first = JournalLogs(None, "h", priority="info", directory=str(journal_dir))
        task = asyncio.create_task(first.run())
        await until_following(first, write)
        write(b"started \xff\xfe here\n", "err")
        write(b"x" * 40000 + b"\n")
        write(b"too chatty\n", "debug")  # above the priority filter
        got = await collect_until(first, 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert [(e["severity"], e["message"][:12]) for e in got] == [("err", "started \ufffd\ufffd h"),
                                                                   ("info", "xxxxxxxxxxxx")]
        assert got[1]["message"] == "x" * MAX_LINE + TRUNCATED and got[0]["source"] == "journald"
        cursor = first.cursor

        write(b"while plexd was down\n")
        second = JournalLogs(cursor, "h", priority="info", directory=str(journal_dir))
        task = asyncio.create_task(second.run())
        write(b"after the restart\n")
        got = await collect_until(second, 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert [e["message"] for e in got] == ["while plexd was down", "after the restart"]  # no repeat, no gap


_PROBE = """
import asyncio, json, subprocess, sys
from plexd.telemetry.ping import round_trips
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "route", "add", "blackhole", "10.99.0.0/16"], check=True)
targets = {"loopback": "127.0.0.1", "unrouted": "198.51.100.7", "blackholed": "10.99.0.1", "v6": "fd00::1"}
print(json.dumps(asyncio.run(round_trips(targets, 0.5))))
"""


def test_latency_is_measured_with_real_icmp_and_minus_one_without_an_answer():
    # in a network namespace of its own: loopback answers, nothing else can
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True).stdout
    rtts = json.loads(out)
    assert 0 < rtts["loopback"] < 500_000_000
    assert rtts["unrouted"] == rtts["blackholed"] == rtts["v6"] == -1


_MANY = """
import asyncio, json, subprocess
from plexd.telemetry.ping import round_trips
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
targets = {f"n_{i}": f"127.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255 or 1}" for i in range(70_000)}
rtts = asyncio.run(round_trips(targets, 1.0))
print(json.dumps([len(rtts), sum(1 for v in rtts.values() if v > 0)]))
"""


def test_more_targets_than_icmp_sequence_numbers_are_probed_up_to_the_limit_not_a_crash():
    # The 65,537th probe raised struct.error (a 16-bit sequence number), and every metrics collection failed.
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", _MANY], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    count, answered = json.loads(out)
    assert count == 70_000 and 0 < answered <= 65_535


_FILTERED = """
import socket, struct, time
from plexd.telemetry.ping import ICMP_FILTER, SOL_RAW, _open
sock, raw = _open()
assert raw
lo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(20):  # nothing listens there: each datagram comes back as an ICMP port unreachable
    lo.sendto(b"x", ("127.0.0.1", 9))
time.sleep(0.2)
got = []
while True:
    try:
        got.append(sock.recv(2048))
    except BlockingIOError:
        break
print(len(got), struct.unpack("I", sock.getsockopt(SOL_RAW, ICMP_FILTER, 4))[0])
"""


def test_the_raw_probe_socket_is_not_handed_the_hosts_other_icmp():
    # port unreachables (what a WireGuard handshake to a gone peer brings back) never reach the probe's socket
    script = "import subprocess; subprocess.run(['ip', 'link', 'set', 'lo', 'up'], check=True)\n" + _FILTERED
    received, mask = subprocess.run(["unshare", "-n", sys.executable, "-c", script], capture_output=True,
                                    text=True, check=True).stdout.split()
    assert int(received) == 0
    assert int(mask) == 0xFFFFFFFE  # every type but echo reply (0) filtered


async def no_sender(kind, body):
    raise AssertionError("nothing is delivered here")


def test_a_full_disk_under_the_queue_costs_only_what_could_not_be_written(tmp_path, caplog):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], check=True)
    try:
        box = UplinkOutbox(mount / "uplink.db", no_sender)
        queue = TelemetryQueue(box, {"logs": 1 << 30})
        entry = {"message": "m" * 2000}
        assert queue.append("logs", [entry | {"n": 0}]) is True
        filler = mount / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        with caplog.at_level(logging.WARNING, logger="plexd.telemetry.queue"):
            results = [queue.append("logs", [entry | {"n": i}] * 4) for i in range(1, 11)]
        assert results == [False] * 10
        assert queue.status("logs")["dropped"] == 40
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "cannot be written" in said[0] and "full" in said[0], said

        filler.unlink()  # room again
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="plexd.telemetry.queue"):
            assert queue.append("logs", [entry | {"n": 99}]) is True
        assert [r.getMessage() for r in caplog.records] == [
            f"telemetry queue {mount / 'uplink.db'} writable again; 40 logs entries were lost while it was not"]
        stored = [json.loads(e.text) for e in box.pending(lane("logs"))]  # a row is an array of entries
        assert [e["n"] for row in stored for e in row] == [0, 99] and queue.status("logs")["dropped"] == 40
        queue.close()
        box.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
