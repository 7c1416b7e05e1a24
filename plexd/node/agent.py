"""The lifecycle of ``plexd up``: start → register → supervised services → shutdown.

    start        data_dir writable, binary checksum, hook scan                      (Agent.start)
    register     reuse the stored identity, or register with the bootstrap token    (Agent.register)
    assemble     the composition root builds the node's parts and adds its services (plexd.node.assembly)
    services     each runs under the supervisor (plexd.node.supervisor) in one TaskGroup  (Agent.serve)
    shutdown     SIGINT/SIGTERM set `stop_event` → "drain" callbacks → services cancelled → POST /deregister
                 (when shutdown.deregister, or asked over the socket) → "teardown" callbacks, last registered
                 first → "final" callbacks and the services added with stop_last (the local socket)
                 (Agent.stop); all of it within STOP_BUDGET, the control plane down included

A service is a coroutine function ``fn(agent)`` added with ``agent.add_service(name, fn)``; shutdown work with
``agent.on_shutdown(name, fn, phase="drain"|"teardown"|"final")``; ``agent.time_left(reserve)`` is what remains
of the stop budget. What a service can use: ``agent.config``,
``agent.identity`` (may be replaced after a re-registration, so read it each time), ``agent.client`` (bearer
set), ``agent.clock``, ``agent.store``, ``agent.binary_checksum``, ``agent.hooks``, ``agent.capabilities()``,
``agent.announce_capabilities()``, ``agent.authed(call)`` (on a 401, re-authenticate once and retry),
``agent.reauthenticate()``, ``agent.sleep(s)``, ``agent.stopping``, ``agent.uptime()``.

A service that raises is restarted by the supervisor with backoff; the daemon and its tunnels keep running. Only
a `FatalError` ends `plexd up` (exit status 1, one clear line). READY=1 goes to systemd (``NOTIFY_SOCKET``) once
the services run and the node's `ready()` (the first converge, from data_dir when offline) returned; STATUS= lines
follow `agent.status_line()` (plexd.system.systemd).

A node that deregistered (and so kept its identity) rejoins first thing on its next start: it re-registers with
its node secret, as the same node (plexd.node.departure).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import math
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from plexd import __version__
from plexd.actions.builtins import builtin_capabilities
from plexd.base.clock import Clock
from plexd.base.errors import PlexdError
from plexd.config.settings import Config, insecure_control_plane
from plexd.controlplane.client import ControlPlaneClient
from plexd.controlplane.client_errors import AuthError, ControlPlaneError
from plexd.identity.identity_store import DataDirError, Identity, IdentityStore
from plexd.identity.registrar import Registrar
from plexd.node import departure
from plexd.node.supervisor import FaultPlan, Supervisor
from plexd.system import systemd
from plexd.system.systemd import notify
from plexd.trust.integrity import HookScan, binary_checksum, capabilities_document, scan_hooks
from plexd.trust.pathtrust import require_trusted
from plexd.upgrade.launcher import EXIT_RESTART

log = logging.getLogger(__name__)

T = TypeVar("T")
Service = Callable[["Agent"], Awaitable[None]]
ShutdownStep = Callable[["Agent"], Awaitable[None]]
Assemble = Callable[["Agent"], Any]  # builds the node's parts and adds its services (plexd.node.assembly)

DEREGISTER_TIMEOUT = 10.0
STOP_BUDGET = 34.0  # SIGTERM to exit, whatever the control plane does (the issue asks 35 s; the unit allows 40)
TEARDOWN_RESERVE = 1.5  # kept for removing the interface and the table after the deregistration
REGISTER_ANSWER_WAIT = 15.0  # at a stop, how long an in-flight register request may still take to be answered
# File system faults that heal without anyone changing plexd's configuration (remounted read-only after an I/O
# error, a full disk, a quota): plexd waits them out at its start, rather than exiting into systemd's restart loop,
# whose start limit (5 starts in 2 minutes) would leave it down for good once the disk is back. Any other failure
# (permissions, a file where the directory should be) is a mistake to fix: plexd exits naming it.
DATA_DIR_FAULTS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT})
DATA_DIR_RETRY = 1.0  # seconds between two tries of data_dir while it cannot be written
FINISH_GRACE = 0.2  # ...and, once it is answered, to save what it brought (a retry's backoff is 0.75 s at least)


class Assembled(Protocol):
    """What the lifecycle asks of the node the assembly built (`plexd.node.parts.Node`)."""

    async def ready(self) -> None:
        """Returns once the node may say READY=1 (its first converge was tried)."""
        ...

    def describe(self) -> str:
        """The running node's STATUS= line."""
        ...

    def reload_config(self) -> Any:
        """What SIGHUP does."""
        ...

    def adopt_identity(self, identity: Identity) -> None:
        """An identity a re-authentication brought (its signing key, its node id)."""
        ...


