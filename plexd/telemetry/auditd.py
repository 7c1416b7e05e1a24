"""auditd's log (``/var/log/audit/audit.log``) as §1.14 audit entries, and the local actions audit log beside it.

An auditd event is several records with one serial::

    type=SYSCALL msg=audit(1700000000.123:4242): arch=c000003e syscall=257 success=no exit=-13 ... pid=812
        uid=1000 gid=1000 comm="cat" exe="/usr/bin/cat" key="shadow"
    type=PATH msg=audit(1700000000.123:4242): item=0 name="/etc/shadow" nametype=NORMAL ...
    type=EOE msg=audit(1700000000.123:4242):

The records of a read are joined by serial, in the order their first record came. The last event of a read is
held back until its ``EOE`` or the next read (auditd may be mid-event), and the file position stored with the
entries stops before it, so a restart neither loses nor repeats an event.

Mapping (docs/protocol.md §1.14): ``event_type`` is the SYSCALL record's type (else the first record's),
``subject`` its uid, gid and pid (-1 when a record lacks one), ``object`` the JSON encoding of the file name
(the PATH record that is not a parent directory, else ``exe``), ``action`` the syscall's name (x86-64 numbers
are named; ``log_format=ENRICHED`` names every one), falling back to the record type, ``result`` ``success`` or
``failure`` (``success=`` or ``res=``), ``raw`` the records as written, capped like a log line.

Malformed records (cut short, not auditd's format) are skipped, counted, and named in one log line per read.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from plexd.base import boundedjson
from plexd.base.errors import PlexdError
from plexd.base.gojson import format_unix, now_text
from plexd.telemetry.tail import FileTail, Line, cap_line

log = logging.getLogger(__name__)

_HEADER = re.compile(r"^(?:node=\S+ )?type=(\w+) msg=audit\((\d{1,12})\.(\d{1,6}):(\d{1,20})\):\s?(.*)$", re.S)
_FIELD = re.compile(r"""([A-Za-z_][\w-]*)=("[^"]*"|'[^']*'|[^\s"']*)""")
_HEX = re.compile(r"^(?:[0-9A-F]{2})+$")
_HEX_FIELDS = ("name", "exe", "comm", "cwd", "proctitle")
X86_64 = "c000003e"
LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z: the last time an RFC 3339 timestamp can carry
# x86-64 numbers of the syscalls audit rules usually watch; others stay numbers unless the log is ENRICHED.
SYSCALLS_X86_64 = {
    0: "read", 1: "write", 2: "open", 41: "socket", 42: "connect", 43: "accept", 49: "bind", 59: "execve",
    62: "kill", 76: "truncate", 77: "ftruncate", 82: "rename", 83: "mkdir", 84: "rmdir", 85: "creat", 86: "link",
    87: "unlink", 88: "symlink", 90: "chmod", 91: "fchmod", 92: "chown", 93: "fchown", 94: "lchown",
    101: "ptrace", 105: "setuid", 106: "setgid", 159: "adjtimex", 164: "settimeofday", 165: "mount",
    166: "umount2", 169: "reboot", 170: "sethostname", 175: "init_module", 176: "delete_module",
    227: "clock_settime", 246: "kexec_load", 257: "openat", 260: "fchownat", 263: "unlinkat", 264: "renameat",
    268: "fchmodat", 288: "accept4", 304: "open_by_handle_at", 313: "finit_module", 316: "renameat2",
    322: "execveat",
}


class AuditFormatError(PlexdError):
    pass


@dataclass(frozen=True)
class AuditRecord:
    type: str
    time: float
    serial: int
    fields: dict[str, str]
    raw: str


def parse_record(line: str) -> AuditRecord:
    """One line of audit.log; AuditFormatError naming what is wrong."""
    m = _HEADER.match(line)
    if m is None:
        raise AuditFormatError("not 'type=T msg=audit(SECONDS.MILLIS:SERIAL): ...'")
    kind, seconds, fraction, serial, rest = m.groups()
    if int(seconds) >= LAST_SECOND:  # its last second too: a fraction of it rounds into the year 10000
        raise AuditFormatError(f"timestamp {seconds} is after the year 9999")
    body, _, enriched = rest.partition("\x1d")
    fields: dict[str, str] = {}
    for text in (body, enriched):
        for key, value in _FIELD.findall(text):
            if key == "msg" and value.startswith("'"):
                for inner_key, inner_value in _FIELD.findall(value[1:-1]):
                    fields.setdefault(inner_key, _value(inner_key, inner_value))
            else:
                fields.setdefault(key, _value(key, value))
    return AuditRecord(kind, int(seconds) + int(fraction) / 10 ** len(fraction), int(serial), fields, line)


def _value(key: str, value: str) -> str:
    if value[:1] in ("'", '"') and value[-1:] == value[:1] and len(value) >= 2:
        return value[1:-1]
    if key in _HEX_FIELDS and _HEX.match(value):
        return bytes.fromhex(value).decode("utf-8", "replace")  # auditd hex-encodes names with odd bytes
    return value


