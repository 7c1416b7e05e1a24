"""The event stream's frames (docs/protocol.md §2.1): httpx-sse reads them, from bytes plexd has bounded first.

httpx-sse (`EventSource`) does the W3C field rules: lines end in LF, CRLF or a lone CR (the Go agent knows only the
first two: a stream of CR-ended lines would be one endless line, every event lost without a word); `:` starts a
comment; `field: value` with one optional space after the colon stripped; several `data` lines are joined with LF;
a blank line ends the block; an `id` with a NUL is ignored. It buffers a line of any length, though, so it is fed
through `_Bounded`: whole lines only, and a block past `max_event_bytes` has its lines dropped and comes out as one
`oversize` frame (its `id` kept when known), which the stream logs and skips, so a poison event is never re-read in
a loop and memory stays bounded per event. Comment lines go no further (the stream's idle watchdog counts every
byte that arrives, pings included, before this). plexd then drops a block without data, and takes `retry` only as
1-10 ASCII digits. Whether an `id` is usable as a replay cursor (printable ASCII, bounded) is `valid_event_id`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

import httpx
from httpx_sse import EventSource

from plexd.controlplane.http_client import Chunks

# One event (all its lines) may not exceed 512 KiB. The Go agent dies on a 64 KiB line; legitimate events are a
# few KiB. An oversize event is skipped, and the reconciler's full-state pull still brings whatever it carried.
MAX_EVENT_BYTES = 512 * 1024
MAX_EVENT_ID = 128
_EVENT_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_EVENT_ID}}}")
_LINE_END = re.compile(rb"[\r\n]")
_OVERSIZE = "\x00plexd-oversize"  # the event name `_Bounded` gives a block past the cap (a NUL: no real name)


def valid_event_id(event_id: str | None) -> bool:
    """An id we can persist and send back as ``Last-Event-ID``: 1-128 printable ASCII characters, no spaces."""
    return event_id is not None and _EVENT_ID.fullmatch(event_id) is not None


@dataclass(frozen=True)
class SSEEvent:
    data: str
    id: str | None = None  # the stream's last event id (W3C: it carries over to blocks without one), None if none
    event: str = "message"
    retry: int | None = None
    oversize: bool = False  # the block exceeded the size cap; `data` is empty, `id` may still be known


async def read_events(chunks: AsyncIterable[bytes], max_event_bytes: int = MAX_EVENT_BYTES) -> AsyncIterator[SSEEvent]:
    """The frames in a stream of raw (already decoded) body bytes, each as soon as its blank line arrives."""
    bounded = _Bounded(max_event_bytes)

    async def lines() -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if out := bounded.feed(chunk):
                yield out

    source = httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"}, stream=Chunks(lines()))
    async for sse in EventSource(source).aiter_sse():
        if sse.event == _OVERSIZE:
            yield SSEEvent(data="", id=sse.id or None, oversize=True)
        elif sse.data:
            retry = sse.retry if sse.retry is not None and 0 <= sse.retry < 10**10 else None
            yield SSEEvent(data=sse.data, id=sse.id or None, event=sse.event or "message", retry=retry)


class _Bounded:
    """Raw bytes in, whole LF-ended lines out; comments dropped; a block past the cap reduced to its `id` lines and
    a closing `event:` line naming it oversize. Holds at most one line of the cap's size."""

    def __init__(self, max_event_bytes: int) -> None:
        self._max = max_event_bytes
        self._line = bytearray()
        self._discarding_line = False  # the current line already blew the cap; drop bytes up to its end
        self._after_cr = False  # the last chunk ended in CR: an LF opening the next one belongs to it (CRLF)
        self._block_bytes = 0
        self._oversize = False

    def feed(self, chunk: bytes) -> bytes:
        out = bytearray()
        pos, n = 0, len(chunk)
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
                    self._oversize = self._discarding_line = True
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
            out += self._line_done(bytes(self._line))
            self._line.clear()
        return bytes(out)

    def _line_done(self, line: bytes) -> bytes:
        if not line:  # the block ends
            closing = f"event:{_OVERSIZE}\n\n".encode() if self._oversize else b"\n"
            self._block_bytes, self._oversize = 0, False
            return closing
        self._block_bytes += len(line) + 1
        if line.startswith(b":") or (self._oversize and not line.startswith(b"id")):
            return b""
        return line + b"\n"
