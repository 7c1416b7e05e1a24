"""Delivers the action messages (acks, results, integrity violations) to the control plane, oldest first: the
``actions`` lane of the uplink outbox, which the journal fills in the transactions that record executions.

The uplink outbox's service delivers it, so a slow or absent control plane never holds up the event stream or a
hook, and its one retry policy decides what a failure means: a transient one keeps the message at the head and
retries it (backoff, Retry-After); one the control plane refuses for good is dropped with one log line naming it,
so it cannot block the lane. `flush` waits (bounded) for the lane to empty: the drain at shutdown uses it so that
``cancelled`` results are delivered before the daemon deregisters — and if they cannot be, they stay on disk and
go out after the next start.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from plexd.actions.journal import LANE, ActionJournal, Message
from plexd.base.backoff import Backoff
from plexd.base.gojson import parse_time
from plexd.controlplane.uplink import Entry

if TYPE_CHECKING:
    from plexd.controlplane.client import ControlPlaneClient

Send = Callable[[Message], Awaitable[None]]


class Outbox:
    """The journal's lane of the uplink outbox, sent with `send`; what the dispatcher and the status see of it."""

    def __init__(self, journal: ActionJournal, send: Send, *, backoff: Backoff | None = None) -> None:
        self.journal = journal
        self.uplink = journal.uplink
        self._send = send
        self.last_sent_at: float | None = None
        self.uplink.add_lane(LANE, self._deliver, backoff=backoff)

    async def _deliver(self, entries: Sequence[Entry]) -> None:
        for entry in entries:
            await self._send(Message.of(entry))
            self.last_sent_at = time.time()

    async def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is delivered, at most `timeout` seconds; True when it was."""
        return await self.uplink.flush(timeout, LANE)

    def status(self) -> dict[str, Any]:
        return {**self.uplink.status(LANE), "last_sent_at": self.last_sent_at}


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
