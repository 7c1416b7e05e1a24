"""Delivers the action outbox (acks, results, integrity violations) to the control plane, oldest first.

It runs as its own service, so a slow or absent control plane never holds up the event stream or a hook. A
message that fails for a transient reason stays at the head and is retried; one the control plane refuses for
good is dropped with one log line naming it, so it cannot block the queue (the one retry policy of
`plexd.controlplane.retry`: backoff, Retry-After, a 4xx other than 401/408/429 dropped). `flush` waits (bounded)
for the queue to empty: the drain at shutdown uses it so that ``cancelled`` results are delivered before the
daemon deregisters — and if they cannot be, they stay on disk and go out after the next start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from plexd.actions.journal import ActionJournal, JournalError, Message
from plexd.base.backoff import Backoff
from plexd.base.gojson import parse_time
from plexd.controlplane.errors import ControlPlaneError
from plexd.controlplane.retry import retry_verdict

if TYPE_CHECKING:
    from plexd.controlplane.client import ControlPlaneClient

log = logging.getLogger(__name__)

Send = Callable[[Message], Awaitable[None]]


class Outbox:
    def __init__(self, journal: ActionJournal, send: Send, *, backoff: Backoff | None = None) -> None:
        self.journal = journal
        self._send = send
        self.backoff = backoff or Backoff()
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self.sent = 0
        self.refused = 0
        self.last_error = ""
        self.last_sent_at: float | None = None

    def wake(self) -> None:
        """Something was queued: deliver it now (or after the current backoff)."""
        self._empty.clear()
        self._wake.set()

    async def run(self) -> None:
        while True:
            delay = await self._deliver_all()
            self._wake.clear()
            if delay is None:
                self._empty.set()
                await self._wake.wait()
            else:
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                except TimeoutError:
                    pass

    async def _deliver_all(self) -> float | None:
        """Send until the queue is empty (None) or a transient failure (the delay before the next try)."""
        while (message := self.journal.next_message()) is not None:
            try:
                await self._send(message)
            except ControlPlaneError as exc:
                verdict = retry_verdict(exc, self.backoff)
                if not verdict.retry:
                    self.refused += 1
                    log.warning("action %s for execution %s refused by the control plane: %s; dropped",
                                message.kind, message.execution_id, exc,
                                extra={"execution_id": message.execution_id})
                    self.journal.delivered(message.seq)
                    continue
                self.last_error = str(exc)
                self._note_attempt(message)
                log.warning("action %s for execution %s not delivered: %s; retrying in %.1fs", message.kind,
                            message.execution_id, exc, verdict.delay, extra={"execution_id": message.execution_id})
                return verdict.delay
            except JournalError as exc:
                log.error("%s", exc)
                return self.backoff.next_delay()
            self.journal.delivered(message.seq)
            self.sent += 1
            self.last_sent_at = time.time()
            self.last_error = ""
            self.backoff.reset()
        return None

    def _note_attempt(self, message: Message) -> None:
        try:
            self.journal.attempted(message.seq)
        except JournalError as exc:
            log.error("%s", exc)

    async def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is delivered, at most `timeout` seconds; True when it was."""
        if self.journal.outbox_size() == 0:
            return True
        self.wake()
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return self.journal.outbox_size() == 0
        return True

    def status(self) -> dict[str, Any]:
        return {"pending": self.journal.outbox_size(), "sent": self.sent, "refused": self.refused,
                "dropped_full": self.journal.dropped, "last_sent_at": self.last_sent_at,
                "last_error": self.last_error}


async def deliver(client: ControlPlaneClient, node_id: str, message: Message) -> None:
    """One outbox message as its control-plane call (§1.13 ack and result, §1.15 integrity violation)."""
    body = message.body
    if message.kind == "ack":
        await client.ack_execution(node_id, message.execution_id, body["status"], body["reason"])
    elif message.kind == "result":
        await client.report_result(node_id, message.execution_id, body)
    else:
        await client.report_integrity_violation(
            node_id, kind=body["type"], path=body["path"], expected_checksum=body["expected_checksum"],
            actual_checksum=body["actual_checksum"], detail=body["detail"], timestamp=parse_time(body["timestamp"]))
