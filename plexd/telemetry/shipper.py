"""Sends one telemetry stream's queue to the control plane, oldest first, one batch per POST.

Every report interval the whole queue is drained, batch after batch. The one retry policy decides what a failure
means (`plexd.controlplane.retry`): a transient one keeps the batch at the head and retries it with jittered
exponential backoff capped at the report interval (or after the server's Retry-After), so a control plane that
comes back gets the backlog within about one interval, and a fleet's retries spread out; a batch refused for
good (a 4xx other than 401/408/429) is dropped with one log line, so it cannot block the stream forever.

Quiet by design: an outage is one warning when it starts and one info line when the backlog is delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from plexd.base.backoff import Backoff
from plexd.base.gojson import EncodedJSON
from plexd.controlplane.errors import ControlPlaneError
from plexd.controlplane.retry import retry_verdict
from plexd.telemetry.queue import TelemetryQueue, encode

log = logging.getLogger(__name__)

Send = Callable[[EncodedJSON], Awaitable[None]]  # a JSON array of entries
# Entries to send ahead of the queue's (not stored in it), and what to call once they were taken.
Preface = Callable[[], tuple[list[dict[str, Any]], Callable[[], None]]]


class Shipper:
    def __init__(self, queue: TelemetryQueue, stream: str, send: Send, *, batch_size: int, interval: float,
                 backoff: Backoff | None = None, preface: Preface | None = None) -> None:
        self.queue, self.stream, self._send = queue, stream, send
        self.preface = preface
        self.batch_size, self.interval = batch_size, interval
        self.backoff = backoff or Backoff(base=min(1.0, interval), cap=interval)
        self.sent_entries = 0
        self.refused_entries = 0
        self.last_error = ""
        self.failing_since: float | None = None

    async def run(self) -> None:
        while True:
            delay = await self.drain()
            await asyncio.sleep(self.interval if delay is None else delay)

    async def drain(self) -> float | None:
        """Send until the queue is empty (None) or a transient failure (the jittered delay before a retry)."""
        while True:
            # Reading and forgetting a batch run off the event loop (JSON and SQLite, milliseconds at 1,000 entries).
            batch = await asyncio.to_thread(self.queue.batch, self.stream, self.batch_size)
            extra, taken = self.preface() if self.preface is not None else ([], _nothing)
            # Sent as stored: the queue's text is already the entry's compact JSON.
            entries = [encode(e) for e in extra] + (batch.texts if batch is not None else [])
            if not entries:
                return None
            count = len(extra) + (batch.count if batch is not None else 0)
            try:
                await self._send(EncodedJSON.array(entries))
            except ControlPlaneError as exc:
                verdict = retry_verdict(exc, self.backoff)
                if verdict.retry:
                    return self._failed(exc, verdict.delay)
                self.refused_entries += count
                log.warning("%s batch of %d entries refused by the control plane: %s; dropped", self.stream,
                            count, exc)
            else:
                self.sent_entries += count
                self._recovered()
            taken()
            if batch is not None:
                await asyncio.to_thread(self.queue.delivered, batch)

    def _failed(self, exc: ControlPlaneError, delay: float) -> float:
        self.last_error = str(exc)
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            pending = self.queue.status(self.stream)["pending"]
            log.warning("%s not delivered: %s; %d entries kept on disk, retrying", self.stream, exc, pending)
        return delay

    def _recovered(self) -> None:
        self.backoff.reset()
        if self.failing_since is not None:
            log.info("%s delivered again after %.0fs", self.stream, time.monotonic() - self.failing_since)
            self.failing_since = None
            self.last_error = ""

    def status(self) -> dict[str, Any]:
        return {**self.queue.status(self.stream), "sent": self.sent_entries, "refused": self.refused_entries,
                "last_error": self.last_error}


def _nothing() -> None:
    pass
