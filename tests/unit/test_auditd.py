"""auditd records as §1.14 audit entries (plexd.telemetry.auditd): joined by serial, mapped, held while an event
may be incomplete, malformed records skipped with one line, and the local actions audit log. Any line at all is
fuzzed in tests/unit/test_fuzz_parsers.py (targets audit_record and local_action)."""

from __future__ import annotations

import json
import logging

from plexd.telemetry.auditd import AuditLog, audit_entry, local_action_entry, parse_record

SHADOW = [
    'type=SYSCALL msg=audit(1700000000.123:4242): arch=c000003e syscall=257 success=no exit=-13 a0=ffffff9c '
    'items=1 ppid=700 pid=812 auid=1000 uid=1000 gid=1001 euid=1000 comm="cat" exe="/usr/bin/cat" key="shadow"',
    'type=CWD msg=audit(1700000000.123:4242): cwd="/home/ana"',
    'type=PATH msg=audit(1700000000.123:4242): item=0 name="/etc/shadow" inode=1 nametype=NORMAL',
    "type=PROCTITLE msg=audit(1700000000.123:4242): proctitle=636174002F6574632F736861646F77",
    "type=EOE msg=audit(1700000000.123:4242): ",
]
LOGIN = ("type=USER_LOGIN msg=audit(1700000001.5:4243): pid=900 uid=0 auid=4294967295 ses=4294967295 "
         "msg='op=login acct=\"root\" exe=\"/usr/sbin/sshd\" hostname=? addr=203.0.113.9 terminal=sshd "
         "res=failed'")


def write(path, lines) -> None:
    with open(path, "a") as fh:
        fh.write("".join(line + "\n" for line in lines))


def test_a_syscall_event_is_one_entry_in_the_protocol_shape():
    records = [parse_record(line) for line in SHADOW[:-1]]
    entry = audit_entry(records, "web-01")
    assert entry == {
        "timestamp": "2023-11-14T22:13:20.123Z", "source": "auditd", "event_type": "SYSCALL",
        "subject": {"uid": 1000, "gid": 1001, "pid": 812}, "object": '"/etc/shadow"', "action": "openat",
        "result": "failure", "hostname": "web-01", "raw": "\n".join(SHADOW[:-1]),
    }


def test_a_user_record_takes_its_result_from_res_and_its_action_from_the_type():
    entry = audit_entry([parse_record(LOGIN)], "h")
    assert (entry["event_type"], entry["action"], entry["result"]) == ("USER_LOGIN", "USER_LOGIN", "failure")
    assert entry["object"] == '"/usr/sbin/sshd"' and entry["subject"] == {"uid": 0, "gid": -1, "pid": 900}


def test_an_enriched_log_names_the_syscall_of_any_architecture():
    line = ('type=SYSCALL msg=audit(1700000000.1:7): arch=c00000b7 syscall=56 success=yes pid=1 uid=0 gid=0'
            '\x1dARCH=aarch64 SYSCALL=openat UID="root"')
    assert audit_entry([parse_record(line)], "h")["action"] == "openat"


def test_records_are_joined_by_serial_and_an_unfinished_last_event_waits_for_the_next_read(tmp_path):
    path = tmp_path / "audit.log"
    path.write_text("")
    audit = AuditLog(str(path), None, "h")
    write(path, [LOGIN, *SHADOW[:2]])  # the SYSCALL event is cut after its CWD record
    entries, position = audit.collect()
    assert [e["event_type"] for e in entries] == ["USER_LOGIN"]
    first_position = position
    write(path, SHADOW[2:])
    entries, position = audit.collect()
    assert [e["event_type"] for e in entries] == ["SYSCALL"] and entries[0]["object"] == '"/etc/shadow"'
    assert len(entries[0]["raw"].splitlines()) == 4  # EOE is a marker, not a record
    # a restart from the first position re-reads the held event, not the login
    again = AuditLog(str(path), first_position, "h")
    assert [e["event_type"] for e in again.collect()[0]] == ["SYSCALL"]
    # a single-record event without EOE goes out at the next read even if nothing follows it
    write(path, [LOGIN.replace(":4243)", ":4244)")])
    assert audit.collect()[0] == []
    assert [e["event_type"] for e in audit.collect()[0]] == ["USER_LOGIN"]


def test_after_a_held_event_went_out_the_stored_position_never_goes_back_before_it(tmp_path):
    # A held event flushed by an empty read left its "before" position behind; the next held event then stored
    # that, and a restart sent the first event a second time.
    path = tmp_path / "audit.log"
    path.write_text("")
    audit = AuditLog(str(path), None, "h")
    write(path, [*SHADOW, LOGIN.replace(":4243)", ":4244)")])
    first, stored = audit.collect()  # the SYSCALL event goes; the login is held: an event may go on
    assert [e["event_type"] for e in first] == ["SYSCALL"]
    sent, position = audit.collect()  # nothing more came: it goes
    stored = position or stored  # None: the stored position stays as it is
    assert [e["event_type"] for e in sent] == ["USER_LOGIN"]
    later = [line.replace(":4242)", ":4250)") for line in SHADOW]
    write(path, later[:2])  # the next event, cut: held
    entries, position = audit.collect()
    stored = position or stored
    assert entries == []
    again = AuditLog(str(path), stored, "h")  # a restart from what was stored
    write(path, later[2:])
    assert [e["event_type"] for e in again.collect()[0]] == ["SYSCALL"]  # not the login again


def test_a_timestamp_in_the_last_second_of_9999_is_refused_not_a_crash_loop():
    import pytest

    from plexd.telemetry.auditd import AuditFormatError

    with pytest.raises(AuditFormatError, match="after the year 9999"):
        audit_entry([parse_record("type=USER_LOGIN msg=audit(253402300799.999999:1): pid=1 uid=0 res=success")], "h")


def test_truncated_and_foreign_records_are_skipped_with_one_line_per_read(tmp_path, caplog):
    path = tmp_path / "audit.log"
    path.write_text("")
    audit = AuditLog(str(path), None, "h")
    write(path, ["type=SYSCALL msg=audit(1700000000.1", "hello world", LOGIN,
                 "type=EOE msg=audit(1700000001.5:4243): "])
    with caplog.at_level(logging.WARNING):
        entries, _ = audit.collect()
    assert [e["event_type"] for e in entries] == ["USER_LOGIN"] and audit.malformed == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "2 malformed record(s)" in said[0], said


def test_the_local_actions_audit_log_becomes_audit_entries():
    line = json.dumps({"time": "2026-11-23T10:00:00Z", "event": "finished", "execution_id": "x1",
                       "action": "restart-app", "uid": 0, "gid": 0, "pid": 77, "status": "failed", "exit_code": 3})
    entry = local_action_entry(line, "h")
    assert entry["source"] == "plexd-actions" and entry["action"] == "finished"
    assert entry["object"] == '"restart-app"' and entry["result"] == "failure" and entry["raw"] == line
    assert entry["subject"] == {"uid": 0, "gid": 0, "pid": 77}
    assert local_action_entry("{not json", "h") is None
