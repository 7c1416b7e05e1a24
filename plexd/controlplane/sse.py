"""An incremental Server-Sent-Events frame parser over raw bytes (docs/protocol.md §2.1).

Why not httpx-sse's ``aiter_sse``: it swallows comment lines, and the server's ``: ping`` comments are our only
liveness signal for the 90 s idle watchdog; and it buffers a line of any length. This parser sees every byte,
bounds memory per event, and turns an oversize event into a marker the stream can log and skip, so a poison
event is never re-read in a loop.

Rules (W3C): lines end in LF, CRLF or a lone CR (the Go agent knows only the first two: a stream of CR-ended
lines would be one endless line, every event lost without a word); ``:`` starts a comment; ``field: value`` with one
optional space after the colon stripped; a line without a colon is a field with an empty value; several ``data``
lines are joined with LF; a blank line ends the block; a block without data is dropped; ``event`` defaults to
``message``; an ``id`` containing NUL is ignored; ``retry`` must be 1-10 ASCII digits. Whether an ``id`` is usable
as a replay cursor (printable ASCII, bounded) is decided by `valid_event_id`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# One event (all its lines) may not exceed 512 KiB. The Go agent dies on a 64 KiB line; legitimate events are a
# few KiB. An oversize event is skipped, and the reconciler's full-state pull still brings whatever it carried.
MAX_EVENT_BYTES = 512 * 1024
MAX_EVENT_ID = 128
_EVENT_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_EVENT_ID}}}")
_LINE_END = re.compile(rb"[\r\n]")


def valid_event_id(event_id: str | None) -> bool:
    """An id we can persist and send back as ``Last-Event-ID``: 1-128 printable ASCII characters, no spaces."""
    return event_id is not None and _EVENT_ID.fullmatch(event_id) is not None


@dataclass(frozen=True)
class SSEEvent:
    data: str
    id: str | None = None  # the block's ``id`` field, None when absent
    event: str = "message"
    retry: int | None = None
    oversize: bool = False  # the block exceeded the size cap; `data` is empty, `id` may still be known


class SSEParser:
    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._line = bytearray()
        self._discarding_line = False  # the current line already blew the cap; drop bytes up to its end
        self._after_cr = False  # the last chunk ended in CR: an LF opening the next one belongs to it (CRLF)
        self._reset_block()

    def _reset_block(self) -> None:
        self._data: list[str] = []
        self._id: str | None = None
        self._event = ""
        self._retry: int | None = None
        self._block_bytes = 0
        self._oversize = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume bytes; return the events completed by them."""
        events: list[SSEEvent] = []
        pos = 0
        n = len(chunk)
        while pos < n:
            if self._after_cr:
                self._after_cr = False
                if chunk[pos] == 0x0A:
                    pos += 1
                    continue
            match = _LINE_END.search(chunk, pos)
            end = n if match is None else match.start()
            if not self._discarding_line:
                self._line += chunk[pos:end]
                if self._block_bytes + len(self._line) > self._max:
                    self._oversize = True
                    self._discarding_line = True
                    self._line.clear()
            if match is None:
                break
            pos = end + 1
            if chunk[end] == 0x0D:
                if pos == n:
                    self._after_cr = True
                elif chunk[pos] == 0x0A:
                    pos += 1
            if self._discarding_line:
                self._discarding_line = False
                continue
            line = bytes(self._line)
            self._line.clear()
            event = self._line_done(line)
            if event is not None:
                events.append(event)
        return events

    def _line_done(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            return self._dispatch()
        self._block_bytes += len(raw) + 1
        if raw.startswith(b":"):
            return None
        line = raw.decode("utf-8", errors="replace")
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            if not self._oversize:
                self._data.append(value)
        elif field == "id":
            if "\x00" not in value:
                self._id = value
        elif field == "event":
            self._event = value
        elif field == "retry" and value.isascii() and value.isdigit() and len(value) <= 10:
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        try:
            if self._oversize:
                return SSEEvent(data="", id=self._id, event=self._event or "message", oversize=True)
            if not self._data:
                return None
            return SSEEvent(data="\n".join(self._data), id=self._id, event=self._event or "message",
                            retry=self._retry)
        finally:
            self._reset_block()
