"""Following a log file the way ``tail -F`` does, with a position that survives restarts and rotation.

`FileTail.read` returns the complete lines written since the last call, each with the position just after it
(``{"ino", "offset"}``), which the caller stores with the entries it made of them (`TelemetryQueue.append`). On
the next start the tail resumes there: in the same file, or, if it was rotated meanwhile, in ``PATH.1`` (the
rotated file with the saved inode) before the new file from its start. A file truncated in place
(copytruncate) is read again from its start.

Outside input, so bounded: at most `MAX_LINE` bytes of a line are kept (``[truncated]`` is appended and the rest
of the line skipped, however long), at most `READ_BUDGET` bytes are read per call, and bytes that are not UTF-8
become U+FFFD. A file that is missing or unreadable is one log line when that starts and one when it ends.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 16 * 1024
TRUNCATED = "[truncated]"
READ_CHUNK = 64 * 1024
READ_BUDGET = 4 << 20


def cap_line(raw: bytes) -> str:
    """A line as text: invalid UTF-8 replaced, a trailing CR dropped, cut at `MAX_LINE` bytes with a marker."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if len(raw) <= MAX_LINE:
        return raw.decode("utf-8", "replace")
    return raw[:MAX_LINE].decode("utf-8", "ignore") + TRUNCATED


@dataclass(frozen=True)
class Line:
    text: str
    position: dict[str, int]  # where the file is read up to once this line is taken


class FileTail:
    def __init__(self, path: str, saved: Any = None, *, what: str = "log file") -> None:
        self.path, self.what = path, what
        self._fh: Any = None
        self._ino = 0
        self._offset = 0  # of the first byte not yet consumed (the start of `_partial`)
        self._partial = b""
        self._skipping = False  # inside a line already cut at MAX_LINE
        self.problem = ""
        self._pending_rotated: tuple[str, int] | None = None  # (PATH.1, offset) to finish after a restart
        self._draining_rotated = False  # PATH.1 is open (self._fh) and being read to its end
        self._budget = READ_BUDGET  # bytes this read() may still take
        self._resume(saved if isinstance(saved, dict) else None)

    # -- opening ------------------------------------------------------------------------------------------------

    def _resume(self, saved: dict[str, Any] | None) -> None:
        """Where to start: the saved position (here or in PATH.1), else the end of today's file (history is not
        sent), else — the file does not exist yet — its start once it appears."""
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if saved is None:
            self._open(st.st_size)
            return
        ino, offset = int(saved.get("ino", 0)), int(saved.get("offset", 0))
        if st.st_ino == ino:
            self._open(offset if offset <= st.st_size else 0)
            return
        rotated = self.path + ".1"
        try:
            if os.stat(rotated).st_ino == ino:
                self._pending_rotated = (rotated, offset)
        except OSError:
            pass
        self._open(0)

    def _open(self, offset: int, path: str | None = None) -> bool:
        try:
            fh = open(path or self.path, "rb")  # noqa: SIM115 (kept open between reads, like tail -F)
            st = os.fstat(fh.fileno())
            fh.seek(offset)
        except OSError as exc:
            self._trouble(f"cannot read it: {exc.strerror or exc}")
            return False
        self.close()
        self._fh, self._ino, self._offset, self._partial, self._skipping = fh, st.st_ino, offset, b"", False
        self._fine()
        return True

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # -- reading ------------------------------------------------------------------------------------------------

    def read(self) -> list[Line]:
        lines: list[Line] = []
        self._budget = READ_BUDGET
        if self._pending_rotated is not None:
            rotated, offset = self._pending_rotated
            # Opened once and kept open until its end: the budget may take several reads, and by name it could be
            # another file by then (logrotate again), or cut an over-long line it is skipping in two.
            opened = self._draining_rotated or self._open(offset, rotated)
            if opened and not self._drain(lines, final=True):
                self._draining_rotated = True  # the budget ran out: the rest at the next read
                return lines
            self._pending_rotated, self._draining_rotated = None, False
            self.close()
            self._open(0)
        if self._fh is None:
            if not os.path.exists(self.path):
                self._trouble("it does not exist (yet)")
                return lines
            if not self._open(0):
                return lines
        self._drain(lines, final=False)
        if self._budget > 0:
            self._follow_rotation(lines)
        return lines

    def _follow_rotation(self, lines: list[Line]) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return  # moved away and not yet recreated: keep the old file until a new one appears
        if st.st_ino != self._ino:
            if not self._drain(lines, final=True):  # what was written to the old file before it moved...
                return  # ...all of it, over as many reads as the budget takes, before the new file
            self._open(0)
            self._drain(lines, final=False)
        elif st.st_size < self._offset + len(self._partial):
            log.info("%s %s was truncated; reading it from the start", self.what, self.path)
            self._open(0)
            self._drain(lines, final=False)

    def _drain(self, lines: list[Line], *, final: bool) -> bool:
        """Read the current file to its end (or the budget); `final`: it will not grow, so a last line without a
        newline is a line (only at its very end: not where the budget cut it). True when the end was reached."""
        while self._budget > 0:
            try:
                chunk = self._fh.read(min(READ_CHUNK, self._budget))
            except OSError as exc:
                self._trouble(f"read failed: {exc.strerror or exc}")
                return True  # nothing more can come of it
            if not chunk:
                break
            self._budget -= len(chunk)
            self._split(self._partial + chunk, lines)
        else:
            return False
        if final and self._partial:
            self._take(self._partial, len(self._partial), lines)
            self._partial = b""
        return True

    def _split(self, data: bytes, lines: list[Line]) -> None:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._take(data[start:end], end + 1 - start, lines)
            start = end + 1
        rest = data[start:]
        if len(rest) > MAX_LINE and not self._skipping:
            self._take(rest, len(rest), lines)  # cut here; what follows up to the newline is skipped
            self._skipping = True
            rest = b""
        elif self._skipping:
            self._offset += len(rest)
            rest = b""
        self._partial = rest

    def _take(self, raw: bytes, consumed: int, lines: list[Line]) -> None:
        self._offset += consumed
        if self._skipping:
            self._skipping = False  # the newline that ends an over-long line
            return
        lines.append(Line(cap_line(raw), {"ino": self._ino, "offset": self._offset}))

    # -- saying so, once ----------------------------------------------------------------------------------------

    def _trouble(self, problem: str) -> None:
        if problem != self.problem:
            level = logging.INFO if "does not exist" in problem else logging.WARNING
            log.log(level, "%s %s: %s; trying again at each collection", self.what, self.path, problem)
            self.problem = problem

    def _fine(self) -> None:
        if self.problem:
            log.info("%s %s: reading it again", self.what, self.path)
            self.problem = ""
