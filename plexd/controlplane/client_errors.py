"""Typed errors of the control-plane client, classified as docs/protocol.md §1.1 does it.

    ControlPlaneError(PlexdError)        base: `status` (0 for network errors), `message` (short server text)
      ├── TransientError                 network error, 5xx and any unlisted status: retry with backoff
      │     └── BadResponseError         a 2xx whose body is not the expected JSON shape
      ├── AuthError                      401: the bearer is not (or no longer) accepted
      ├── RetryAfterError                429: wait `retry_after` seconds (None when the server gave no hint)
      └── PermanentError                 403 and 404: stop, retrying will not help
            └── AlreadySettled           the control plane is past it already (nothing lost by dropping it)

Registration also treats 400 and 409 as fatal; it reads `.status` for that (they arrive as TransientError, the
generic class of §1.1).
"""

from __future__ import annotations

from plexd.base.errors import PlexdError

# How much of an error body we keep: enough to explain, never a whole HTML page in a log line.
_MESSAGE_LIMIT = 300


class ControlPlaneError(PlexdError):
    """A call to the control plane failed. `str(err)` is one operator-facing line."""

    def __init__(self, what: str, status: int = 0, message: str = "", code: str = "") -> None:
        self.status = status
        self.message = _short(message)
        self.what = what
        # The platform contract's machine-readable reason (plexd.controlplane.problem); "" from a spec server.
        self.code = code
        self.problem = False  # the answer was problem+json: the platform contract answered
        detail = f"HTTP {status}" if status else "no response"
        if code:
            detail += f" {code}"
        if self.message:
            detail += f": {self.message}"
        super().__init__(f"{what} failed ({detail})")


class TransientError(ControlPlaneError):
    """Worth retrying with backoff: the network, a 5xx, or a status §1.1 does not classify."""


class BadResponseError(TransientError):
    """The control plane answered 2xx with a body we cannot use (empty, not JSON, wrong shape)."""


class AuthError(ControlPlaneError):
    """401: the bootstrap token or node secret was refused."""


class RetryAfterError(ControlPlaneError):
    """429, or a 503 with Retry-After: the server asked us to slow down. `retry_after` is seconds, or None when it
    gave no usable hint."""

    def __init__(self, what: str, status: int = 429, message: str = "", retry_after: float | None = None,
                 code: str = "") -> None:
        self.retry_after = retry_after
        super().__init__(what, status, message, code)


class PermanentError(ControlPlaneError):
    """403 or 404: the control plane will not do this for us; retrying the same request is pointless."""


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 1] + "…"


class AlreadySettled(PermanentError):
    """The control plane is past what this report says (an execution it already has the outcome of): dropping the
    report loses nothing, so it is said at info level."""
