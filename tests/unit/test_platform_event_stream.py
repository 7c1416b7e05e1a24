"""The event stream's connections in the platform dialect, over a real socket: an HTTP server on 127.0.0.1 answers
the events route as the platform does (problem+json refusals, `id:` a decimal sequence), the real EventStream and
its HTTP client talk to it. Waits between attempts go through FakeClock, so the delays are read, not slept.

    501 signed_event_bus_not_provisioned   pull-only at once: no backoff, no polling by the stream, a probe
                                           every 10 minutes, and nothing else (a heartbeat does not bring it sooner)
    400 while a cursor was sent            the cursor is dropped and the stream opened again at once
    the cursor sent back                   the frame's `id:`, never the envelope's id
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import nacl.signing
import pytest

from plexd.base.backoff import Backoff
from plexd.base.clock import FakeClock
from plexd.base.gojson import format_time
from plexd.controlplane.event_dialects import platform_events
from plexd.controlplane.event_signing import NonceStore, Verifier
from plexd.controlplane.event_stream import REPROBE_INTERVAL, EventStream
from plexd.controlplane.ledger import EventLedger
from plexd.controlplane.platform_envelope import sign_event
from plexd.node.status_text import format_status
from plexd.state.model import SigningKeys

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
KEY = nacl.signing.SigningKey.generate()
KEY_B64 = base64.b64encode(bytes(KEY.verify_key)).decode()
KEY_ID = "did:web:cp.test#key-1"


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stay_open: bool = False  # an event stream: the body, then the connection held until the test ends


def problem(status: int, code: str) -> Answer:
    body = json.dumps({"type": f"https://api.test/problems/{code}", "title": code, "status": status,
                       "detail": f"{code} (test)", "code": code}).encode()
    return Answer(status, {"Content-Type": "application/problem+json"}, body)


def events(*frames: bytes) -> Answer:
    return Answer(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}, b"".join(frames), True)


def sse_frame(seq: int, event_id: str, event_type: str = "node_state_updated") -> bytes:
    data = sign_event(KEY, event_id, event_type, {"revision": seq}, key_id=KEY_ID, scope="node:n_1",
                      issued_at=format_time(NOW))
    return f"id: {seq}\nevent: {event_type}\ndata: {data}\n\n".encode()


class ControlPlane:
    """The events route on a real socket; `answer(headers)` says what each request gets."""

    def __init__(self, answer: Callable[[dict[str, str]], Answer]) -> None:
        self.answer = answer
        self.requests: list[dict[str, str]] = []
        self.closed = asyncio.Event()  # ends the streams held open
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> ControlPlane:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.closed.set()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            assert head[0].startswith("GET /v1/nodes/n_1/events "), head[0]
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
            self.requests.append(headers)
            answer = self.answer(headers)
            lines = [f"HTTP/1.1 {answer.status} X", *(f"{k}: {v}" for k, v in answer.headers.items())]
            lines += ["Connection: close"] if answer.stay_open else [f"Content-Length: {len(answer.body)}"]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + answer.body)
            await writer.drain()
            if answer.stay_open:
                await self.closed.wait()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@dataclass
class Calls:
    connected: int = 0
    polls: int = 0
    events: list[str] = field(default_factory=list)


def make_stream(cp: ControlPlane, tmp_path, clock: FakeClock, dialect: str = "platform") -> tuple[EventStream, Calls]:
    calls = Calls()
    verifier = Verifier(SigningKeys(current=KEY_B64), NonceStore(clock), clock)

    async def dispatch(env) -> None:
        calls.events.append(f"{env.event_type} {env.event_id}")

    def connected() -> None:
        calls.connected += 1

    def poll() -> None:
        calls.polls += 1

    stream = EventStream(cp.url, "n_1", lambda: "nsk_plexd_token", tmp_path, verifier, dispatch, clock=clock,
                         on_connected=connected, poll=poll, dialect=dialect,
                         platform=platform_events(verifier, tmp_path, lambda: (KEY_B64, KEY_ID)),
                         backoff=Backoff(rand=lambda: 0.5), storm_backoff=Backoff(rand=lambda: 0.5))
    return stream, calls


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def settled(clock: FakeClock) -> None:
    """The stream has nothing left to do but wait on the clock."""
    await until(lambda: clock.pending_sleepers > 0)
    await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running(stream: EventStream):
    task = asyncio.create_task(stream.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.wait({task})


@pytest.fixture
def clock():
    return FakeClock(NOW)


async def test_an_unprovisioned_bus_is_pull_only_at_once_and_probed_every_ten_minutes(tmp_path, clock):
    async with ControlPlane(lambda h: problem(501, "signed_event_bus_not_provisioned")) as cp:
        stream, calls = make_stream(cp, tmp_path, clock)
        async with running(stream):
            await until(lambda: stream.pull_only)
            await settled(clock)
            assert len(cp.requests) == 1 and list(stream.delays) == [REPROBE_INTERVAL]  # no backoff first
            status = stream.status()
            assert (status["delivery_mode"], status["state"], status["dialect"]) == ("pull_only", "polling",
                                                                                     "platform")

            stream.control_plane_answered(spread=0)  # a heartbeat went through: still nothing to stream from
            for _ in range(9):  # nine minutes: past the 5 minutes after which a failing stream starts polling
                clock.advance(60)
                await asyncio.sleep(0.02)
            assert len(cp.requests) == 1 and calls.polls == 0 and stream.polls == 0

            for probes in (2, 3, 4):  # one probe per interval, the mode kept, never a storm
                clock.advance(REPROBE_INTERVAL)
                await until(lambda probes=probes: len(cp.requests) == probes)
                await settled(clock)
            assert stream.pull_only and calls.polls == 0 and calls.connected == 0
            assert list(stream.delays) == [REPROBE_INTERVAL] * 4

            cp.answer = lambda h: events()  # the bus is provisioned: the next probe streams
            clock.advance(REPROBE_INTERVAL)
            await until(stream.connected.is_set)
            assert not stream.pull_only and stream.status()["delivery_mode"] == "streaming"
            assert stream.status()["state"] == "connected" and calls.connected == 1  # one reconcile per connect


async def test_a_501_with_another_code_is_an_outage_like_any_5xx(tmp_path, clock):
    async with ControlPlane(lambda h: problem(501, "not_implemented")) as cp:
        stream, _ = make_stream(cp, tmp_path, clock)
        async with running(stream):
            await until(lambda: len(stream.delays) == 1)
            assert not stream.pull_only and stream.delays[0] == 1.0  # the backoff's first step


async def test_the_spec_dialect_knows_no_pull_only(tmp_path, clock):
    async with ControlPlane(lambda h: problem(501, "signed_event_bus_not_provisioned")) as cp:
        stream, _ = make_stream(cp, tmp_path, clock, dialect="spec")
        async with running(stream):
            await until(lambda: len(stream.delays) == 1)
            assert not stream.pull_only and stream.delays[0] == 1.0
            assert stream.status()["delivery_mode"] == "streaming" and stream.status()["dialect"] == "spec"


def stored_cursor(tmp_path, cursor: str) -> None:
    ledger = EventLedger(tmp_path / "events.db")
    ledger.note(cursor)
    ledger.close(NOW.timestamp())


async def test_a_refused_cursor_is_dropped_and_the_stream_opened_again_at_once(tmp_path, clock):
    stored_cursor(tmp_path, "17")  # the platform lost its buffer: it answers 400 to a sequence it never issued

    def answer(headers: dict[str, str]) -> Answer:
        if headers.get("last-event-id") == "17":
            return problem(400, "invalid_cursor")
        return events(sse_frame(18, "evt-9f2a1c"))

    async with ControlPlane(answer) as cp:
        stream, calls = make_stream(cp, tmp_path, clock)
        async with running(stream):
            await until(lambda: stream.last_event_id == "18")
            assert [r.get("last-event-id") for r in cp.requests] == ["17", None]
            assert list(stream.delays) == []  # no wait in between
            assert calls.connected == 1 and calls.events == ["policy_updated evt-9f2a1c"]

            cp.closed.set()  # the platform ends the stream: the next one resumes after the frame's id
            cp.closed = asyncio.Event()
            await until(lambda: len(cp.requests) == 3)
            assert cp.requests[2]["last-event-id"] == "18"  # the sequence, not the envelope id


async def test_a_400_without_a_cursor_backs_off(tmp_path, clock):
    async with ControlPlane(lambda h: problem(400, "bad_request")) as cp:
        stream, _ = make_stream(cp, tmp_path, clock)
        async with running(stream):
            await until(lambda: len(stream.delays) == 1)
            assert len(cp.requests) == 1 and stream.delays[0] == 1.0


async def test_a_stored_cursor_that_is_no_sequence_is_not_sent(tmp_path, clock):
    stored_cursor(tmp_path, "evt_5")  # an envelope id, kept by an older plexd
    async with ControlPlane(lambda h: events()) as cp:
        stream, _ = make_stream(cp, tmp_path, clock)
        async with running(stream):
            await until(stream.connected.is_set)
            assert "last-event-id" not in cp.requests[0] and stream.last_event_id is None


def test_plexd_status_names_the_delivery_mode():
    doc = {"node": {"registered": True, "node_id": "n_1", "mesh_ip": "10.100.0.1"},
           "daemon": {"running": True, "pid": 1, "uptime_seconds": 5},
           "event_stream": {"state": "polling", "since": 0.0, "delivery_mode": "pull_only", "last_event_id": None,
                            "last_event_at": None},
           "reconcile": {"hold": None, "last": None}, "heartbeat": {"ok": None, "last_at": None},
           "peers": {"desired": 0, "on_device": None, "rejected": 0}, "services": []}
    text = format_status(doc, now=10.0)
    assert "delivery mode:  pull_only" in text
    assert "offline" not in text  # not offline: the reconciler pulls the state
