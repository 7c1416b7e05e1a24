"""SSE frame rules of docs/protocol.md §2.1, on raw bytes, split at every possible boundary: httpx-sse's reading
(plexd.controlplane.sse.read_events) behind plexd's bound per event."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from plexd.controlplane.sse import SSEEvent, _Bounded, read_events


async def _chunks(chunks):
    for chunk in chunks:
        yield chunk


async def collect(chunks, **kw) -> list[SSEEvent]:
    return [e async for e in read_events(_chunks(chunks), **kw)]


def parse(data: bytes, **kw) -> list[SSEEvent]:
    return asyncio.run(collect([data], **kw))


class Incremental:
    """Chunks fed one at a time into a live reader: what each chunk brought out, as soon as it arrived."""

    def __init__(self, **kw) -> None:
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.out: list[SSEEvent] = []
        self._task = asyncio.ensure_future(self._run(kw))

    async def _run(self, kw) -> None:
        async for event in read_events(self._source(), **kw):
            self.out.append(event)

    async def _source(self):
        while (chunk := await self._queue.get()) is not None:
            yield chunk

    async def feed(self, chunk: bytes) -> list[SSEEvent]:
        before = len(self.out)
        self._queue.put_nowait(chunk)
        for _ in range(50):
            await asyncio.sleep(0)
        return self.out[before:]

    async def close(self) -> None:
        self._queue.put_nowait(None)
        await self._task


def test_basic_block():
    assert parse(b"id: 7\nevent: peer_added\ndata: {\"a\":1}\n\n") == [
        SSEEvent(data='{"a":1}', id="7", event="peer_added")]


def test_comments_ignored_and_event_defaults_to_message():
    assert parse(b": ping\n\n:another\ndata: x\n\n") == [SSEEvent(data="x")]


def test_multi_line_data_joined_with_newline():
    assert parse(b"data: a\ndata:b\ndata:  c\n\n")[0].data == "a\nb\n c"


def test_crlf_accepted():
    assert parse(b"id: 1\r\ndata: x\r\n\r\n") == [SSEEvent(data="x", id="1")]


def test_a_lone_cr_ends_a_line_too():
    # W3C allows CR-only streams; split on LF alone, every event was one endless line, dropped in silence.
    assert parse(b"id: 1\rdata: a\r\rid: 2\rdata: b\r\n\r\n") == [SSEEvent(data="a", id="1"),
                                                                        SSEEvent(data="b", id="2")]


async def test_a_crlf_split_between_chunks_is_one_line_end():
    p = Incremental()
    assert await p.feed(b"data: a\r") == [] and await p.feed(b"\n\r") == [SSEEvent(data="a")]
    assert await p.feed(b"\ndata: b\n") == []  # that CR's LF, not a blank line of its own
    await p.close()
    q = Incremental()  # a CR closing a chunk, then no LF: the next byte starts the next line
    assert await q.feed(b"data: a\r") == [] and await q.feed(b"\r") == [SSEEvent(data="a")]
    await q.close()


def test_field_without_colon_has_empty_value():
    # "data" alone is a data line with an empty value: a block whose data is empty carries nothing, and is dropped
    assert parse(b"data\n\n") == []
    assert parse(b"id\ndata: x\n\n") == [SSEEvent(data="x", id=None)]  # an empty id is no id


def test_an_id_carries_over_to_the_next_block_as_w3c_says():
    assert parse(b"id: 1\ndata: a\n\ndata: b\n\n") == [SSEEvent(data="a", id="1"), SSEEvent(data="b", id="1")]


def test_block_without_data_dropped():
    assert parse(b"id: 5\nevent: x\n\n") == []


def test_retry_and_nul_id():
    assert parse(b"retry: 500\nid: a\x00b\ndata: x\n\n") == [SSEEvent(data="x", retry=500)]
    assert parse(b"retry: soon\ndata: x\n\n")[0].retry is None


def test_only_one_space_stripped_and_colons_in_value_kept():
    assert parse(b'data:  {"k":"v:w"}\n\n')[0].data == ' {"k":"v:w"}'


async def test_incomplete_block_waits_for_blank_line():
    p = Incremental()
    assert await p.feed(b"data: x\n") == []
    assert await p.feed(b"\n") == [SSEEvent(data="x")]
    await p.close()


def test_oversize_event_is_marked_with_its_id_and_the_stream_goes_on():
    big = b"data: " + b"x" * (1 << 20) + b"\n"
    chunks = [big[i:i + 7000] for i in range(0, len(big), 7000)]  # arrives in chunks
    out = asyncio.run(collect([*chunks, b"id: 9\n\n", b"id: 10\ndata: ok\n\n"]))
    assert out == [SSEEvent(data="", id="9", oversize=True), SSEEvent(data="ok", id="10")]


def test_oversize_by_many_lines():
    lines = b"".join(b"data: " + b"y" * 1000 + b"\n" for _ in range(20))
    out = parse(lines + b"\n" + b"data: z\n\n", max_event_bytes=10_000)
    assert [e.oversize for e in out] == [True, False]
    assert out[1].data == "z"


def test_memory_bounded_for_endless_line():
    p = _Bounded(max_event_bytes=1000)
    for _ in range(100):
        assert p.feed(b"a" * 10_000) == b""  # nothing reaches httpx-sse's line buffer
    assert len(p._line) == 0


def test_invalid_utf8_replaced():
    assert parse(b"data: \xff\n\n")[0].data == "\ufffd"


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_chunking_does_not_matter(cuts):
    stream = (b": ping\r\n\r\nid: 1\nevent: e\ndata: {\"a\":\n"
              b"data: 1}\n\nid: 2\r\ndata: two\r\n\r\nevent: nodata\n\nid: 3\rdata: cr\r\r")
    want = parse(stream)
    pieces, pos = [], 0
    for c in cuts:
        pieces.append(stream[pos:pos + c])
        pos += c
    got = asyncio.run(collect([*pieces, stream[pos:]]))
    assert got == want == [SSEEvent(data='{"a":\n1}', id="1", event="e"), SSEEvent(data="two", id="2"),
                           SSEEvent(data="cr", id="3")]
