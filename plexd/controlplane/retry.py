"""The one retry policy for everything the node sends the control plane on its own (drift reports, action
results, node-API report sync, telemetry): "the control plane did not take it, now what?"

    network, 5xx, 408        retry, jittered exponential backoff
    429, 503+Retry-After     retry after the server's Retry-After (at least the backoff)
    401                      retry (the client's `authed` already re-authenticated once)
    any other 4xx            drop with one log line: it can never succeed, and retrying it forever would block
                             what queues behind it
"""

from __future__ import annotations

from dataclasses import dataclass

from plexd.base.backoff import Backoff
from plexd.controlplane.errors import AuthError, ControlPlaneError, RetryAfterError


@dataclass(frozen=True)
class Verdict:
    retry: bool
    delay: float = 0.0  # before the next attempt (retry only)
    reason: str = ""


def retry_verdict(exc: ControlPlaneError, backoff: Backoff) -> Verdict:
    """What to do with an entry the control plane did not take (see the module's table)."""
    status = exc.status
    if isinstance(exc, RetryAfterError):
        hint = exc.retry_after if exc.retry_after is not None else 0.0
        return Verdict(True, max(hint, backoff.next_delay()), str(exc))
    if isinstance(exc, AuthError) or status == 0 or status >= 500 or status == 408:
        return Verdict(True, backoff.next_delay(), str(exc))
    if 400 <= status < 500:
        return Verdict(False, reason=str(exc))
    return Verdict(True, backoff.next_delay(), str(exc))  # an unclassified status: the transient default
