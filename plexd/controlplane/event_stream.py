"""The signed event stream: ``GET /v1/nodes/{id}/events`` kept open for the life of the daemon (§2).

What the Go agent gets wrong and this engine does not (docs/decisions.md, SSE):
- no request timeout on the stream body (Go cuts it every 30 s); an application watchdog ends a stream that has
  been silent for 90 s, and the server's comment pings count as liveness;
- Last-Event-ID is persisted in ``data_dir/events.db`` (group-committed, see `plexd.controlplane.ledger`), so a
  restart resumes where it stopped;
- duplicate event ids are dropped; an oversize or undecodable event is logged and skipped, never re-read;
- 401 asks for re-registration and keeps going; 403/404 back off at the cap and keep polling — never silent;
- a clean end of stream reconnects at once, but a storm limit bounds how often (no hot loop).

Every successful (re)connect calls `on_connected` (the reconciler trigger: whatever happened while we were away is
picked up from the full state). After 5 minutes without a working stream, `poll()` is called every
`poll_interval` until the stream is back.

Both dialects go through the same engine; what differs per dialect (parsing, verification, what the handlers are
given, the cursor's form) is `plexd.controlplane.event_dialects`, chosen by `dialect()` at each frame and each
connection. The platform contract adds two answers of its own (docs/platform-dialect.md, delivery modes):
- ``501 signed_event_bus_not_provisioned``: pull-only at once, no backoff and no polling by the stream (the
  reconciler's periodic pull is the channel); the stream is probed again every `reprobe_interval`;
- ``400`` while a cursor was sent: the cursor is dropped and the stream opened again at once, from now.
`status()` names the delivery mode: streaming, pull_only or degraded_polling.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import plexd
from plexd.base import gojson
from plexd.base.backoff import Backoff
from plexd.base.clock import Clock
from plexd.base.errors import PlexdError
from plexd.config import datadir
from plexd.controlplane import http_client
from plexd.controlplane.client import _tls_context, parse_retry_after, path_escape
from plexd.controlplane.clock_hold import CLOCK_REASONS, ClockHold
from plexd.controlplane.envelope import Envelope
from plexd.controlplane.event_dialects import PlatformEvents, SignedEvents, SpecEvents, platform_events
from plexd.controlplane.event_signing import NONCE_STORE_FULL, EventRejected, Verifier
from plexd.controlplane.ledger import EventLedger
from plexd.controlplane.problem import parse_problem
from plexd.controlplane.sse import MAX_EVENT_BYTES, SSEEvent, read_events, valid_event_id

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 90.0
# Seconds between tries of the events held for this node's clock: a signature check each, and only while the clock
# is wrong; short, so a corrected clock lets them through at once (a fresh event the window takes does too).
HELD_RETRY = 1.0
POLLING_AFTER = 300.0  # seconds of continuous failure before polling the full state
RETRY_AFTER_MAX = 3600.0
SEEN_IDS_MAX = 4096
REPROBE_INTERVAL = 600.0  # pull-only: seconds between two tries of the stream (the platform's 10 minutes)
NOT_PROVISIONED = "signed_event_bus_not_provisioned"  # the platform's 501: no event stream, pull the state
MAX_PROBLEM_BYTES = 4096  # of a refusal's body, for its problem+json code (its first 200 bytes are logged)


def stream_http_client(ca_file: str = "", insecure_skip_verify: bool = False) -> http_client.HTTPClient:
    """The stream's own HTTP client: same TLS rules as the API client, connect 10 s, and no read/total timeout
    on the body: the idle watchdog decides when a stream is dead."""
    return http_client.HTTPClient(tls=_tls_context(ca_file, insecure_skip_verify), connect_timeout=10.0,
                             read_timeout=None, write_timeout=10.0)


class _Disconnected(PlexdError):
    """The stream was open and has ended (EOF, read error or idle watchdog)."""

    def __init__(self, why: str, idle: bool = False) -> None:
        super().__init__(why)
        self.idle = idle


class _Refused(PlexdError):
    """The stream could not be opened; `status` is the HTTP status or None for a network error."""

    def __init__(self, why: str, status: int | None = None, retry_after: float | None = None,
                 code: str = "") -> None:
        super().__init__(why)
        self.status = status
        self.retry_after = retry_after
        self.code = code  # the problem+json code (platform dialect), "" when none


class EventStream:
    def __init__(
        self,
        api: str,
        node_id: str | Callable[[], str],  # a provider: a fresh registration after a 401 brings another id
        token_provider: Callable[[], str],  # the current bearer (it changes after a re-registration)
        bookkeeping: EventLedger | Path | str,  # the ledger, or the data_dir to open one in
        verifier: Verifier,
        dispatch: Callable[[Envelope], Awaitable[None]],
        *,
        clock: Clock | None = None,
        on_connected: Callable[[], None] | None = None,  # e.g. trigger a reconcile (must not block)
        on_auth_failure: Callable[[], Awaitable[None]] | None = None,  # re-register after a 401
        poll: Callable[[], None] | None = None,  # ask for a full state pull while the stream is down
        on_clock_agrees: Callable[[], None] | None = None,  # the held events went through: pull the state too
        poll_interval: float = 60.0,
        client_factory: Callable[[], http_client.HTTPClient] = stream_http_client,
        backoff: Backoff | None = None,
        storm_backoff: Backoff | None = None,
        storm_burst: int = 5,
        storm_window: float = 60.0,
        idle_timeout: float = IDLE_TIMEOUT,
        polling_after: float = POLLING_AFTER,
        max_event_bytes: int = MAX_EVENT_BYTES,
        reconnect_spread: float = 0.0,
        rand: Callable[[], float] = random.random,
        dialect: str | Callable[[], str] = "spec",  # a provider: the registration settles it ("auto" is spec's)
        platform: PlatformEvents | None = None,  # the platform dialect's key ids (none known without it)
        reprobe_interval: float = REPROBE_INTERVAL,
    ) -> None:
        self._api = api.rstrip("/")
        self._node_id = node_id if callable(node_id) else (lambda: node_id)
        self._token = token_provider
        self.ledger = (bookkeeping if isinstance(bookkeeping, EventLedger)
                       else EventLedger(Path(bookkeeping) / datadir.EVENT_LEDGER))
        self._dialect = dialect if callable(dialect) else (lambda: dialect)
        self._spec = SpecEvents(verifier)
        self._platform = platform or platform_events(verifier, node_id=self._node_id)
        self._dispatch = dispatch
        self._clock = clock or Clock()
        self._on_connected = on_connected
        self._on_auth_failure = on_auth_failure
        self._poll = poll
        self._on_clock_agrees = on_clock_agrees
        self.poll_interval = poll_interval
        self._client_factory = client_factory
        self.backoff = backoff or Backoff()
        self._backing_off = False  # between a failed or closed connection and the next try
        # A separate backoff for clean-EOF storms: the main one is reset by every successful connect.
        self.storm_backoff = storm_backoff or Backoff(base=self.backoff.base, cap=self.backoff.cap)
        self._storm_burst = storm_burst
        self._storm_window = storm_window
        self._idle_timeout = idle_timeout
        self._polling_after = polling_after
        self._max_event_bytes = max_event_bytes
        self.reconnect_spread = reconnect_spread
        self._rand = rand

        self.last_event_id: str | None = self._load_last_event_id()
        self._seen_ids: OrderedDict[str, None] = OrderedDict()
        self._eof_times: deque[float] = deque()
        self._in_storm = False
        self._conn_started = 0.0
        self._conn_frames = 0
        self._failing_since: float | None = None
        self._last_activity = 0.0
        self.polling = False  # degraded: the stream asks for a state pull every poll_interval
        self.pull_only = False  # the platform has no event bus: the reconciler's pulls are the channel
        self.reprobe_interval = reprobe_interval
        self._next_poll = 0.0
        self.state_since = 0.0  # unix time connected/polling/offline last changed
        self._state_changed()
        self.last_event_at: float | None = None
        # Observable state, for tests, benches and `plexd status`.
        self.connected = asyncio.Event()
        self.connects = 0
        self.attempts = 0
        self.accepted = 0
        self.rejected = 0
        self.rejected_by_reason: collections.Counter[str] = collections.Counter()
        self.accepted_late = 0  # held for the clock, accepted later (after a pull that may be newer than them)
        self.polls = 0
        self.delays: deque[float] = deque(maxlen=256)  # recent waits between attempts
        self._reconnect = asyncio.Event()
        self._handling = asyncio.Lock()
        self.clock_hold = ClockHold()
        self._retrying: asyncio.Task[None] | None = None  # tries the held events again while there are any

    def _state_changed(self) -> None:
        self.state_since = self._clock.now().timestamp()

    def status(self) -> dict[str, Any]:
        """For `plexd status`: connected / polling / offline, since when, the delivery mode, the last event."""
        state = "connected" if self.connected.is_set() else "polling" if self.polling or self.pull_only else "offline"
        now = self._clock.now().timestamp()
        return {"state": state, "since": self.state_since, "delivery_mode": self.delivery_mode,
                "dialect": self._events().name, "last_event_id": self.last_event_id,
                "last_event_at": self.last_event_at,
                "last_event_age_seconds": None if self.last_event_at is None else round(now - self.last_event_at, 1),
                "connects": self.connects, "events_accepted": self.accepted, "events_rejected": self.rejected,
                "events_held_for_clock": len(self.clock_hold),
                "clock_offset_seconds": None if not self.clock_hold else round(-(self.clock_hold.offset or 0.0))}

    @property
    def gaps(self) -> int:
        """Events whose change may not be in the model as the control plane meant it: refused, skipped, failed in
        their handler, or accepted late from the clock hold (old news, maybe older than the last pull)."""
        return self.rejected + self.accepted_late

    @property
    def continuity(self) -> tuple[str, int, int] | None:
        """None while not connected; else a value that changes whenever an event may have been missed (another
        node id, a new connection, a gap): a state pulled while it holds is still the control plane's, with the
        events since (`plexd.services.pull_freshness`)."""
        return (self._node_id(), self.connects, self.gaps) if self.connected.is_set() else None

    @property
    def delivery_mode(self) -> str:
        """streaming (connected, or trying to), pull_only (no event bus) or degraded_polling (no working stream
        for `polling_after`: polling the state meanwhile)."""
        return "pull_only" if self.pull_only else "degraded_polling" if self.polling else "streaming"

    def _events(self) -> SignedEvents:
        return self._platform if self._dialect() == self._platform.name else self._spec

    # ---------------------------------------------------------------------------------------------------------
    # Cursor

    @property
    def node_id(self) -> str:
        return self._node_id()

    @property
    def url(self) -> str:
        """Built at each connect, from the node id of now."""
        return f"{self._api}/v1/nodes/{path_escape(self.node_id)}/events"

    def _load_last_event_id(self) -> str | None:
        text = self.ledger.cursor
        if text and not valid_event_id(text):
            log.warning("ignoring the stored event cursor in %s: not a usable event id (%r)", self.ledger.path,
                        text[:40])
            return None
        return text or None

    def _advance_cursor(self, event_id: str | None, nonce: str | None = None, issued_at: float = 0.0) -> None:
        events = self._events()
        if event_id is not None and event_id != self.last_event_id and not events.usable_cursor(event_id):
            log.warning("event id %r is not usable as a replay cursor (%s); the cursor stays at %s", event_id[:40],
                        events.cursor_rule, self.last_event_id or "nothing")
            event_id = None
        if event_id == self.last_event_id:
            event_id = None
        if event_id is not None:
            self.last_event_id = event_id
            self.last_event_at = self._clock.now().timestamp()
        self.ledger.note(event_id, nonce, issued_at)  # committed together (plexd.controlplane.ledger)

    # ---------------------------------------------------------------------------------------------------------
    # Main loop

    async def run(self) -> None:
        """Keep the stream open until cancelled."""
        try:
            async with self._client_factory() as client:
                while True:
                    delay = await self._attempt(client)
                    if delay > 0:
                        self.delays.append(delay)
                        await self._wait(delay)
        finally:
            if self._retrying is not None:
                self._retrying.cancel()
                await asyncio.wait({self._retrying})

    async def _attempt(self, client: http_client.HTTPClient) -> float:
        """One connection attempt; returns how long to wait before the next one."""
        try:
            await self._stream_once(client)
            why = "stream ended"
            idle = False
        except _Disconnected as exc:
            why, idle = str(exc), exc.idle
        except _Refused as exc:
            return await self._refused(exc)
        finally:
            if self.connected.is_set():
                self._state_changed()
            self.connected.clear()
        if idle:
            # Treated like a failed attempt: the server is up but not talking to us.
            log.warning("event stream idle for %.0f s; reconnecting", self._idle_timeout)
            self._mark_failing()
            return self.backoff.next_delay()
        return self._after_disconnect(why)

    def _after_disconnect(self, why: str) -> float:
        """A stream that was open has ended: reconnect at once, unless closes come in a storm.

        A connection that delivered an event or lived a whole storm window was healthy: its close is normal and
        clears the storm state. Short, empty connections are counted; past `storm_burst` of them within
        `storm_window`, every further one waits a growing storm backoff until a healthy connection happens.
        """
        now = self._clock.monotonic()
        if self._conn_frames > 0 or now - self._conn_started >= self._storm_window:
            self._eof_times.clear()
            self._in_storm = False
            self.storm_backoff.reset()
            return self._spread(why)
        while self._eof_times and now - self._eof_times[0] > self._storm_window:
            self._eof_times.popleft()
        self._eof_times.append(now)
        if not self._in_storm and len(self._eof_times) <= self._storm_burst:
            return self._spread(why)
        self._in_storm = True
        delay = self.storm_backoff.next_delay()
        log.warning("event stream keeps closing without delivering anything (%s); reconnecting in %.1f s",
                    why, delay)
        return delay

    def _spread(self, why: str) -> float:
        """The first reconnect after a close: at a random moment within `reconnect_spread` (the missed events are
        replayed after the cursor). A control plane restart ends every node's stream at once; reconnecting at
        once would bring the whole fleet back in the same second."""
        delay = self._rand() * self.reconnect_spread
        log.info("event stream closed (%s); reconnecting in %.1f s", why, delay)
        return delay

    def _mark_failing(self) -> None:
        now = self._clock.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if not self.polling and self._poll is not None and now - self._failing_since >= self._polling_after:
            self._enter_polling(f"no working event stream for {now - self._failing_since:.0f} s")

    def _enter_polling(self, why: str) -> None:
        if self.polling or self._poll is None:
            return
        self.polling = True
        self._state_changed()
        self._next_poll = self._clock.monotonic()
        log.warning("%s; polling the full state every %s s until the stream is back", why, self.poll_interval)

    async def _refused(self, exc: _Refused) -> float:
        if self._events() is self._platform and (delay := self._platform_refusal(exc)) is not None:
            return delay
        self._leave_pull_only(f"the event stream answered: {exc}")
        status = exc.status
        if status == 401:
            log.warning("event stream refused with 401; re-authenticating the node")
            self._mark_failing()
            if self._on_auth_failure is not None:
                try:
                    await self._on_auth_failure()
                except Exception as err:  # re-registration failing must not kill the stream loop
                    log.warning("re-authentication after 401 failed: %s", err)
            return self.backoff.next_delay()
        if status in (403, 404):
            self._mark_failing()
            self._enter_polling(f"event stream refused with {status}")
            delay = self.backoff.jittered(self.backoff.cap)
            log.error("event stream refused with %d (%s); retrying in %.0f s", status, exc, delay)
            return delay
        if status == 429:
            self._mark_failing()
            delay = min(self.backoff.after_hint(exc.retry_after), RETRY_AFTER_MAX)
            log.warning("event stream rate limited (429); retrying in %.1f s", delay)
            return delay
        self._mark_failing()
        hint = exc.retry_after if status is not None and status >= 500 else None  # a control plane shedding load
        delay = min(self.backoff.after_hint(hint), RETRY_AFTER_MAX)
        log.warning("event stream unavailable (%s); retrying in %.1f s", exc, delay)
        return delay

    def _platform_refusal(self, exc: _Refused) -> float | None:
        """The platform contract's own answers: the delay before the next try, or None for those answered as the
        spec's are."""
        if exc.status == 501 and exc.code == NOT_PROVISIONED:
            return self._enter_pull_only()
        if self.pull_only and exc.status is None:  # the control plane is away: still nothing to stream from
            delay = self.backoff.jittered(self.reprobe_interval)
            log.info("event stream probe failed (%s); still pull-only, probing again in %.0f s", exc, delay)
            return delay
        if exc.status == 400 and self.last_event_id:
            log.warning("event stream refused the cursor %s (%s); resuming from now", self.last_event_id, exc)
            self.last_event_id = None  # the next accepted event's id replaces it in the ledger too
            return 0.0
        return None

    def _enter_pull_only(self) -> float:
        """No backoff and no polling here: the reconciler's periodic pull brings the state; the stream is only
        probed again, at a spread moment of every `reprobe_interval`."""
        if not self.pull_only:
            log.warning("the control plane has no signed event bus (501 %s): pull-only, the reconciler's state "
                        "pull is the channel; probing the event stream every %.0f s", NOT_PROVISIONED,
                        self.reprobe_interval)
            self.pull_only = True
            self.polling = False
            self._state_changed()
        self._failing_since = None
        self.backoff.reset()
        return self.backoff.jittered(self.reprobe_interval)

    def _leave_pull_only(self, why: str) -> None:
        if self.pull_only:
            self.pull_only = False
            self._state_changed()
            log.info("leaving pull-only: %s", why)

    async def _wait(self, delay: float) -> None:
        """Sleep `delay` seconds, polling the full state on schedule meanwhile when in polling mode."""
        self._backing_off = True
        try:
            await self._wait_out(delay)
        finally:
            self._backing_off = False

    async def _wait_out(self, delay: float) -> None:
        deadline = self._clock.monotonic() + delay
        while True:
            now = self._clock.monotonic()
            if self.polling and now >= self._next_poll:
                await self._do_poll()
                self._next_poll = self._clock.monotonic() + self.poll_interval
                now = self._clock.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return
            step = min(remaining, self._next_poll - now) if self.polling else remaining
            sleeper = asyncio.ensure_future(self._clock.sleep(max(step, 0.0)))
            asked = asyncio.ensure_future(self._reconnect.wait())
            try:
                await asyncio.wait({asked, sleeper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                asked.cancel()
                sleeper.cancel()
            if self._reconnect.is_set():  # asked to reconnect: try now instead of after the backoff
                self._reconnect.clear()
                return

    async def _do_poll(self) -> None:
        if self._poll is None:
            return
        self.polls += 1
        try:
            self._poll()
        except Exception as exc:
            log.warning("polling the full state failed: %s", exc)

    # ---------------------------------------------------------------------------------------------------------
    # One connection

    async def _headers(self) -> dict[str, str]:
        token = self._token()
        headers = {
            "Accept": "text/event-stream",
            "Cache-Control": "no-cache",
            "User-Agent": f"plexd/{plexd.__version__}",
        }
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if self.last_event_id and not self._events().usable_cursor(self.last_event_id):
            log.info("the stored event cursor %r is not one this control plane takes; resuming from now",
                     self.last_event_id[:40])
            self.last_event_id = None
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        return headers

    async def _stream_once(self, client: http_client.HTTPClient) -> None:
        self.attempts += 1
        headers = await self._headers()
        try:
            # Not httpx-sse's `aconnect_sse`: it overwrites Cache-Control with no-store (the wire says no-cache).
            # Its `EventSource` reads the frames (`read_events`), after the watchdog has seen every byte.
            async with contextlib.AsyncExitStack() as stack:
                try:
                    # The idle watchdog starts with the stream: until then a server (or a proxy) that takes the
                    # request and never answers, or stalls a refusal's body, is given as long, not forever.
                    async with asyncio.timeout(self._idle_timeout):
                        response = await stack.enter_async_context(client.stream("GET", self.url, headers=headers))
                        if not response.is_success:
                            raise await self._refusal(response)
                except TimeoutError:
                    raise _Refused(f"no answer within {self._idle_timeout:g} s") from None
                await self._connected_ok()
                await self._consume(response)
        except (_Refused, _Disconnected):
            raise
        except http_client.RequestFailed as exc:
            if self.connected.is_set():
                raise _Disconnected(str(exc)) from None
            raise _Refused(str(exc)) from None

    async def _refusal(self, response: http_client.Response) -> _Refused:
        platform = self._events() is self._platform
        raw = await response.aread(MAX_PROBLEM_BYTES if platform else 200, truncate=True)
        body = raw[:200].decode("utf-8", errors="replace").strip()
        code = parse_problem(response.headers.get("content-type", ""), raw).code if platform else ""
        return _Refused(f"HTTP {response.status_code}{': ' + body if body else ''}", response.status_code,
                        parse_retry_after(response.headers.get("retry-after"), datetime.now(UTC)), code)

    async def _connected_ok(self) -> None:
        self.connects += 1
        self._conn_started = self._clock.monotonic()
        self._conn_frames = 0
        self.backoff.reset()
        self._failing_since = None
        if self.polling:
            self.polling = False
            log.info("event stream is back; leaving polling mode")
        self._leave_pull_only("the event stream is back")
        self.connected.set()
        self._state_changed()
        log.info("event stream connected (resuming after %s)", self.last_event_id or "nothing")
        if self._on_connected is not None:
            try:
                self._on_connected()
            except Exception as exc:
                log.warning("on_connected callback failed: %s", exc)

    def reconnect(self) -> None:
        """Drop the current connection and connect again at once (``mesh.reconnect``)."""
        self._reconnect.set()

    def control_plane_answered(self, spread: float = 2.0) -> None:
        """Another request to the control plane (a heartbeat) just went through: a stream waiting out its backoff
        tries again within a random `spread` seconds instead. After a 30 s outage the backoff had grown to half a
        minute, and actions, which arrive only by the stream, waited that long (`python -m bench chaos`, cp_500).
        Nothing changes for a connected stream, or one not waiting, or a pull-only one (the answer is the 501)."""
        if not self._backing_off or self.connected.is_set() or self.pull_only:
            return

        def now() -> None:
            if self._backing_off and not self.connected.is_set():
                self._reconnect.set()

        asyncio.get_running_loop().call_later(random.uniform(0, spread), now)

    async def _consume(self, response: http_client.Response) -> None:
        self._last_activity = self._clock.monotonic()
        self._reconnect.clear()
        reader = asyncio.ensure_future(self._read(response))
        watchdog = asyncio.ensure_future(self._watchdog())
        asked = asyncio.ensure_future(self._reconnect.wait())
        try:
            done, _ = await asyncio.wait({reader, watchdog, asked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # asyncio.wait, not `await task`: suppressing the child's CancelledError would also swallow our own
            # cancellation (daemon shutdown) if it arrives right here.
            for task in (reader, watchdog, asked):
                task.cancel()
            await asyncio.wait({reader, watchdog, asked})
        if reader in done:
            reader.result()  # re-raises a read error
            return
        if asked in done:
            log.info("event stream: reconnecting as asked")
            raise _Disconnected("reconnect requested")
        raise _Disconnected("idle", idle=True)

    async def _watchdog(self) -> None:
        while True:
            silent = self._clock.monotonic() - self._last_activity
            if silent >= self._idle_timeout:
                return
            await self._clock.sleep(self._idle_timeout - silent)

    async def _read(self, response: http_client.Response) -> None:
        async for event in read_events(self._noting_activity(response), self._max_event_bytes):
            await self.handle_frame(event)

    async def _noting_activity(self, response: http_client.Response) -> AsyncIterator[bytes]:
        """The body's bytes as they come; each arrival, a comment ping included, is life for the idle watchdog."""
        async for chunk in response.aiter_bytes():
            self._last_activity = self._clock.monotonic()
            yield chunk

    # ---------------------------------------------------------------------------------------------------------
    # One event

    async def handle_frame(self, frame: SSEEvent) -> None:
        """Parse, dedupe, verify and dispatch one SSE block. Never raises: a bad event is logged and skipped."""
        self._conn_frames += 1
        events = self._events()
        nonce, issued = None, 0.0
        try:
            if frame.oversize:
                self._reject(frame.id, "oversize", f"event larger than {self._max_event_bytes} bytes, skipped")
                return
            try:
                env = events.parse(frame.data)
            except PlexdError as exc:
                self._reject(frame.id, "malformed", f"malformed envelope: {exc}")
                return
            if env.event_id in self._seen_ids:
                log.info("event %s dropped: duplicate event id", env.event_id,
                         extra={"event_id": env.event_id, "reason": "duplicate_event_id"})
                return
            try:
                events.verify(env)
            except EventRejected as exc:
                # Refused now, counted and logged as such; if only the window refused it, it is held until this
                # node's clock agrees (then handled, and counted as accepted too).
                self._reject(env.event_id, exc.reason, str(exc), env.event_type)
                if exc.reason in CLOCK_REASONS and events.authentic(env):
                    self.clock_hold.hold(env, len(frame.data), self._clock)
                    if self._retrying is None or self._retrying.done():
                        self._retrying = asyncio.create_task(self._retry_while_held(), name="events-held")
                return
            nonce, issued = env.nonce, gojson.parse_time(env.issued_at).timestamp()
            if self.clock_hold:  # the window took this one: the clock agrees again, so the older held ones go first
                await self.retry_held()
            await self._handle_verified(env)
        finally:
            # Advance the cursor even for refused events, so a poison event is never replayed to us in a loop. The
            # nonce is noted with it, after the handler ran: both are committed once the effect is durable.
            self._advance_cursor(frame.id, nonce, issued)

    async def _handle_verified(self, env: Any) -> None:
        """A verified envelope (of either dialect) handled: what the handlers understand of it, dispatched."""
        self._remember(env.event_id)
        async with self._handling:  # one event at a time: a held one tried again meets the stream's next
            try:
                handled = self._events().to_handlers(env)
                if handled is not None:
                    await self._dispatch(handled)
            except PlexdError as exc:
                self._reject(env.event_id, "bad_payload", str(exc), env.event_type)
                return
            except Exception:
                self.rejected += 1
                self.rejected_by_reason["handler_error"] += 1
                log.exception("event %s (%s): handler failed", env.event_id, env.event_type,
                              extra={"event_id": env.event_id, "reason": "handler_error"})
                return
            self.accepted += 1

    async def retry_held(self) -> None:
        """The events held for this node's clock (`plexd.controlplane.clock_hold`), tried again: each the window
        now takes goes through every check again and is handled; the rest stay held. When the last one goes, the
        clock agrees again: `on_clock_agrees` asks for a state pull, for whatever the hold dropped or never saw."""
        was_held = bool(self.clock_hold)
        events = self._events()
        for held in self.clock_hold.take(self._clock):
            env = held.envelope
            if env.event_id in self._seen_ids:
                continue
            try:
                events.verify(env)
            except EventRejected as exc:
                if exc.reason in CLOCK_REASONS:
                    self.clock_hold.put_back(held)
                else:  # the keys changed, or its nonce was seen meanwhile
                    self._reject(env.event_id, exc.reason, str(exc), env.event_type)
                continue
            log.info("event %s (%s) accepted: this node's clock now agrees with its issued_at %s", env.event_id,
                     env.event_type, env.issued_at, extra={"event_id": env.event_id})
            self.accepted_late += 1
            await self._handle_verified(env)
            self.ledger.note(None, env.nonce, gojson.parse_time(env.issued_at).timestamp())
        if was_held and not self.clock_hold and self._on_clock_agrees is not None:
            self._on_clock_agrees()

    async def _retry_while_held(self) -> None:
        while self.clock_hold:
            await self._clock.sleep(HELD_RETRY)
            await self.retry_held()

    def _reject(self, event_id: str | None, reason: str, message: str, event_type: str = "") -> None:
        self.rejected += 1
        self.rejected_by_reason[reason] += 1
        kind = f" ({event_type})" if event_type else ""
        if reason == NONCE_STORE_FULL:  # a flood: the nonce store logs one line a minute for all of them
            log.debug("event %s%s rejected [%s]: %s", event_id or "<no id>", kind, reason, message)
            return
        log.warning("event %s%s rejected [%s]: %s", event_id or "<no id>", kind, reason, message,
                    extra={"event_id": event_id, "event_type": event_type, "reason": reason})

    def _remember(self, event_id: str) -> None:
        self._seen_ids[event_id] = None
        while len(self._seen_ids) > SEEN_IDS_MAX:
            self._seen_ids.popitem(last=False)
