"""The event stream's reconnect engine, driven by an injected FakeClock and an in-process HTTP transport.

No test sleeps: every wait goes through FakeClock, and the assertions read the delays it was asked for.
The transport is a scripted client (no socket: the stream's client answers from a script with the real
`http_client.Response`); the real HTTP client and the real devplane are exercised in tests/integration/
test_events_devplane.py and test_client_wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import nacl.signing
import pytest

from plexd.base.backoff import Backoff
from plexd.base.clock import FakeClock
from plexd.controlplane import http_client
from plexd.controlplane.client import parse_retry_after
from plexd.controlplane.envelope import sign_event
from plexd.controlplane.event_signing import NonceStore, Verifier
from plexd.controlplane.event_stream import EventStream
from plexd.state.model import SigningKeys

NOW = datetime(2025, 1, 15, 10, 30, tzinfo=UTC)
KEY = nacl.signing.SigningKey.generate()


@dataclass
class Request:
    method: str
    url: str
    headers: http_client.Headers


def reply(status: int, headers: dict[str, str] | None = None,
          content: bytes | AsyncIterator[bytes] = b"") -> http_client.Response:
    """A scripted answer: `content` is the whole body, or an async iterator of its chunks."""
    async def once() -> AsyncIterator[bytes]:
        if content:
            yield content
    chunks = content if not isinstance(content, bytes) else once()
    return http_client.Response(httpx.Response(status, headers=headers or {}, stream=http_client.Chunks(chunks)))


class Server:
    """A scripted server: `respond(request, attempt_no)` returns a Response or raises."""

    def __init__(self, respond: Callable[[Request, int], http_client.Response]) -> None:
        self.respond = respond
        self.requests: list[Request] = []
        self.hang = asyncio.Event()  # streams that should stay open wait on this

    def handler(self, request: Request) -> http_client.Response:
        self.requests.append(request)
        return self.respond(request, len(self.requests))

    def open_stream(self, *chunks: bytes) -> http_client.Response:
        """200, send `chunks`, then stay open until `hang` is set."""
        async def body():
            for c in chunks:
                yield c
            await self.hang.wait()
        return reply(200, {"content-type": "text/event-stream"}, body())


class ScriptedClient:
    """What the stream needs of `http_client.HTTPClient`, answered by a Server."""

    def __init__(self, server: Server) -> None:
        self.server = server

    async def __aenter__(self) -> ScriptedClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, *, headers: dict[str, str]) -> AsyncIterator[http_client.Response]:
        answer = self.server.handler(Request(method, url, http_client.Headers(headers)))
        yield await answer if asyncio.iscoroutine(answer) else answer  # a coroutine: an answer that takes time


def make_stream(tmp_path, clock, server, **kw):
    calls = {"connected": 0, "auth": 0, "poll": 0, "events": []}

    def connected():
        calls["connected"] += 1

    async def auth():
        calls["auth"] += 1

    def poll():
        calls["poll"] += 1

    async def record_event(env):
        calls["events"].append(env.event_id)

    verifier = Verifier(SigningKeys(current=__import__("base64").b64encode(bytes(KEY.verify_key)).decode()),
                        NonceStore(clock), clock)
    kw.setdefault("backoff", Backoff(rand=lambda: 0.5))
    kw.setdefault("storm_backoff", Backoff(rand=lambda: 0.5))
    stream = EventStream(
        "http://cp.test", kw.pop("node_id", "n_1"), lambda: "secret-token", tmp_path, verifier,
        record_event,
        clock=clock, on_connected=connected, on_auth_failure=auth, poll=poll,
        client_factory=lambda: ScriptedClient(server),
        **kw,
    )
    return stream, calls


async def until(pred, limit=5000):
    for _ in range(limit):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def next_sleep(stream, n):
    """Wait until the engine has started its n-th wait between attempts, and return that delay."""
    clock = stream._clock
    await until(lambda: len(stream.delays) >= n and clock.pending_sleepers > 0)
    return stream.delays[n - 1]


@pytest.fixture
def clock():
    return FakeClock(NOW)


async def run(stream):
    task = asyncio.create_task(stream.run())
    return task


async def stop(task):
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def test_exponential_backoff_to_cap_without_jitter(tmp_path, clock):
    server = Server(lambda r, n: reply(503))
    stream, _ = make_stream(tmp_path, clock, server)
    task = await run(stream)
    try:
        delays = []
        for i in range(1, 10):
            delays.append(await next_sleep(stream, i))
            clock.advance(delays[-1])
        assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
        assert len(server.requests) == 9
    finally:
        await stop(task)


@pytest.mark.parametrize(("rand", "factor"), [(0.0, 0.75), (1.0, 1.25)])
async def test_jitter_bounds(tmp_path, clock, rand, factor):
    server = Server(lambda r, n: reply(500))
    stream, _ = make_stream(tmp_path, clock, server, backoff=Backoff(rand=lambda: rand))
    task = await run(stream)
    try:
        delays = []
        for i in range(1, 9):
            delays.append(await next_sleep(stream, i))
            clock.advance(delays[-1])
        assert delays == pytest.approx([b * factor for b in (1, 2, 4, 8, 16, 32, 60, 60)])
    finally:
        await stop(task)


async def test_random_jitter_stays_within_25_percent(tmp_path, clock):
    server = Server(lambda r, n: reply(500))
    stream, _ = make_stream(tmp_path, clock, server, backoff=Backoff())
    stream._poll = None  # polling would split the waits into chunks; this test looks at the backoff alone
    task = await run(stream)
    try:
        for i in range(1, 30):
            d = await next_sleep(stream, i)
            base = min(2 ** (i - 1), 60)
            assert 0.75 * base <= d <= 1.25 * base
            clock.advance(d)
    finally:
        await stop(task)


async def test_network_errors_back_off_too(tmp_path, clock):
    def respond(r, n):
        raise http_client.TransportError("cannot connect", "connection refused")
    stream, calls = make_stream(tmp_path, clock, Server(respond))
    task = await run(stream)
    try:
        assert [await next_sleep(stream, 1)] == [1]
        clock.advance(1)
        assert await next_sleep(stream, 2) == 2
        assert calls["connected"] == 0
    finally:
        await stop(task)


async def test_a_server_that_takes_the_request_and_never_answers_is_a_failed_attempt(tmp_path, clock, caplog):
    async def never():
        await asyncio.Event().wait()

    stream, calls = make_stream(tmp_path, clock, Server(lambda r, n: never()), idle_timeout=0.2)
    task = await run(stream)
    try:
        await asyncio.sleep(0.5)  # the deadline is the loop's real time, not the fake clock's
        assert await next_sleep(stream, 1) == 1  # backed off like any refusal
        assert calls["connected"] == 0
        assert any("no answer within 0.2 s" in r.getMessage() for r in caplog.records)
    finally:
        await stop(task)


async def test_reset_on_success_and_headers(tmp_path, clock):
    server = Server(lambda r, n: reply(503))
    stream, calls = make_stream(tmp_path, clock, server)
    task = await run(stream)
    try:
        for i in range(1, 4):
            clock.advance(await next_sleep(stream, i))
        # now the server comes back: one stream that ends cleanly, then failures again
        server.respond = lambda r, n: (
            reply(200, headers={"content-type": "text/event-stream"}, content=b": hi\n\n")
            if n == 4 else reply(503))
        assert await next_sleep(stream, 4) == 1  # reset: EOF reconnects at once, the 503 after it waits 1 s again
        assert calls["connected"] == 1
        req = server.requests[3]
        assert req.url == "http://cp.test/v1/nodes/n_1/events"
        assert req.headers["accept"] == "text/event-stream"
        assert req.headers["cache-control"] == "no-cache"
        assert req.headers["authorization"] == "Bearer secret-token"
        assert req.headers["user-agent"].startswith("plexd/")
        assert "last-event-id" not in req.headers
    finally:
        await stop(task)


async def test_429_waits_at_least_retry_after_spread_and_backs_off_without_it(tmp_path, clock):
    # Not the Go agent's exact hint (or its un-jittered current delay without one): a fleet turned away in one
    # second would all come back in one second. The backoff's rand is 0.5 here: jitter 0, spread x1.25.
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    script = {1: reply(503), 2: reply(429, headers={"retry-after": "7"}),
              3: reply(429, headers={"retry-after": date}), 4: reply(429), 5: reply(503)}
    server = Server(lambda r, n: script.get(n, reply(503)))
    stream, _ = make_stream(tmp_path, clock, server)
    task = await run(stream)
    try:
        assert await next_sleep(stream, 1) == 1
        clock.advance(1)
        assert await next_sleep(stream, 2) == 7 * 1.25  # never earlier than asked, spread over half as long again
        clock.advance(clock.sleeps[1])
        assert 28 * 1.25 <= await next_sleep(stream, 3) <= 31 * 1.25  # an HTTP-date too
        clock.advance(clock.sleeps[2])
        assert await next_sleep(stream, 4) == 8  # no Retry-After: the backoff goes on growing (1, 2, 4, 8)
        clock.advance(8)
        assert await next_sleep(stream, 5) == 16
    finally:
        await stop(task)


async def test_429_without_retry_after_is_jittered(tmp_path, clock):
    draws = iter([0.0, 1.0])
    stream, _ = make_stream(tmp_path, clock, Server(lambda r, n: reply(429)),
                            backoff=Backoff(rand=lambda: next(draws, 0.5)))
    task = await run(stream)
    try:
        assert await next_sleep(stream, 1) == 0.75  # 1 s -25 %
        clock.advance(0.75)
        assert await next_sleep(stream, 2) == 2.5  # 2 s +25 %
    finally:
        await stop(task)


def test_parse_retry_after():
    # The stream reads Retry-After with the API client's parser; these are the stream's cases.
    def at(epoch: float) -> datetime:
        return datetime.fromtimestamp(epoch, UTC)

    assert parse_retry_after("12", at(0)) == 12
    assert parse_retry_after(email.utils.formatdate(1000, usegmt=True), at(990)) == pytest.approx(10)
    assert parse_retry_after(email.utils.formatdate(1000, usegmt=True), at(2000)) == 0
    assert parse_retry_after("soon", at(0)) is None
    assert parse_retry_after(None, at(0)) is None


async def test_polling_after_five_minutes_and_back(tmp_path, clock):
    server = Server(lambda r, n: reply(503))
    stream, calls = make_stream(tmp_path, clock, server, poll_interval=60)
    task = await run(stream)
    try:
        elapsed = 0.0
        i = 0
        while elapsed < 300:
            i += 1
            d = await next_sleep(stream, i)
            assert not stream.polling and calls["poll"] == 0
            clock.advance(d)
            elapsed += d
        # the first failure after 5 minutes of failing switches to polling and polls at once
        await until(lambda: calls["poll"] == 1)
        assert stream.polling
        for expected_polls in (2, 3):
            await until(lambda: clock.pending_sleepers > 0)
            clock.advance(60)
            await until(lambda ep=expected_polls: calls["poll"] == ep)
        # the stream comes back: polling stops, the reconciler trigger fires
        server.respond = lambda r, n: server.open_stream(b": ping\n\n")
        for _ in range(5):
            if stream.connected.is_set():
                break
            await until(lambda: clock.pending_sleepers > 0)
            clock.advance(60)
            await asyncio.sleep(0)
        await until(stream.connected.is_set)
        assert not stream.polling
        assert calls["connected"] == 1
        polls = calls["poll"]
        clock.advance(80)  # less than the idle timeout: no poll while connected
        for _ in range(50):
            await asyncio.sleep(0)
        assert calls["poll"] == polls
    finally:
        server.hang.set()
        await stop(task)


async def test_storm_limit_on_clean_eof(tmp_path, clock):
    server = Server(lambda r, n: reply(200, headers={"content-type": "text/event-stream"}, content=b""))
    stream, calls = make_stream(tmp_path, clock, server, storm_burst=5, storm_window=60)
    task = await run(stream)
    try:
        assert await next_sleep(stream, 1) == 1  # five immediate reconnects, then the storm backoff starts
        assert len(server.requests) == 6
        clock.advance(1)
        assert await next_sleep(stream, 2) == 2
        clock.advance(2)
        assert await next_sleep(stream, 3) == 4
        assert calls["connected"] == 8
        clock.advance(4)
        assert await next_sleep(stream, 4) == 8  # still storming: no immediate reconnects until a healthy stream
    finally:
        await stop(task)


async def test_healthy_stream_ends_the_storm(tmp_path, clock):
    event = sign_event(KEY, "peer_added", "e1", {"id": "n_x"}, issued_at="2025-01-15T10:30:00Z", nonce="z")
    server = Server(lambda r, n: reply(
        200, headers={"content-type": "text/event-stream"},
        content=f"id: e1\ndata: {event}\n\n".encode() if n == 8 else b""))
    stream, calls = make_stream(tmp_path, clock, server, storm_burst=5, storm_window=60)
    task = await run(stream)
    try:
        clock.advance(await next_sleep(stream, 1))
        assert await next_sleep(stream, 2) == 2
        clock.advance(2)  # attempt 8 delivers an event: healthy, so attempts 9..13 are immediate again
        assert await next_sleep(stream, 3) == 1
        assert len(server.requests) == 14
        assert calls["events"] == ["e1"]
    finally:
        await stop(task)


async def test_storm_rate_is_bounded_over_time(tmp_path, clock):
    server = Server(lambda r, n: reply(200, headers={"content-type": "text/event-stream"}, content=b""))
    stream, _ = make_stream(tmp_path, clock, server, storm_burst=5, storm_window=60)
    task = await run(stream)
    try:
        total = 0.0
        i = 0
        while total < 3600:
            i += 1
            d = await next_sleep(stream, i)
            clock.advance(d)
            total += d
        # an hour of a server that closes every stream at once: at most a burst per window plus ~1/min
        assert len(server.requests) < 80
    finally:
        await stop(task)


async def test_401_asks_for_reauthentication_and_keeps_going(tmp_path, clock):
    tokens = iter(["old", "new", "new"])
    server = Server(lambda r, n: reply(401) if n == 1 else server.open_stream())
    stream, calls = make_stream(tmp_path, clock, server)
    stream._token = lambda: next(tokens)
    task = await run(stream)
    try:
        assert await next_sleep(stream, 1) == 1
        assert calls["auth"] == 1
        clock.advance(1)
        await until(stream.connected.is_set)
        assert server.requests[1].headers["authorization"] == "Bearer new"
    finally:
        server.hang.set()
        await stop(task)


async def test_a_registration_afresh_after_401_moves_the_stream_to_the_new_node_id(tmp_path, clock):
    # A 401 the node secret cannot answer ends in a fresh registration, which brings another node id: the stream
    # must ask for that node's events (it asked for the old id's for good, and polled for ever).
    ids = ["n_old"]
    server = Server(lambda r, n: reply(401) if n == 1 else server.open_stream())
    stream, _ = make_stream(tmp_path, clock, server, node_id=lambda: ids[-1])

    async def register_afresh():
        ids.append("n/new")  # escaped in the path like every other request's id
    stream._on_auth_failure = register_afresh
    task = await run(stream)
    try:
        assert await next_sleep(stream, 1) == 1
        clock.advance(1)
        await until(stream.connected.is_set)
        assert [r.url for r in server.requests] == ["http://cp.test/v1/nodes/n_old/events",
                                                    "http://cp.test/v1/nodes/n%2Fnew/events"]
    finally:
        server.hang.set()
        await stop(task)


@pytest.mark.parametrize("status", [403, 404])
async def test_403_404_back_off_at_cap_and_poll(tmp_path, clock, status):
    server = Server(lambda r, n: reply(status))
    stream, calls = make_stream(tmp_path, clock, server)
    task = await run(stream)
    try:
        await until(lambda: calls["poll"] == 1)
        assert stream.polling
        await until(lambda: clock.pending_sleepers > 0)
        clock.advance(60)
        await until(lambda: len(server.requests) == 2)
        assert calls["poll"] == 2
        assert stream.delays[0] == 60  # the cap (jitter source fixed at the midpoint)
    finally:
        await stop(task)


async def test_idle_watchdog_pings_count_as_liveness(tmp_path, clock):
    pinger = asyncio.Queue()

    async def body():
        while True:
            chunk = await pinger.get()
            if chunk is None:
                return
            yield chunk

    server = Server(lambda r, n: reply(200, headers={"content-type": "text/event-stream"},
                                                content=body()) if n == 1 else reply(503))
    stream, _ = make_stream(tmp_path, clock, server)
    task = await run(stream)
    try:
        await until(stream.connected.is_set)
        for _ in range(5):  # a ping every 60 s keeps a 90 s watchdog quiet for 5 minutes
            clock.advance(60)
            pinger.put_nowait(b": ping\n\n")
            await until(pinger.empty)
            for _ in range(20):
                await asyncio.sleep(0)
            assert stream.connected.is_set()
        clock.advance(91)  # silence
        await until(lambda: not stream.connected.is_set())
        assert len(server.requests) == 1
        clock.advance(await next_sleep(stream, 1))  # an idle stream counts as a failure: backoff, then retry
        await until(lambda: len(server.requests) == 2)
    finally:
        pinger.put_nowait(None)
        await stop(task)


async def test_cursor_persisted_dedupe_and_bad_events_skipped(tmp_path, clock, caplog):
    caplog.set_level(logging.INFO)
    def ev(eid, nonce):
        text = sign_event(KEY, "peer_added", eid, {"id": "n_x"}, issued_at="2025-01-15T10:30:00Z", nonce=nonce)
        return f"id: {eid}\ndata: {text}\n\n".encode()

    frames = (ev("e1", "a") + b"id: e2\ndata: {not json\n\n" + ev("e1", "a") + ev("e3", "b")
              + b"data: " + b"x" * (1 << 20) + b"\nid: e4\n\n" + ev("e5", "c"))
    server = Server(lambda r, n: server.open_stream(frames))
    stream, calls = make_stream(tmp_path, clock, server)
    task = await run(stream)
    try:
        await until(lambda: stream.last_event_id == "e5")
        assert calls["events"] == ["e1", "e3", "e5"]
        assert stream.ledger.stored()[0] is None  # noted, committed only by the group commit
        stream.ledger.commit(clock.now().timestamp())
        assert stream.ledger.stored() == ("e5", {"a", "b", "c"})
        assert "event e2 rejected [malformed]" in caplog.text
        assert "event e4 rejected [oversize]" in caplog.text
        assert "event e1 dropped: duplicate event id" in caplog.text
    finally:
        server.hang.set()
        await stop(task)
    # a new consumer (a restarted daemon) resumes from the persisted cursor
    server2 = Server(lambda r, n: server2.open_stream())
    stream2, _ = make_stream(tmp_path, clock, server2)
    task = await run(stream2)
    try:
        await until(stream2.connected.is_set)
        assert server2.requests[0].headers["last-event-id"] == "e5"
    finally:
        server2.hang.set()
        await stop(task)


async def test_fleet_synchronising_moments_are_spread(tmp_path, clock):
    """A stream that closes (a control plane restart closes every node's at once) reconnects at a random moment
    within reconnect_spread; a 503 that says Retry-After is retried within 1-1.5x of it. Other failures keep the
    lifecycle's schedule (docs/decisions.md, Lifecycle)."""
    event = sign_event(KEY, "peer_added", "e1", {"id": "n_x"}, issued_at="2025-01-15T10:30:00Z", nonce="s")
    healthy = reply(200, headers={"content-type": "text/event-stream"},
                             content=f"id: e1\ndata: {event}\n\n".encode())
    script = {1: healthy, 2: reply(503, headers={"retry-after": "4"}), 3: reply(503)}
    server = Server(lambda r, n: script.get(n, reply(503)))
    stream, _ = make_stream(tmp_path, clock, server, reconnect_spread=5.0, rand=lambda: 0.6)
    task = await run(stream)
    try:
        assert await next_sleep(stream, 1) == pytest.approx(3.0)  # 0.6 of the 5 s spread, not at once
        clock.advance(3.0)
        # Retry-After 4, spread by 0..50 % (the backoff's draw: 0.5 here)
        assert await next_sleep(stream, 2) == pytest.approx(4 * 1.25)
        clock.advance(4 * 1.25)
        assert await next_sleep(stream, 3) == 2  # a bare 503: the lifecycle's backoff (1 s, then 2 s)
    finally:
        await stop(task)


async def test_a_stream_waiting_out_its_backoff_tries_again_soon_once_the_control_plane_answers(tmp_path, clock):
    """Found by `python -m bench chaos` (cp_500, 30 s): the stream's backoff had grown to 32 s, so actions waited
    that long after the control plane was back. A heartbeat that goes through (`control_plane_answered`) ends the
    wait within the spread; without one the stream keeps its backoff, and a connected stream is left alone."""
    up = {"now": False}
    server = Server(lambda r, n: server.open_stream() if up["now"] else reply(500))
    stream, _ = make_stream(tmp_path, clock, server)
    stream._poll = None  # polling would split the waits into chunks; this test looks at the backoff alone
    task = await run(stream)
    try:
        for i in range(1, 7):
            delay = await next_sleep(stream, i)
            if i < 6:
                clock.advance(delay)
        assert delay == 32 and len(server.requests) == 6  # the outage grew the wait
        up["now"] = True
        stream.control_plane_answered(spread=0.01)  # the spread is real time: the loop's timer, not the clock's
        await until(lambda: stream.connected.is_set())
        assert len(server.requests) == 7 and stream.delays[-1] == 32  # tried again with 32 s still to wait
        stream.control_plane_answered(spread=0.01)
        await asyncio.sleep(0.05)
        assert stream.connected.is_set() and len(server.requests) == 7  # a connected stream is left alone
    finally:
        server.hang.set()
        await stop(task)
