"""Telemetry of a real `plexd up` (real wireguard-go in lab namespaces) reaching the real devplane: metrics, a
real log file and auditd-format records arrive in the §1.14 shapes; hostile lines are handled without touching the
tunnel; and a devplane outage longer than the Go agent's buffers, with a daemon restart in the middle, loses
nothing but what a configured cap dropped — and that drop is reported with its count."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from lab_daemon import Daemon, ping_count, pinging_pair, wait_until

from plexd.base import gojson

pytestmark = pytest.mark.root

SHADOW = [
    'type=SYSCALL msg=audit(1700000000.123:4242): arch=c000003e syscall=257 success=no exit=-13 items=1 '
    'ppid=700 pid=812 auid=1000 uid=1000 gid=1001 comm="cat" exe="/usr/bin/cat" key="shadow"',
    'type=PATH msg=audit(1700000000.123:4242): item=0 name="/etc/shadow" nametype=NORMAL',
    "type=EOE msg=audit(1700000000.123:4242): ",
]
LOGIN = ("type=USER_LOGIN msg=audit(1700000001.5:4243): pid=900 uid=0 auid=4294967295 "
         "msg='op=login acct=\"root\" exe=\"/usr/sbin/sshd\" addr=203.0.113.9 res=failed'")


def append(path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_metrics_logs_and_audit_reach_the_devplane_in_the_protocol_shapes(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    app_log, audit_log = tmp_path / "app.log", tmp_path / "audit.log"
    app_log.write_bytes(b"history that is not sent\n")
    audit_log.write_bytes(b"")
    a, b = pinging_pair(lab, dp, daemons, tmp_path, a_config=(
        "telemetry:\n"
        "  metrics: {collect_interval: 1s, report_interval: 1s}\n"
        f"  logs: {{source: files, files: [{app_log}], collect_interval: 200ms, report_interval: 500ms}}\n"
        f"  audit: {{file: {audit_log}, collect_interval: 200ms, report_interval: 500ms}}\n"))
    a_id, b_id = a.node_id(), b.node_id()

    # metrics: system, and the peer's tunnel and latency measured over the mesh
    def point(group: str) -> dict | None:
        found = [p for p in (dp.admin.metrics(a_id)) if p["group"] == group
                 and (group == "system" or (p["peer_id"] == b_id and p["data"].get("rtt_nano", 1) > 0))]
        return found[-1] if found else None

    wait_until(lambda: point("system") and point("tunnel") and point("latency"), 20, "the three groups", daemons)
    system = point("system")["data"]
    assert set(system) == {"cpu_usage_percent", "memory_used_bytes", "memory_total_bytes", "disk_used_bytes",
                           "disk_total_bytes", "network_rx_bytes", "network_tx_bytes"}
    assert 0 < system["memory_used_bytes"] < system["memory_total_bytes"] and system["network_rx_bytes"] > 0
    tunnel = point("tunnel")["data"]
    assert tunnel["peer_id"] == b_id and tunnel["handshake_succeeded"] and not tunnel["handshake_stale"]
    assert tunnel["rx_bytes"] > 0 and tunnel["tx_bytes"] > 0 and tunnel["last_handshake_time"].endswith("Z")
    assert 0 < point("latency")["data"]["rtt_nano"] < 1_000_000_000

    # logs: new lines only, one not UTF-8, one of 1 MiB; then the file is rotated
    append(app_log, b"hello\ncaf\xff\n" + b"A" * (1 << 20) + b"\n")
    wait_until(lambda: len(dp.admin.logs(a_id)) >= 3, 20, "the first log lines", daemons)
    os.rename(app_log, tmp_path / "app.log.1")
    append(tmp_path / "app.log.1", b"late line in the old file\n")
    append(app_log, b"after rotation\n")
    wait_until(lambda: len(dp.admin.logs(a_id)) >= 5, 20, "the lines around the rotation", daemons)
    logs = (dp.admin.logs(a_id))
    assert [e["message"] for e in logs] == ["hello", "caf\ufffd", "A" * 16384 + "[truncated]",
                                            "late line in the old file", "after rotation"]
    assert {(e["source"], e["unit"], e["severity"], e["hostname"]) for e in logs} == {
        ("file", "app.log", "info", a.node.name)}

    # audit: a multi-record event joined by serial, a truncated record skipped, a local action included
    append(audit_log, ("\n".join([*SHADOW, "type=SYSCALL msg=audit(1700000001.2", LOGIN]) + "\n").encode())
    a.cli("actions", "run", "system.info", "--local", "--json")
    # the local action's "started" and "finished" may ship in two batches: wait for both
    wait_until(lambda: {e["source"] for e in (dp.admin.audit(a_id))} == {"auditd", "plexd-actions"}
               and len([e for e in (dp.admin.audit(a_id)) if e["source"] == "auditd"]) == 2
               and {e["action"] for e in dp.admin.audit(a_id) if e["source"] == "plexd-actions"}
               >= {"started", "finished"}, 20, "the audit events", daemons)
    audit = (dp.admin.audit(a_id))
    shadow, login = [e for e in audit if e["source"] == "auditd"]
    assert (shadow["event_type"], shadow["action"], shadow["object"], shadow["result"]) == (
        "SYSCALL", "openat", '"/etc/shadow"', "failure")
    assert shadow["subject"] == {"uid": 1000, "gid": 1001, "pid": 812} and shadow["raw"].count("\n") == 1
    assert (login["event_type"], login["result"]) == ("USER_LOGIN", "failure")
    local = [e for e in audit if e["source"] == "plexd-actions"]
    assert {e["action"] for e in local} >= {"started", "finished"} and local[0]["object"] == '"system.info"'
    assert "1 malformed record(s) skipped" in a.logged()

    # none of it touched the mesh or restarted a service
    assert ping_count(lab, a.node, b.mesh_ip(), 3, 0.2) == 3
    services = {s["name"]: s for s in a.status()["services"]}
    assert all(services[name]["restarts"] == 0 and services[name]["state"] == "running" for name in
               ("telemetry_metrics", "telemetry_logs", "telemetry_audit")), services
    assert a.status()["telemetry"]["logs"]["sent"] == 5


def writer(path, prefix: str, stop: threading.Event, every: float = 0.02) -> list[int]:
    """Appends numbered lines to `path` until `stop`; returns the numbers written."""
    written: list[int] = []

    def run() -> None:
        n = 0
        while not stop.is_set():
            append(path, f"{prefix}-{n:06d}\n".encode())
            written.append(n)
            n += 1
            time.sleep(every)

    threading.Thread(target=run, daemon=True).start()
    return written


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_an_outage_with_a_restart_loses_nothing_but_what_a_cap_dropped_and_says_how_much(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    fast = "collect_interval: 200ms, report_interval: 500ms"

    def start(node, name: str, logs_cap: str) -> Daemon:
        log_file = tmp_path / f"{name}.log"
        log_file.write_bytes(b"")
        d = Daemon(lab, node, dp, tmp_path, "1h", extra_config=(
            "shutdown: {deregister: false}\npolicy: {enabled: false}\n"
            f"telemetry:\n  metrics: {{{fast}}}\n  audit: {{file: ''}}\n"
            f"  logs: {{source: files, files: [{log_file}], {fast}{logs_cap}}}\n"))
        daemons.append(d)
        return d

    keeper = start(lab.nodes[0], "keeper", "")
    capped = start(lab.nodes[1], "capped", ", queue_max_bytes: 4096")
    wait_until(lambda: keeper.node_id() and capped.node_id() and keeper.api_listening()
               and keeper.status()["telemetry"]["logs"]["sent"] == 0
               and (dp.admin.metrics(keeper.node_id())), 30, "both nodes reporting", daemons)
    ids = {d: d.node_id() for d in (keeper, capped)}
    metrics_before = len(dp.admin.metrics(ids[keeper]))

    stop = threading.Event()
    outage_began = time.time()
    dp.stop()
    # The lines are written from here on, all of them during the outage: written before the devplane was gone, the
    # first ones could be delivered at once, and the capped node's received lines would not be one run.
    kept = writer(tmp_path / "keeper.log", "keep", stop)
    capped_lines = writer(tmp_path / "capped.log", "cap", stop)
    time.sleep(20)  # the outage itself (what is measured, not a wait for something)
    restarted_at = time.time()
    keeper.restart()  # in the middle of the outage: the queue and the file position are on disk
    capped.restart()
    time.sleep(20)
    stop.set()
    time.sleep(0.5)
    outage_ended = time.time()
    dp.start()

    def messages(d: Daemon, prefix: str) -> list[str]:
        return [e["message"] for e in dp.admin.logs(ids[d]) if e["message"].startswith(prefix)]

    wait_until(lambda: len(messages(keeper, "keep-")) >= len(kept), 60, "the keeper's backlog", daemons)
    assert messages(keeper, "keep-") == [f"keep-{n:06d}" for n in kept]  # all of it, in order, once
    assert len(kept) > 400  # more than the Go agent's logs buffer (2 x 200)
    # The queue is FIFO: once a point collected after the outage has arrived, the whole backlog arrived before it.
    # (Not "nothing pending": at 5 Hz collection there is nearly always a point waiting for its batch.)
    wait_until(lambda: any(gojson.parse_time(p["timestamp"]).timestamp() > outage_ended
                           for p in dp.admin.metrics(ids[keeper])), 30, "the metrics backlog", daemons)
    metrics = dp.admin.metrics(ids[keeper])
    stamps = [p["timestamp"] for p in metrics]
    assert stamps == sorted(stamps)
    # system points collected while the devplane was away arrived, from both sides of the restart (the queue on
    # disk outlived it); how many depends on how loaded the machine was, so only a floor well below 5 Hz
    during = [gojson.parse_time(p["timestamp"]).timestamp() for p in metrics[metrics_before:]
              if p["group"] == "system"]
    during = [t for t in during if outage_began <= t <= outage_ended]
    assert any(t < restarted_at for t in during) and any(t > restarted_at for t in during), during
    assert len(during) > (outage_ended - outage_began) / 0.2 / 4, len(during)
    assert keeper.status()["telemetry"]["metrics"]["dropped"] == 0

    # the capped node: only the newest lines survive; the loss is counted, logged and sent upstream
    def notices() -> list[str]:
        return [e["message"] for e in dp.admin.logs(ids[capped]) if e["source"] == "plexd"]

    wait_until(lambda: messages(capped, f"cap-{capped_lines[-1]:06d}"), 60, "the capped node's last line", daemons)
    got = [int(m.split("-")[1]) for m in messages(capped, "cap-")]
    assert got == list(range(got[0], capped_lines[-1] + 1))  # the newest, contiguous, in order: oldest dropped
    lost = len(capped_lines) - len(got)
    wait_until(lambda: notices(), 20, "the drop notice", daemons)
    reported = sum(int(m.split("queue: ")[1].split(" entries")[0]) for m in notices())
    assert capped.status()["telemetry"]["logs"]["dropped"] == reported == lost > 0, notices()
    assert "telemetry: logs queue full" in (capped.dir / "plexd.log").read_text() + capped.logged()
    print(json.dumps({"keeper_lines": len(kept), "capped_lines": len(capped_lines), "capped_received": len(got),
                      "dropped": lost, "notices": notices()}))