@dataclass
class Leaving:
    """A deregistration asked over the socket (`plexd deregister`): already posted (or forced) before the stop."""

    deregistered: bool = False
    error: str = ""


class Agent:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        stop_event: asyncio.Event | None = None,
        client: ControlPlaneClient | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or Clock()
        self.stop_event = stop_event or asyncio.Event()
        self.client = client or ControlPlaneClient.for_config(config)
        self.store = IdentityStore(config.data_dir)
        self.registrar = Registrar(config, self.client, self.store, clock=self.clock,
                                   capabilities=self.capabilities)
        self.identity: Identity | None = None
        self.registered_now = False
        self.binary_checksum = ""
        self.hooks = HookScan()
        self.builtin_actions: list[dict[str, Any]] = []
        self.supervisor = Supervisor(self.stop_event, clock=self.clock, faults=FaultPlan.from_env())
        self.node: Assembled | None = None  # what the assembler built (plexd.node.parts.Node)
        self._started_at = self.clock.monotonic()
        self._services: list[tuple[str, Service, bool]] = []
        self._shutdown_steps: list[tuple[str, str, ShutdownStep]] = []
        self._recovery: asyncio.Task[Identity] | None = None  # the one re-authentication in flight
        self.phase = "starting"
        self.leaving: Leaving | None = None
        self.restarting = ""  # why this stop is a restart (an upgrade): the tunnels stay up, `run` returns 75
        self.unit_restart = False  # systemd is restarting the unit (`systemctl restart`): the tunnels stay up
        self.stopped = asyncio.Event()  # the stop sequence is done (the interface is down, when it goes down)
        self.stop_deadline: float | None = None  # monotonic; set when the stop begins

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    # -- extension API --------------------------------------------------------------------------------------------

    def add_service(self, name: str, service: Service, *, stop_last: bool = False) -> None:
        """Run `service(agent)` as a task of the agent's TaskGroup once registered. `stop_last`: cancelled only
        after the teardown (the local socket, which answers `plexd deregister` when the stop is done)."""
        self._services.append((name, service, stop_last))

    def on_shutdown(self, name: str, step: ShutdownStep, *, phase: str = "teardown") -> None:
        """Run `step(agent)` at shutdown: phase "drain" while services still run (finish work in flight),
        phase "teardown" after they are cancelled and the node deregistered (last added runs first), phase
        "final" after the teardown, before the stop_last services are cancelled."""
        if phase not in ("drain", "teardown", "final"):
            raise ValueError(f"unknown shutdown phase {phase!r}")
        self._shutdown_steps.append((phase, name, step))

    def time_left(self, reserve: float = 0.0) -> float:
        """Seconds left of the stop budget after keeping `reserve` for later steps (inf before the stop)."""
        if self.stop_deadline is None:
            return math.inf
        return max(0.0, self.stop_deadline - self.clock.monotonic() - reserve)

    @property
    def tears_down(self) -> bool:
        """Whether this stop removes the interface, peers and table: it deregisters (SIGTERM by default, or
        `plexd deregister`) and nothing fatal happened (a bug never takes the node off the mesh)."""
        return ((self.leaving is not None or self.config.shutdown.deregister) and not self.failed
                and not self.restarting and not self.unit_restart)

    def status_line(self) -> str:
        """What systemd shows as the unit's status."""
        if self.phase == "running" and self.node is not None:
            return self.node.describe()
        return self.phase

    @property
    def failed(self) -> bool:
        return self.supervisor.fatal is not None

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep on the agent's clock; return early (True) when the agent is stopping."""
        await self.until_stopped(self.clock.sleep(seconds))
        return self.stopping

    def uptime(self) -> float:
        return self.clock.monotonic() - self._started_at

    def capabilities(self) -> dict[str, Any]:
        return capabilities_document(__version__, self.binary_checksum, self.hooks.hooks, self.builtin_actions)

    async def authed(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a control-plane call; on 401 re-authenticate once (docs/decisions.md, Re-registration) and retry it."""
        try:
            return await call()
        except AuthError:
            refused = self.client.token
            await self.reauthenticate(refused)
            return await call()

    async def reauthenticate(self, refused_token: str | None = None) -> Identity:
        """Recover from a 401. Concurrent callers share one recovery; one that comes after it sees the new token.
        The recovery is its own task, shielded from its callers: a caller cancelled mid-way (a service restarted,
        a timeout) must not abandon a registration the control plane has already taken, which would spend the
        bootstrap token and leave the new identity unsaved.
        Not while leaving: the 401 is the control plane taking our deregistration, not something to undo."""
        if self.leaving is not None and self.identity is not None:
            return self.identity
        if self._recovery is None or self._recovery.done():
            if refused_token is not None and self.client.token != refused_token and self.identity is not None:
                return self.identity
            self._recovery = asyncio.create_task(self._recover(), name="re-authentication")
            self._recovery.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if unawaited
        return await asyncio.shield(self._recovery)

    async def _recover(self) -> Identity:
        before = self.identity
        self.identity = await self.registrar.recover(self.identity)
        departure.clear_departed(self.config.data_dir)  # re-registered: a deregistration before it is over
        if self.node is not None and self.identity != before:
            self.node.adopt_identity(self.identity)
        return self.identity

    async def announce_capabilities(self, *, rescan: bool = True) -> None:
        """Re-scan hooks (when asked) and ``PUT /capabilities``; raises ControlPlaneError on failure."""
        if rescan:
            self.hooks = await asyncio.to_thread(scan_hooks, self.config.hooks.dir)
        assert self.identity is not None
        await self.authed(lambda: self.client.put_capabilities(self.identity.node_id, self.capabilities()))

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start stage of the lifecycle (docs/decisions.md, Lifecycle): data_dir and hooks.dir trustworthy, data_dir
        usable, binary checksum, hook scan."""
        require_trusted({"data_dir": self.config.data_dir, "hooks.dir": self.config.hooks.dir})
        if not await self._until_data_dir_writable():
            return  # told to stop while waiting for it
        self.binary_checksum = await asyncio.to_thread(binary_checksum)
        self.hooks = await asyncio.to_thread(scan_hooks, self.config.hooks.dir)
        self.builtin_actions = builtin_capabilities()
        log.info("starting plexd %s", __version__, extra={"binary_checksum": self.binary_checksum,
                                                          "hooks": [h.name for h in self.hooks.hooks],
                                                          "refused_hooks": [h.name for h in self.hooks.refused]})
        insecure = insecure_control_plane(self.config)
        if insecure:  # allowed by api.allow_insecure, never silently: a line at every start
            log.warning("INSECURE control plane connection (api.allow_insecure): %s; anyone on the path can read "
                        "the node secret and forge the state; use https:// with verification outside labs", insecure)

    async def _until_data_dir_writable(self) -> bool:
        """True once data_dir is proven writable. While a file system fault (`DATA_DIR_FAULTS`) keeps it from that,
        plexd waits, says so once (log, systemd's STATUS=), and tries again until it heals; False if told to stop."""
        waiting_since: float | None = None
        while True:
            try:
                await asyncio.to_thread(self.store.ensure_writable)
            except DataDirError as exc:
                if exc.errno not in DATA_DIR_FAULTS:
                    raise
                if waiting_since is None:
                    waiting_since = self.clock.monotonic()
                    log.error("data_dir %s is not writable (%s, errno %d): waiting for it, tried every %.0f s (a "
                              "file system read-only or full heals without a restart of plexd)", self.config.data_dir,
                              os.strerror(exc.errno), exc.errno, DATA_DIR_RETRY)
                    notify(f"STATUS=waiting for data_dir {self.config.data_dir} to become writable")
                await self.until_stopped(self.clock.sleep(DATA_DIR_RETRY))
                if self.stop_event.is_set():
                    return False
                continue
            if waiting_since is not None:
                log.info("data_dir %s is writable again, after %.0f s", self.config.data_dir,
                         self.clock.monotonic() - waiting_since)
            return True

    async def register(self) -> Identity:
        self._set_phase("registering")
        self.identity, self.registered_now = await self.registrar.ensure_registered()
        return self.identity

    async def rejoin(self) -> None:
        """After a deregistration (the marker in data_dir): re-register with the node secret before anything else
        talks to the control plane. Offline, the services start anyway and their first 401 rejoins."""
        since = departure.departed(self.config.data_dir)
        if since is None or self.registered_now or self.identity is None:
            return
        self.phase = "rejoining"
        notify(f"STATUS=rejoining the mesh (deregistered at {since})")
        log.info("this node deregistered at %s; rejoining with its node secret", since,
                 extra={"node_id": self.identity.node_id})
        try:
            async with asyncio.timeout(DEREGISTER_TIMEOUT):
                self.identity = await self.registrar.reregister(self.identity)
        except (PlexdError, TimeoutError) as exc:
            log.warning("could not rejoin yet (%s); starting from data_dir, the first answer from the control "
                        "plane rejoins", str(exc) or "no answer in time")
            return
        departure.clear_departed(self.config.data_dir)
        log.info("rejoined the mesh as the same node", extra={"node_id": self.identity.node_id,
                                                               "mesh_ip": self.identity.mesh_ip})

    async def until_stopped(self, aw: Awaitable[T], *, finish_while: Callable[[], bool] | None = None,
                            finish_within: float = 0.0) -> T | None:
        """Await `aw` unless the agent is told to stop first (then cancel it and return None). While
        `finish_while()` holds at the stop, `aw` is given `finish_within` seconds more to end by itself."""
        task = asyncio.ensure_future(aw)
        stopper = asyncio.ensure_future(self.stop_event.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()  # we were cancelled ourselves: leave nothing running behind
            raise
        finally:
            stopper.cancel()
        if finish_while is not None:
            # Only while it holds: a request that failed meanwhile is not tried again after the stop (its retry
            # would be cut off on the wire all the same); what came back gets a moment to be saved.
            deadline = asyncio.get_running_loop().time() + finish_within
            while not task.done() and (left := deadline - asyncio.get_running_loop().time()) > 0:
                if not finish_while():
                    await asyncio.wait({task}, timeout=min(FINISH_GRACE, left))
                    break
                await asyncio.wait({task}, timeout=min(0.05, left))
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def serve(self) -> None:
        """Run every service in one TaskGroup until the stop event; then the stop sequence (`stop`)."""
        async with asyncio.TaskGroup() as group:
            tasks = [(group.create_task(self.supervisor.supervise(name, functools.partial(svc, self)),
                                        name=f"plexd:{name}"), last) for name, svc, last in self._services]
            ready = group.create_task(self._announce_ready(), name="plexd:ready")
            log.info("running", extra={"services": [name for name, _, _ in self._services]})
            await self.stop_event.wait()
            ready.cancel()
            await self.stop([t for t, last in tasks if not last])
            for task, last in tasks:
                if last:
                    task.cancel()

    async def _announce_ready(self) -> None:
        if self.node is not None:
            await self.node.ready()
        self.phase = "running"
        notify("READY=1", f"STATUS={self.status_line()}")
        log.info("ready", extra={"node_id": self.identity.node_id if self.identity else ""})

    async def stop(self, services: list[asyncio.Task[None]]) -> None:
        """Drain, stop `services`, deregister, tear down, run the final steps: within the stop budget."""
        self.stop_deadline = self.clock.monotonic() + STOP_BUDGET
        if not self.restarting and self.leaving is None and await asyncio.to_thread(systemd.restart_queued):
            self.unit_restart = True
            log.info("systemd is restarting plexd: the interface, peers and rules stay up for the next start")
        self._set_phase(f"stopping to restart ({self.restarting or 'systemctl restart'}): finishing work in flight"
                        if self.restarting or self.unit_restart else "stopping: finishing work in flight")
        notify("STOPPING=1")
        await self._run_steps("drain")
        for task in services:
            task.cancel()
        if services:
            await asyncio.wait(services)
        if self.tears_down:
            await self._deregister()
            self._set_phase("stopping: removing the interface and the firewall table")
        await self._run_steps("teardown", reverse=True)
        self.stopped.set()
        await self._run_steps("final")

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        notify(f"STATUS={phase}")

    async def _post_deregister(self, timeout: float, *, purge: bool = False) -> str:
        """POST /deregister within `timeout`; "" when the control plane took it, else why not. When it did and
        the identity stays (no purge), the marker makes the next start rejoin."""
        assert self.identity is not None
        try:
            async with asyncio.timeout(timeout):
                await self.client.deregister(self.identity.node_id, purge=purge)
        except (ControlPlaneError, TimeoutError) as exc:
            return str(exc) or f"no answer within {timeout:.1f}s"
        if not purge:
            departure.mark_departed(self.config.data_dir, self.clock.now())
        return ""

    async def _deregister(self) -> None:
        """POST /deregister at the stop, unless `plexd deregister` already did."""
        if self.leaving is not None or self.identity is None or not self.config.shutdown.deregister:
            return
        self._set_phase("stopping: deregistering")
        node_id = self.identity.node_id
        error = await self._post_deregister(max(min(DEREGISTER_TIMEOUT, self.time_left(TEARDOWN_RESERVE)), 0.5))
        if error:
            log.warning("could not deregister: %s; the node stays registered and its next start carries on",
                        error, extra={"node_id": node_id})
        else:
            log.info("deregistered (the next start rejoins as the same node)", extra={"node_id": node_id})

    def restart(self, reason: str) -> None:
        """Stop without deregistering or tearing anything down, for the launcher to start a release
        (`plexd.upgrade.launcher.restart`): the interface, peers and rules carry the mesh across."""
        if self.stopping:
            return
        self.restarting = reason
        log.info("restarting: %s (the interface and peers stay up)", reason)
        self.stop_event.set()

    async def leave(self, *, purge: bool, force: bool) -> Leaving:
        """`plexd deregister` through the socket: POST /deregister now, and when the control plane took it (or
        with `force`) run the stop sequence, tearing down, and return once it is done. A refused or failed
        POST without `force` changes nothing: the daemon keeps running."""
        if self.stopping or self.identity is None:
            raise PlexdError("the daemon is already stopping")
        if self.leaving is not None:  # a second caller's failure must not undo what the first was promised
            raise PlexdError("a deregistration is already in progress")
        self.leaving = Leaving()  # from now on a 401 is our deregistration, not something to re-register from
        error = await self._post_deregister(DEREGISTER_TIMEOUT, purge=purge)
        leaving = Leaving(deregistered=not error, error=error)
        if error and not force:
            self.leaving = None
            return leaving
        self.leaving = leaving
        log.info("leaving the mesh (plexd deregister%s)%s", " --purge" if purge else "",
                 f"; the control plane was not told: {error}" if error else "",
                 extra={"node_id": self.identity.node_id})
        self.stop_event.set()
        await self.stopped.wait()
        return leaving

    async def _run_steps(self, phase: str, *, reverse: bool = False) -> None:
        steps = [(n, s) for p, n, s in self._shutdown_steps if p == phase]
        for name, step in reversed(steps) if reverse else steps:
            try:
                await step(self)
            except Exception:
                log.exception("shutdown step %s failed", name, extra={"phase": phase})

    async def run(self, assemble: Assemble) -> int:
        """The whole lifecycle; returns the process exit status."""
        notify(f"STATUS={self.phase}")
        # systemd arms the watchdog at the start, not at READY=1: a registration waiting for the control plane, or
        # a start on a slow machine, outlasted WatchdogSec and was killed. The node's watchdog takes over in serve.
        pinging = asyncio.create_task(_startup_watchdog(), name="plexd:startup-watchdog")
        try:
            return await self._run(assemble, pinging)
        finally:
            pinging.cancel()

    async def _run(self, assemble: Assemble, pinging: asyncio.Task[None]) -> int:
        await self.start()
        if self.stop_event.is_set():
            log.info("stopped before starting")
            return 0
        # A stop while the register request is on the wire waits for its answer: the control plane spends the
        # one-time token when it answers, and an answer thrown away leaves a spent token and no identity.
        registered = await self.until_stopped(self.register(), finish_while=lambda: self.registrar.posting,
                                              finish_within=REGISTER_ANSWER_WAIT)
        if registered is None:
            log.info("stopped before registration finished")
            return 0
        if self.stop_event.is_set():
            log.info("stopped right after registering; the identity is saved", extra={"node_id": registered.node_id})
            return 0
        await self.until_stopped(self.rejoin())
        self.phase = "bringing the mesh up"
        self.node = assemble(self)
        pinging.cancel()
        await self.serve()
        if self.failed:
            return 1
        return EXIT_RESTART if self.restarting else 0


async def _startup_watchdog() -> None:
    """WATCHDOG=1 from the event loop while plexd starts, when systemd asked for pings (a wedged loop stops them)."""
    interval = systemd.watchdog_interval()
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


# ---------------------------------------------------------------------------------------------------------------
# Process plumbing


@contextlib.contextmanager
def _signal_handlers(agent: Agent) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    installed = []
    handlers = {signal.SIGINT: _on_stop, signal.SIGTERM: _on_stop, signal.SIGHUP: _on_reload}
    for sig, handler in handlers.items():
        try:
            loop.add_signal_handler(sig, handler, sig, agent)
            installed.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread (tests): the caller owns stop_event
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _on_stop(sig: signal.Signals, agent: Agent) -> None:
    log.info("received %s, shutting down", sig.name)
    agent.stop_event.set()


def _on_reload(sig: signal.Signals, agent: Agent) -> None:
    if agent.node is None:
        log.info("received SIGHUP before the daemon was running; nothing to reload yet")
        return
    log.info("received SIGHUP, reloading the config")
    notify("RELOADING=1")
    try:
        agent.node.reload_config()
    finally:
        notify("READY=1")


async def run(
    config: Config,
    assemble: Assemble,
    *,
    clock: Clock | None = None,
    stop_event: asyncio.Event | None = None,
    client: ControlPlaneClient | None = None,
) -> int:
    """``plexd up``: run the lifecycle until SIGINT/SIGTERM (or `stop_event`); return the exit status."""
    config.require_api()
    async with Agent(config, clock=clock, stop_event=stop_event, client=client) as agent:
        with _signal_handlers(agent):
            return await agent.run(assemble)