def audit_entry(records: list[AuditRecord], hostname: str) -> dict[str, Any]:
    main = next((r for r in records if r.type == "SYSCALL"), records[0])
    f = main.fields
    return {
        "timestamp": format_unix(records[0].time),
        "source": "auditd",
        "event_type": main.type,
        "subject": {"uid": _int(f.get("uid")), "gid": _int(f.get("gid")), "pid": _int(f.get("pid"))},
        "object": json.dumps(_object(records), ensure_ascii=False),
        "action": _action(main),
        "result": _result(records),
        "hostname": hostname,
        "raw": cap_line("\n".join(r.raw for r in records).encode("utf-8", "replace")),
    }


def _int(value: str | None) -> int:
    try:
        return int(value) if value is not None else -1
    except ValueError:
        return -1


def _object(records: list[AuditRecord]) -> str:
    paths = [r.fields for r in records if r.type == "PATH" and "name" in r.fields]
    for fields in paths:
        if fields.get("nametype") != "PARENT":
            return fields["name"]
    if paths:
        return paths[0]["name"]
    for r in records:
        for key in ("exe", "name", "addr", "hostname"):
            if r.fields.get(key) not in (None, "", "?"):
                return r.fields[key]
    return ""


def _action(record: AuditRecord) -> str:
    f = record.fields
    if "SYSCALL" in f:  # ENRICHED: auditd named it
        return f["SYSCALL"]
    number = f.get("syscall")
    if number is None:
        return record.type
    if f.get("arch") == X86_64 and number.isdigit() and int(number) in SYSCALLS_X86_64:
        return SYSCALLS_X86_64[int(number)]
    return number


def _result(records: list[AuditRecord]) -> str:
    for r in records:
        verdict = r.fields.get("success") or r.fields.get("res")
        if verdict is not None:
            return "success" if verdict in ("yes", "success", "1") else "failure"
    return "success"


class AuditLog:
    """Tails audit.log and turns each read into entries and the position to store with them."""

    def __init__(self, path: str, saved: Any, hostname: str) -> None:
        self.tail = FileTail(path, saved, what="audit log")
        self.hostname = hostname
        self._held: list[tuple[AuditRecord, Line]] = []
        self._held_before: dict[str, int] | None = None
        self.malformed = 0

    @property
    def source(self) -> str:
        return "auditd:" + self.tail.path

    def collect(self) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        lines = self.tail.read()
        if not lines:
            if not self._held:
                return [], None
            held, self._held = self._held, []  # nothing more came: the held event is whole
            self._held_before = None  # sent: a later hold must not store a position before it
            return [audit_entry([r for r, _ in held], self.hostname)], held[-1][1].position
        records, bad = [], []
        before = self._held_before
        for line in lines:
            if not line.text.strip():
                continue
            try:
                records.append((parse_record(line.text), line))
            except AuditFormatError as exc:
                bad.append((line.text, exc))
        if bad:
            self.malformed += len(bad)
            text, exc = bad[0]
            log.warning("audit log %s: %d malformed record(s) skipped, e.g. %r: %s", self.tail.path, len(bad),
                        text[:120], exc)
        return self._join(self._held + records, before, lines[-1].position)

    def _join(self, records: list[tuple[AuditRecord, Line]], before: dict[str, int] | None,
              end: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        groups: dict[int, list[tuple[AuditRecord, Line]]] = {}
        ended: set[int] = set()
        for record, line in records:
            if record.type == "EOE":
                ended.add(record.serial)
                groups.setdefault(record.serial, [])
                continue
            groups.setdefault(record.serial, []).append((record, line))
        order = list(groups)
        self._held, self._held_before = [], None
        position = end
        if order and order[-1] not in ended and groups[order[-1]]:
            self._held = groups.pop(order[-1])
            first_held = self._held[0][1]
            position = _position_before(records, first_held) or before
            self._held_before = position
        entries = [audit_entry([r for r, _ in group], self.hostname) for group in groups.values() if group]
        return entries, position


def _position_before(records: list[tuple[AuditRecord, Line]], line: Line) -> dict[str, int] | None:
    previous = None
    for _, candidate in records:
        if candidate is line:
            return previous
        previous = candidate.position
    return previous


def local_action_entry(line: str, hostname: str) -> dict[str, Any] | None:
    """A line of plexd's local actions audit log (plexd.actions.audit) as an audit entry; None if unreadable."""
    try:
        doc = boundedjson.parse(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("event"), str):
        return None
    event = doc["event"]
    if doc.get("origin") == "plexd-access":  # an access session's line (plexd.node.access)
        return {
            "timestamp": doc.get("time") if isinstance(doc.get("time"), str) else now_text(),
            "source": "plexd-access",
            "event_type": "access_session",
            "subject": {"uid": -1, "gid": -1, "pid": -1},
            "object": json.dumps(str(doc.get("session_id", "")), ensure_ascii=False),
            "action": event,
            "result": "failure" if event == "auth_failed" or "refused" in doc else "success",
            "hostname": hostname,
            "raw": line,
        }
    failed = event == "refused" or (event == "finished" and doc.get("status") not in (None, "success"))
    return {
        "timestamp": doc.get("time") if isinstance(doc.get("time"), str) else now_text(),
        "source": "plexd-actions",
        "event_type": "local_action",
        "subject": {k: doc[k] if isinstance(doc.get(k), int) else -1 for k in ("uid", "gid", "pid")},
        "object": json.dumps(str(doc.get("action", "")), ensure_ascii=False),
        "action": event,
        "result": "failure" if failed else "success",
        "hostname": hostname,
        "raw": line,
    }
