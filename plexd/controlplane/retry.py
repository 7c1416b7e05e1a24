"""The one retry policy for everything the node sends the control plane on its own (drift reports, action
results, node-API report sync, telemetry): "the control plane did not take it, now what?"

    network, 5xx, 408        retry, jittered exponential backoff
    429, 503+Retry-After     retry after the server's Retry-After, spread (Backoff.after_hint)
    401                      retry (the client's `authed` already re-authenticated once)
    any other 4xx            drop with one log line: it can never succeed, and retrying it forever would block
                             what queues behind it
"""

from __future__ import annotations

from dataclasses import dataclass

from plexd.base.backoff import Backoff
from plexd.controlplane.client_errors import AuthError, ControlPlaneError, RetryAfterError


@dataclass(frozen=True)
class Verdict:
    retry: bool
    delay: float = 0.0  # before the next attempt (retry only)
    reason: str = ""


def retry_verdict(exc: ControlPlaneError, backoff: Backoff) -> Verdict:
    """What to do with an entry the control plane did not take (see the module's table)."""
    if isinstance(exc, RetryAfterError):
        return Verdict(True, backoff.after_hint(exc.retry_after), str(exc))
    if refused_for_good(exc):
        return Verdict(False, reason=str(exc))
    return Verdict(True, backoff.next_delay(), str(exc))  # network, 5xx, 408, 401, an unclassified status


def refused_for_good(exc: ControlPlaneError) -> bool:
    """A 4xx other than 401, 408 and 429: sending the same request again can never succeed."""
    return (not isinstance(exc, (RetryAfterError, AuthError)) and exc.status != 408
            and 400 <= exc.status < 500)
