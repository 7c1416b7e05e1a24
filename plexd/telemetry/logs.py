"""Log lines as §1.14 log entries, from the systemd journal or from log files.

Journal: ``journalctl -o json --all --follow`` (the journal's own reader: no binding to keep in step with the
journal's file format), resumed with ``--after-cursor`` from the cursor stored with the last entries queued, so a
restart neither sends a line twice nor skips one; the first start begins at the journal's end. Units and a
maximum priority filter it (``-u``, ``-p``). ``unit`` is the systemd unit without ``.service`` (else the syslog
identifier), ``severity`` the priority's syslog name (0–7; anything else is ``info``).

Files: each configured file is followed across rotation (plexd.telemetry.tail); ``unit`` is the file's name,
``severity`` ``info`` (a plain file says nothing reliable about it).

Either way a message is capped at 16 KiB with ``[truncated]`` and bytes that are not UTF-8 become U+FFFD.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from plexd.base import boundedjson
from plexd.base.childenv import child_environment
from plexd.base.children import signal_child
from plexd.base.gojson import format_unix, now_text
from plexd.telemetry.tail import FileTail, cap_line

log = logging.getLogger(__name__)

SEVERITIES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")
JOURNAL_SOCKET = "/run/systemd/journal/socket"
MAX_JSON_LINE = 4 << 20  # a journal entry printed as JSON; larger ones are skipped (and counted)
MAX_BUFFERED = 8 << 20  # bytes of entries read but not yet queued; beyond it journalctl waits (nothing is lost)


def severity(priority: Any) -> str:
    try:
        value = int(priority)
    except (TypeError, ValueError):
        return "info"
    return SEVERITIES[value] if 0 <= value < len(SEVERITIES) else "info"


class FileLogs:
    """Configured log files, each followed from where the queue says it was last read."""

    def __init__(self, paths: tuple[str, ...], saved: dict[str, Any], hostname: str) -> None:
        self.tails = [FileTail(path, saved.get("file:" + path)) for path in paths]
        self.hostname = hostname

    def collect(self) -> list[tuple[list[dict[str, Any]], tuple[str, Any]]]:
        """Per file that moved: its new entries and (source, position) to store with them."""
        out = []
        for tail in self.tails:
            lines = tail.read()
            if lines:
                unit = os.path.basename(tail.path)
                stamp = now_text()
                entries = [{"timestamp": stamp, "source": "file", "unit": unit, "message": line.text,
                            "severity": "info", "hostname": self.hostname} for line in lines]
                out.append((entries, ("file:" + tail.path, lines[-1].position)))
        return out


def journal_entry(doc: dict[str, Any], hostname: str) -> dict[str, Any]:
    message = doc.get("MESSAGE")
    if isinstance(message, list):  # journalctl prints a message that is not UTF-8 as its bytes
        raw = bytes(b for b in message if isinstance(b, int) and 0 <= b < 256)
    else:
        raw = str(message if message is not None else "").encode("utf-8", "surrogatepass")
    unit = str(doc.get("_SYSTEMD_UNIT") or doc.get("SYSLOG_IDENTIFIER") or doc.get("_COMM") or "")
    try:
        stamp = format_unix(int(doc["__REALTIME_TIMESTAMP"]) / 1e6)
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        stamp = now_text()
    return {"timestamp": stamp, "source": "journald", "unit": unit.removesuffix(".service"),
            "message": cap_line(raw), "severity": severity(doc.get("PRIORITY")),
            "hostname": str(doc.get("_HOSTNAME") or hostname)}


class JournalLogs:
    """Follows the journal through journalctl; `collect` hands over what was read, with the last cursor."""

    SOURCE = "journal"

    def __init__(self, cursor: Any, hostname: str, *, units: tuple[str, ...] = (), priority: str = "debug",
                 directory: str = "") -> None:
        self.cursor = cursor if isinstance(cursor, str) and cursor else None
        self.hostname, self.units, self.priority, self.directory = hostname, units, priority, directory
        self._entries: list[dict[str, Any]] = []
        self._buffered = 0
        self._room = asyncio.Event()
        self._room.set()
        self.skipped = 0

    def command(self) -> list[str]:
        argv = ["journalctl", "--output=json", "--all", "--follow", "--no-pager", f"--priority={self.priority}"]
        argv += [f"--unit={unit}" for unit in self.units]
        if self.directory:
            argv.append(f"--directory={self.directory}")
        argv += [f"--after-cursor={self.cursor}"] if self.cursor else ["--lines=0"]
        return argv

    def collect(self) -> list[tuple[list[dict[str, Any]], tuple[str, Any]]]:
        if not self._entries:
            return []
        entries, self._entries, self._buffered = self._entries, [], 0
        self._room.set()
        return [(entries, (self.SOURCE, self.cursor))]

    async def run(self) -> None:
        """Run journalctl until cancelled; it is started again (after a pause) if it exits."""
        while True:
            code, err = await self._follow()
            if self.cursor and "cursor" in err.lower():
                log.warning("journal: cannot resume after the stored cursor (%s); starting at the journal's end",
                            err.strip()[:200])
                self.cursor = None
                continue
            log.warning("journal: journalctl exited (%s)%s; starting it again in 5s", code,
                        f": {err.strip()[:200]}" if err.strip() else "")
            await asyncio.sleep(5.0)

    async def _follow(self) -> tuple[int | None, str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, limit=MAX_JSON_LINE, env=child_environment())
        except OSError as exc:
            return None, f"cannot run journalctl: {exc.strerror or exc}"
        try:
            assert proc.stdout is not None and proc.stderr is not None
            while True:
                await self._room.wait()
                try:
                    line = await proc.stdout.readuntil(b"\n")
                except asyncio.IncompleteReadError:
                    break
                except asyncio.LimitOverrunError as exc:
                    await _discard_line(proc.stdout, exc.consumed)
                    self._skip("an entry over 4 MiB")
                    continue
                self._take(line)
            return await proc.wait(), (await proc.stderr.read(4096)).decode("utf-8", "replace")
        finally:
            if proc.returncode is None:
                signal_child(proc, signal.SIGKILL)
                await proc.wait()

    def _take(self, line: bytes) -> None:
        try:
            doc = boundedjson.parse(line)
        except ValueError:
            self._skip("a line that is not JSON")
            return
        if not isinstance(doc, dict):
            self._skip("a line that is not a JSON object")
            return
        entry = journal_entry(doc, self.hostname)
        self._entries.append(entry)
        if isinstance(doc.get("__CURSOR"), str):
            self.cursor = doc["__CURSOR"]
        self._buffered += len(line)
        if self._buffered >= MAX_BUFFERED:
            self._room.clear()

    def _skip(self, what: str) -> None:
        self.skipped += 1
        log.warning("journal: skipped %s (%d skipped so far)", what, self.skipped)


async def _discard_line(reader: asyncio.StreamReader, pending: int) -> None:
    """Drop the rest of an over-long line, chunk by chunk, without holding it in memory."""
    await reader.readexactly(pending)
    while True:
        try:
            await reader.readuntil(b"\n")
            return
        except asyncio.LimitOverrunError as exc:
            await reader.readexactly(exc.consumed)
        except asyncio.IncompleteReadError:
            return


def journald_running() -> bool:
    return os.path.exists(JOURNAL_SOCKET)
