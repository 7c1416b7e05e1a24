"""Liveness: ``POST /v1/nodes/{id}/heartbeat`` with real values in the [C] shape (docs/protocol.md §1.4).

The first heartbeat goes out at start, then one per `interval` on a fixed schedule (no drift). The response's
``reconcile:true`` asks for a reconcile now; ``rotate_keys:true`` for a WireGuard key rotation
(`plexd.node.key_rotation`; without one wired in, a reconcile, which fetches keys rotated elsewhere). A 401 starts
re-authentication. Three consecutive failures log one warning; the recovery is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from plexd.base import gojson
from plexd.base.clock import Clock
from plexd.controlplane.client import HeartbeatRequest, MeshInfo, NatInfo

__all__ = ["HeartbeatService", "HeartbeatSnapshot", "MeshInfo", "NatInfo", "http_status"]

log = logging.getLogger(__name__)

WARN_AFTER_FAILURES = 3


@dataclass(frozen=True)
class HeartbeatSnapshot:
    status: str = "healthy"
    binary_checksum: str = ""  # bare lowercase hex
    mesh: MeshInfo | None = None
    nat: NatInfo | None = None
    status_reason: str = ""  # why the status is degraded (sent only then)
    extra: Mapping[str, Any] = field(default_factory=dict)  # bridge / user_access / ingress / site_to_site objects


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (`status`, `status_code`, or its `response`.s), whatever raised it."""
    for attr in ("status", "status_code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None)
    return value if isinstance(value, int) else None


class FailureStreak:
    """Heartbeats failed since the last accepted one: made before the heartbeat, for the parts built before it
    that ask whether the control plane answers (a bridge's relay keeps its sessions through an outage)."""

    def __init__(self) -> None:
        self.count = 0

    def reachable(self) -> bool:
        return self.count == 0


class HeartbeatService:
    def __init__(
        self,
        node_id: str | Callable[[], str],  # a provider: a fresh registration after a 401 brings another id
        send: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],  # POSTs the body, returns the response flags
        snapshot: Callable[[], HeartbeatSnapshot],
        *,
        clock: Clock | None = None,
        interval: float = 30.0,
        trigger_reconcile: Callable[[str], None] | None = None,
        rotate_keys: Callable[[str], None] | None = None,
        on_auth_failure: Callable[[], Awaitable[None]] | None = None,
        uptime: Callable[[], float] | None = None,  # seconds since the daemon started; default: since this service
        refresh: Callable[[], Awaitable[None]] | None = None,  # read live values (the device) before a snapshot
        streak: FailureStreak | None = None,  # shared with what asks whether the control plane answers now
    ) -> None:
        self._node_id = node_id if callable(node_id) else (lambda: node_id)
        self._send = send
        self._snapshot = snapshot
        self._clock = clock or Clock()
        self.interval = interval
        self._trigger_reconcile = trigger_reconcile
        self._rotate_keys = rotate_keys
        self._on_auth_failure = on_auth_failure
        self._started = self._clock.monotonic()
        self._uptime = uptime or (lambda: self._clock.monotonic() - self._started)
        self._refresh = refresh
        self.streak = streak or FailureStreak()
        self.failures = 0  # in all, for the metrics
        self.sent = 0
        self._warned = False
        self.last_at: float | None = None  # unix time of the last attempt
        self.last_error = ""  # "" when the last attempt was accepted

    @property
    def consecutive_failures(self) -> int:
        return self.streak.count

    @consecutive_failures.setter
    def consecutive_failures(self, value: int) -> None:
        self.streak.count = value

    @property
    def node_id(self) -> str:
        return self._node_id()

    def build(self) -> dict[str, Any]:
        """The heartbeat body, keys in the Go struct's order, omitempty sections left out."""
        snap = self._snapshot()
        return HeartbeatRequest(
            node_id=self.node_id,
            timestamp=self._clock.now(),
            status=snap.status,
            uptime=gojson.format_duration(int(self._uptime())),
            binary_checksum=snap.binary_checksum,
            mesh=snap.mesh,
            nat=snap.nat if snap.nat is not None and snap.nat.public_endpoint else None,
            status_reason=snap.status_reason,
            extra=snap.extra,
        ).to_wire()

    async def run(self) -> None:
        """Send one heartbeat now, then one per interval, until cancelled."""
        next_at = self._clock.monotonic()
        while True:
            await self.beat()
            next_at += self.interval
            now = self._clock.monotonic()
            if next_at <= now:  # we fell behind (a slow send); skip missed ticks rather than bursting
                next_at = now + self.interval
            await self._clock.sleep(next_at - now)

    async def beat(self) -> bool:
        """Send one heartbeat and act on the answer. Returns True when it was accepted."""
        self.last_at = self._clock.now().timestamp()
        try:
            if self._refresh is not None:
                await self._refresh()
            body = self.build()
            response = await self._send(body)
        except Exception as exc:
            self.last_error = str(exc) or type(exc).__name__
            await self._failed(exc)
            return False
        self.last_error = ""
        self.sent += 1
        if self.consecutive_failures and self._warned:
            log.info("heartbeat recovered after %d failures", self.consecutive_failures)
        self.consecutive_failures = 0
        self._warned = False
        if not isinstance(response, dict):
            log.warning("heartbeat response is not a JSON object: %r", response)
            return True
        if response.get("reconcile") is True:
            self._reconcile("heartbeat asked for reconcile")
        if response.get("rotate_keys") is True:
            if self._rotate_keys is not None:
                self._rotate_keys("the heartbeat response asked for it")
            else:
                self._reconcile("heartbeat asked for key rotation")
        return True

    def status(self) -> dict[str, Any]:
        return {"last_at": self.last_at, "ok": None if self.last_at is None else not self.last_error,
                "error": self.last_error, "consecutive_failures": self.consecutive_failures, "sent": self.sent,
                "interval_seconds": self.interval}

    def _reconcile(self, reason: str) -> None:
        if self._trigger_reconcile is not None:
            self._trigger_reconcile(reason)

    async def _failed(self, exc: Exception) -> None:
        self.consecutive_failures += 1
        self.failures += 1
        status = http_status(exc)
        if status == 401:
            log.warning("heartbeat refused with 401; re-authenticating the node")
            if self._on_auth_failure is not None:
                try:
                    await self._on_auth_failure()
                except Exception as err:
                    log.warning("re-authentication after heartbeat 401 failed: %s", err)
            return
        if self.consecutive_failures == WARN_AFTER_FAILURES:
            self._warned = True
            log.warning("heartbeat failed %d times in a row, last error: %s", self.consecutive_failures, exc)
        else:
            log.debug("heartbeat failed (%d in a row): %s", self.consecutive_failures, exc)
