"""Supervision: a service that crashes is restarted; the daemon, its tunnels and the other services keep running.

Like an Erlang one-for-one supervisor (or kopf's daemon restarts): each service is a coroutine function run in a
loop. An unexpected exception is logged once with its traceback and the service is started again after a
jittered backoff (1 s doubling to 60 s, back to 1 s once a run has stayed up for a healthy minute). Restarts are
counted and shown in `plexd status`. Only a `FatalError` — something no restart can fix, such as an identity the
control plane refuses with no token to register afresh — ends the daemon, with one clear line.

Tests can make a service fail on purpose: ``PLEXD_TEST_FAULTS=events,heartbeat`` (read once at start) makes each
named service raise `InjectedFault` once, ``PLEXD_TEST_FAULT_AFTER`` seconds (default 2) after it first
started, or, with ``PLEXD_TEST_FAULT_FILE=PATH``, once that file exists (a test fires the faults when its setup
is done, whatever the machine's speed); ``wedge:NAME`` instead blocks the whole event loop from inside that
service (a bug that never yields), which is what the systemd watchdog is for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from plexd.base.backoff import Backoff
from plexd.base.clock import Clock
from plexd.base.errors import PlexdError

log = logging.getLogger(__name__)

HEALTHY_AFTER = 60.0
FAULTS_ENV = "PLEXD_TEST_FAULTS"
FAULT_AFTER_ENV = "PLEXD_TEST_FAULT_AFTER"
FAULT_FILE_ENV = "PLEXD_TEST_FAULT_FILE"


class FatalError(PlexdError):
    """A condition no restart can fix: `plexd up` ends with this message and a non-zero exit."""


class InjectedFault(RuntimeError):
    """Raised inside a service by the test-only fault hook. Not a `PlexdError`, on purpose: it stands for a bug,
    so the supervisor logs it as a crash, with its traceback (the path the fault tests exercise)."""


@dataclass
class ServiceHealth:
    name: str
    state: str = "starting"  # starting | running | restarting | done | failed
    restarts: int = 0
    last_error: str = ""
    last_error_at: float | None = None  # unix time
    running_since: float | None = None  # unix time of the current run's start

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "restarts": self.restarts, "last_error": self.last_error,
                "last_error_at": self.last_error_at, "running_since": self.running_since}


@dataclass
class FaultPlan:
    """Which services raise once, and when (test hook; empty in production)."""

    services: set[str] = field(default_factory=set)
    after: float = 2.0
    wedges: set[str] = field(default_factory=set)
    trigger_file: str = ""  # when set: the faults fire once this file exists, not `after` seconds from the start

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> FaultPlan:
        env = os.environ if env is None else env
        names = {n.strip() for n in env.get(FAULTS_ENV, "").split(",") if n.strip()}
        try:
            after = float(env.get(FAULT_AFTER_ENV, "2"))
        except ValueError:
            after = 2.0
        if names:
            log.warning("test fault injection enabled for services: %s", ", ".join(sorted(names)))
        wedges = {n.removeprefix("wedge:") for n in names if n.startswith("wedge:")}
        return cls({n for n in names if not n.startswith("wedge:")}, after, wedges, env.get(FAULT_FILE_ENV, ""))

    async def fired(self) -> None:
        """Return when this plan's faults are due: `after` seconds from now, or once the trigger file exists."""
        if not self.trigger_file:
            await asyncio.sleep(self.after)
            return
        while not os.path.exists(self.trigger_file):
            await asyncio.sleep(0.1)

    def take(self, name: str) -> bool:
        if name in self.services:
            self.services.discard(name)
            return True
        return False

    def wedge_later(self, name: str) -> None:
        """For ``wedge:NAME``: block the event loop `after` seconds from now (once)."""
        if name in self.wedges:
            self.wedges.discard(name)
            asyncio.get_running_loop().call_later(self.after, _wedge, name)


def _wedge(name: str) -> None:
    log.warning("test fault: service %s wedges the event loop", name)
    time.sleep(3600)


class Supervisor:
    def __init__(self, stop_event: asyncio.Event, *, clock: Clock | None = None, base: float = 1.0,
                 cap: float = 60.0, jitter: float = 0.25, healthy_after: float = HEALTHY_AFTER,
                 faults: FaultPlan | None = None) -> None:
        self.stop_event = stop_event
        self.clock = clock or Clock()
        self.base, self.cap, self.jitter, self.healthy_after = base, cap, jitter, healthy_after
        self.faults = faults or FaultPlan()
        self.health: dict[str, ServiceHealth] = {}
        self.fatal: FatalError | None = None

    def register(self, name: str) -> ServiceHealth:
        return self.health.setdefault(name, ServiceHealth(name))

    async def supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run `run()` until it returns, restarting it after each crash, until the stop event."""
        health = self.register(name)
        backoff = Backoff(base=self.base, cap=self.cap, jitter=self.jitter)
        self.faults.wedge_later(name)
        while not self.stop_event.is_set():
            started = self.clock.monotonic()
            health.state, health.running_since = "running", self.clock.now().timestamp()
            try:
                await self._run(name, run, self.faults.take(name))
                health.state = "done"
                return
            except asyncio.CancelledError:
                health.state = "done"
                raise
            except FatalError as exc:
                health.state, health.last_error = "failed", str(exc)
                log.error("%s", exc, extra={"service": name})
                self.fatal = exc
                self.stop_event.set()
                return
            except Exception as exc:
                if self.clock.monotonic() - started >= self.healthy_after:
                    backoff.reset()
                delay = backoff.next_delay()
                health.restarts += 1
                health.state = "restarting"
                health.last_error = f"{type(exc).__name__}: {exc}"[:500]
                health.last_error_at = self.clock.now().timestamp()
                if isinstance(exc, PlexdError):  # an operator-readable condition: no traceback needed
                    log.error("service %s failed: %s; restarting in %.1fs", name, exc, delay,
                              extra={"service": name, "restarts": health.restarts})
                else:
                    log.exception("service %s crashed; restarting in %.1fs", name, delay,
                                  extra={"service": name, "restarts": health.restarts})
            await self._sleep(delay)

    async def _sleep(self, seconds: float) -> None:
        sleeper = asyncio.ensure_future(self.clock.sleep(seconds))
        stopper = asyncio.ensure_future(self.stop_event.wait())
        try:
            await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            stopper.cancel()

    async def _run(self, name: str, run: Callable[[], Awaitable[None]], fault: bool) -> None:
        """Run the service as a child task, so that a cancellation it swallows (Python 3.11's wait_for can) is
        repeated until it has really ended; with `fault`, crash it on purpose when the fault plan says so."""
        task = asyncio.ensure_future(run())
        due = asyncio.ensure_future(self.faults.fired()) if fault else None
        try:
            done, _ = await asyncio.wait({task, due} if due is not None else {task},
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _cancel(task)
            raise
        finally:
            if due is not None:
                due.cancel()
        if task in done:
            task.result()
            return
        await _cancel(task)
        raise InjectedFault(f"test fault injected into service {name}")

    def to_json(self) -> list[dict[str, Any]]:
        return [h.to_json() for h in self.health.values()]


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel until it has really ended (Python 3.11's wait_for can swallow one cancellation)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
