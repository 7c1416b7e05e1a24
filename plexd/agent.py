"""The lifecycle of ``plexd up``: start → register → supervised services → shutdown.

    start        data_dir writable, binary checksum, hook scan                      (Agent.start)
    register     reuse the stored identity, or register with the bootstrap token    (Agent.register)
    assemble     the composition root builds the node's parts and adds its services (plexd.node.assembly)
    services     each runs under the supervisor (plexd.node.supervisor) in one TaskGroup  (Agent.serve)
    shutdown     SIGINT/SIGTERM set `stop_event` → "drain" callbacks → services cancelled → POST /deregister
                 (when shutdown.deregister) → "teardown" callbacks, last registered first     (Agent.shutdown)

A service is a coroutine function ``fn(agent)`` added with ``agent.add_service(name, fn)``; shutdown work with
``agent.on_shutdown(name, fn, phase="drain"|"teardown")``. What a service can use: ``agent.config``,
``agent.identity`` (may be replaced after a re-registration, so read it each time), ``agent.client`` (bearer
set), ``agent.clock``, ``agent.store``, ``agent.binary_checksum``, ``agent.hooks``, ``agent.capabilities()``,
``agent.announce_capabilities()``, ``agent.authed(call)`` (on a 401, re-authenticate once and retry),
``agent.reauthenticate()``, ``agent.sleep(s)``, ``agent.stopping``, ``agent.uptime()``.

A service that raises is restarted by the supervisor with backoff; the daemon and its tunnels keep running. Only
a `FatalError` ends `plexd up` (exit status 1, one clear line). READY=1 goes to systemd (``NOTIFY_SOCKET``) once
every service has been started.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from plexd import __version__
from plexd.actions.builtins import builtin_capabilities
from plexd.clock import Clock
from plexd.config import Config
from plexd.controlplane.client import ControlPlaneClient
from plexd.controlplane.errors import AuthError, ControlPlaneError
from plexd.identity import Identity, IdentityStore
from plexd.integrity import HookScan, binary_checksum, capabilities_document, scan_hooks
from plexd.node.supervisor import FaultPlan, Supervisor
from plexd.registrar import Registrar

log = logging.getLogger(__name__)

T = TypeVar("T")
Service = Callable[["Agent"], Awaitable[None]]
ShutdownStep = Callable[["Agent"], Awaitable[None]]
Assemble = Callable[["Agent"], Any]  # builds the node's parts and adds its services (plexd.node.assembly)

DEREGISTER_TIMEOUT = 10.0


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
        self.node: Any = None  # what the assembler built (plexd.node.assembly.Node)
        self._started_at = self.clock.monotonic()
        self._services: list[tuple[str, Service]] = []
        self._shutdown_steps: list[tuple[str, str, ShutdownStep]] = []
        self._reauth_lock = asyncio.Lock()

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    # -- extension API --------------------------------------------------------------------------------------------

    def add_service(self, name: str, service: Service) -> None:
        """Run `service(agent)` as a task of the agent's TaskGroup once registered."""
        self._services.append((name, service))

    def on_shutdown(self, name: str, step: ShutdownStep, *, phase: str = "teardown") -> None:
        """Run `step(agent)` at shutdown: phase "drain" while services still run (finish work in flight),
        phase "teardown" after they are cancelled and the node deregistered (last added runs first)."""
        if phase not in ("drain", "teardown"):
            raise ValueError(f"unknown shutdown phase {phase!r}")
        self._shutdown_steps.append((phase, name, step))

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
        """Run a control-plane call; on 401 re-authenticate once (PROJECT-DECISIONS.md) and retry it."""
        try:
            return await call()
        except AuthError:
            refused = self.client.token
            await self.reauthenticate(refused)
            return await call()

    async def reauthenticate(self, refused_token: str | None = None) -> Identity:
        """Recover from a 401. Concurrent callers share one recovery: whoever comes second sees the new token."""
        async with self._reauth_lock:
            if refused_token is not None and self.client.token != refused_token and self.identity is not None:
                return self.identity
            self.identity = await self.registrar.recover(self.identity)
            return self.identity

    async def announce_capabilities(self, *, rescan: bool = True) -> None:
        """Re-scan hooks (when asked) and ``PUT /capabilities``; raises ControlPlaneError on failure."""
        if rescan:
            self.hooks = await asyncio.to_thread(scan_hooks, self.config.hooks.dir)
        assert self.identity is not None
        await self.authed(lambda: self.client.put_capabilities(self.identity.node_id, self.capabilities()))

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start stage of the seed: data_dir usable, binary checksum, hook scan."""
        await asyncio.to_thread(self.store.ensure_writable)
        self.binary_checksum = await asyncio.to_thread(binary_checksum)
        self.hooks = await asyncio.to_thread(scan_hooks, self.config.hooks.dir)
        self.builtin_actions = builtin_capabilities()
        log.info("starting plexd %s", __version__, extra={"binary_checksum": self.binary_checksum,
                                                          "hooks": [h.name for h in self.hooks.hooks],
                                                          "refused_hooks": [h.name for h in self.hooks.refused]})

    async def register(self) -> Identity:
        self.identity, self.registered_now = await self.registrar.ensure_registered()
        return self.identity

    async def until_stopped(self, aw: Awaitable[T]) -> T | None:
        """Await `aw` unless the agent is told to stop first (then cancel it and return None)."""
        task = asyncio.ensure_future(aw)
        stopper = asyncio.ensure_future(self.stop_event.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()  # we were cancelled ourselves: leave nothing running behind
            raise
        finally:
            stopper.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def serve(self) -> None:
        """Run every service in one TaskGroup until the stop event; then drain and cancel them."""
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self.supervisor.supervise(name, functools.partial(svc, self)),
                                       name=f"plexd:{name}") for name, svc in self._services]
            notify_systemd("READY=1", f"STATUS=running as node {self.identity.node_id if self.identity else '?'}")
            log.info("running", extra={"services": [name for name, _ in self._services]})
            await self.stop_event.wait()
            notify_systemd("STOPPING=1")
            await self._run_steps("drain")
            for task in tasks:
                task.cancel()

    async def shutdown(self) -> None:
        """After `serve`: deregister (when configured), then teardown steps, last registered first."""
        if self.config.shutdown.deregister and self.identity is not None and not self.failed:
            try:
                async with asyncio.timeout(DEREGISTER_TIMEOUT):
                    await self.client.deregister(self.identity.node_id)
                log.info("deregistered", extra={"node_id": self.identity.node_id})
            except (ControlPlaneError, TimeoutError) as exc:
                log.warning("could not deregister: %s", exc, extra={"node_id": self.identity.node_id})
        await self._run_steps("teardown", reverse=True)

    async def _run_steps(self, phase: str, *, reverse: bool = False) -> None:
        steps = [(n, s) for p, n, s in self._shutdown_steps if p == phase]
        for name, step in reversed(steps) if reverse else steps:
            try:
                await step(self)
            except Exception:
                log.exception("shutdown step %s failed", name, extra={"phase": phase})

    async def run(self, assemble: Assemble) -> int:
        """The whole lifecycle; returns the process exit status."""
        notify_systemd("STATUS=starting")
        await self.start()
        if await self.until_stopped(self.register()) is None:
            log.info("stopped before registration finished")
            return 0
        self.node = assemble(self)
        await self.serve()
        await self.shutdown()
        return 1 if self.failed else 0


# ---------------------------------------------------------------------------------------------------------------
# Process plumbing


def notify_systemd(*lines: str) -> None:
    """sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET; silently nothing outside systemd."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return
    if target.startswith("@"):
        target = "\0" + target[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(lines).encode(), target)
    except OSError as exc:
        log.debug("sd_notify failed: %s", exc)


@contextlib.contextmanager
def _signal_handlers(stop_event: asyncio.Event) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, _on_signal, sig, stop_event)
            installed.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread (tests): the caller owns stop_event
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _on_signal(sig: signal.Signals, stop_event: asyncio.Event) -> None:
    log.info("received %s, shutting down", sig.name)
    stop_event.set()


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
        with _signal_handlers(agent.stop_event):
            return await agent.run(assemble)
