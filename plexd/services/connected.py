"""The "Connected" stage of `plexd up`: heartbeat, signed event stream and reconciler, wired to one mesh.

    events ──▶ EventHandlers ──▶ mesh.set_desired(...) ──▶ mesh.converge()          (hint: converge now)
    reconciler ──▶ GET /state ──▶ mesh.set_desired(with_state) ──▶ mesh.converge() ──▶ POST /drift
    heartbeat ──▶ reconcile:true / rotate_keys:true ──▶ reconciler.trigger()
    stream reconnect ──▶ reconciler.trigger()          (catch up on whatever happened while we were away)
    401 anywhere ──▶ agent.reauthenticate()           (PROJECT-DECISIONS.md, Re-registration row)

The mesh is anything with ``get_desired()``, ``set_desired(d)`` and ``async converge(dry_run=False)`` returning a
result with ``.changes`` (see `MeshHandle`, which adapts a `plexd.converge.Converger`). The converger serialises
converges itself, so an event-triggered converge and a reconcile never interleave.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from plexd.atomicfile import write_atomic
from plexd.backoff import Backoff
from plexd.controlplane.events import EventStream, stream_http_client
from plexd.controlplane.signing import (
    InvalidSigningKeys,
    NonceStore,
    Verifier,
    key_fingerprint,
    load_signing_key,
)
from plexd.desired_store import DesiredStore
from plexd.model import SigningKeys, State
from plexd.services.event_handlers import EventHandlers, apply_signing_keys
from plexd.services.heartbeat import HeartbeatService, HeartbeatSnapshot, MeshInfo, NatInfo
from plexd.services.reconciler import Correction, Reconciler

if TYPE_CHECKING:
    from plexd.agent import Agent

log = logging.getLogger(__name__)


class Mesh(Protocol):
    store: DesiredStore

    def get_desired(self) -> Any: ...

    def set_desired(self, desired: Any) -> None: ...

    async def converge(self, *, dry_run: bool = False) -> Any: ...


class MeshHandle:
    """Holds the desired model (a `DesiredStore`) and converges a `Converger` to it (one instance per daemon)."""

    def __init__(self, converger: Any, desired: Any,
                 on_desired_changed: Callable[[Any], None] | None = None) -> None:
        self.converger = converger
        self.store = DesiredStore(desired, on_desired_changed)

    def get_desired(self) -> Any:
        return self.store.value

    def set_desired(self, desired: Any) -> None:
        self.store.replace(desired)

    async def converge(self, *, dry_run: bool = False) -> Any:
        return await self.converger.converge(self.store.value, dry_run=dry_run)


@dataclass(frozen=True)
class PulledState:
    """A state pull and the desired model's sequence number when it was requested (see `plexd.desired_store`)."""

    state: State
    since: int


def state_fetcher(mesh: Mesh, fetch: Callable[[], Awaitable[State]]) -> Callable[[], Awaitable[PulledState]]:
    async def fetch_state() -> PulledState:
        since = mesh.store.mark()  # before the request: any event applied from now on is replayed on top
        return PulledState(await fetch(), since)

    return fetch_state


@dataclass
class Connected:
    verifier: Verifier
    handlers: EventHandlers
    stream: EventStream
    reconciler: Reconciler
    heartbeat: HeartbeatService


def build_verifier(data_dir: Path, clock: Any, fallback_key: str) -> Verifier:
    """The verifier with the persisted key (the file wins, §5.4) and the persisted nonce store."""
    data_dir = Path(data_dir)
    key = load_signing_key(data_dir) or fallback_key
    verifier = Verifier(None, NonceStore(clock, data_dir / "nonces.json"), clock)
    try:
        verifier.set_keys(SigningKeys(current=key))
    except InvalidSigningKeys as exc:
        # Every event will be refused until the first state pull brings a usable key; say so once, loudly.
        log.error("stored signing key unusable (%s); events are refused until the control plane sends one", exc)
    return verifier


def state_applier(mesh: Mesh, verifier: Verifier | None,
                  data_dir: Path | None) -> Callable[[PulledState], list[Correction]]:
    """`apply_state` for the reconciler: replace the desired model (replaying the events applied while the pull
    was in flight), install new signing keys (reported). Without a verifier (a dry run) no key is installed."""

    def apply(pulled: PulledState) -> list[Correction]:
        state = pulled.state
        corrections: list[Correction] = []
        keys = state.signing_keys
        if verifier is not None and keys is not None and keys.current:
            old = verifier.keys
            try:
                if apply_signing_keys(verifier, data_dir, keys):
                    detail = f"signing keys rotated: current {key_fingerprint(keys.current)}"
                    if old is not None:
                        detail += f" (was {key_fingerprint(old.current)})"
                    corrections.append(Correction("signing_keys_updated", detail))
            except InvalidSigningKeys as exc:
                log.error("state carries unusable signing keys, keeping the current ones: %s", exc)
        replayed = mesh.store.replace_from_pull(lambda d: d.with_state(state), pulled.since)  # StalePull: re-pull
        if replayed:
            log.info("state pull applied with %d event(s) that arrived during it replayed on top: %s",
                     len(replayed), ", ".join(replayed))
        return corrections

    return apply


def install_connected(agent: Agent, mesh: Mesh, *, nat: Callable[[], NatInfo | None] | None = None) -> Connected:
    """Create the connected-state services and add them to `agent` (call from `install_services`)."""
    cfg = agent.config
    data_dir = Path(cfg.data_dir)
    assert agent.identity is not None
    verifier = build_verifier(data_dir, agent.clock, agent.identity.signing_public_key)

    def node_id() -> str:
        assert agent.identity is not None
        return agent.identity.node_id

    async def reauthenticate() -> None:
        await agent.reauthenticate(agent.client.token)

    fetch_state = state_fetcher(mesh, lambda: agent.authed(lambda: agent.client.fetch_state(node_id())))

    async def post_drift(report: dict[str, Any]) -> None:
        await agent.authed(lambda: agent.client.report_drift(node_id(), report))

    reconciler = Reconciler(fetch_state, state_applier(mesh, verifier, data_dir), mesh.converge, post_drift,
                            clock=agent.clock, interval=cfg.reconcile.interval)

    async def converge_now(reason: str) -> None:
        result = await mesh.converge()
        for err in getattr(result, "errors", ()):
            log.warning("converge after %s: %s", reason, err)

    handlers = EventHandlers(mesh.store, converge_now, reconciler.trigger, verifier,
                             data_dir)

    stream = EventStream(
        agent.client.base_url, node_id(), lambda: agent.client.token, data_dir, verifier, handlers.dispatch,
        clock=agent.clock,
        on_connected=lambda: reconciler.trigger("event stream (re)connected"),
        on_auth_failure=reauthenticate,
        poll=lambda: reconciler.trigger("polling while the event stream is down"),
        poll_interval=cfg.reconcile.interval,
        backoff=Backoff(base=cfg.sse.backoff_base, cap=cfg.sse.backoff_max, jitter=cfg.sse.jitter),
        storm_backoff=Backoff(base=cfg.sse.backoff_base, cap=cfg.sse.backoff_max, jitter=cfg.sse.jitter),
        idle_timeout=cfg.sse.idle_timeout,
        polling_after=cfg.sse.polling_after,
        client_factory=lambda: stream_http_client(cfg.api.tls.ca_file, cfg.api.tls.insecure_skip_verify),
    )

    def snapshot() -> HeartbeatSnapshot:
        desired = mesh.get_desired()
        return HeartbeatSnapshot(
            status="healthy" if reconciler.last is None or reconciler.last.ok else "degraded",
            binary_checksum=agent.binary_checksum,
            mesh=MeshInfo(cfg.mesh.interface, len(desired.peers), cfg.mesh.listen_port),
            nat=nat() if nat is not None else None,
        )

    async def send(body: dict[str, Any]) -> dict[str, bool]:
        # No agent.authed here: the heartbeat's own 401 path re-authenticates and the next tick retries.
        resp = await agent.client.heartbeat(node_id(), body)
        return {"reconcile": resp.reconcile, "rotate_keys": resp.rotate_keys}

    heartbeat = HeartbeatService(node_id(), send, snapshot, clock=agent.clock, interval=cfg.heartbeat.interval,
                                 trigger_reconcile=reconciler.trigger, on_auth_failure=reauthenticate,
                                 uptime=agent.uptime)  # the daemon's, not since registration finished

    # The agent cancels its services at shutdown; `insist_on_cancel` makes sure each loop really ends.
    agent.add_service("reconciler", lambda a: insist_on_cancel(reconciler.run))
    agent.add_service("events", lambda a: insist_on_cancel(stream.run))
    agent.add_service("heartbeat", lambda a: insist_on_cancel(heartbeat.run))
    return Connected(verifier, handlers, stream, reconciler, heartbeat)


async def insist_on_cancel(loop_fn: Callable[[], Any]) -> None:
    """Run a service loop as a child task; when cancelled, cancel it until it has really ended.

    Python 3.11's asyncio.wait_for can swallow a cancellation that arrives as its inner await completes (fixed in
    3.12); a loop that swallowed the daemon's one shutdown cancel would keep running and hang the exit.
    """
    task = asyncio.ensure_future(loop_fn())
    try:
        # asyncio.wait, not `await task`: awaiting a task hands our cancellation to it, and if it swallows the
        # cancellation we would never see ours either.
        await asyncio.wait({task})
    except asyncio.CancelledError:
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        raise
    task.result()


async def wait_connected(connected: Connected, timeout: float) -> bool:
    try:
        await asyncio.wait_for(connected.stream.connected.wait(), timeout)
    except TimeoutError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# The mesh for `plexd up`: one converger, one desired model mirrored to data_dir/state for an offline start.

MIRROR_FILE = "state/desired.json"


def load_mirror(data_dir: Path, private_key: str) -> Any:
    from plexd.desired import DesiredState

    path = data_dir / MIRROR_FILE
    try:
        return DesiredState.from_json(json.loads(path.read_text()), private_key=private_key)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a torn or foreign file must not stop the daemon; the state pull replaces it
        log.warning("ignoring unreadable desired-state mirror %s: %s", path, exc)
        return None


def _save_mirror(data_dir: Path, desired: Any) -> None:
    path = data_dir / MIRROR_FILE
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_atomic(path, json.dumps(desired.to_json(), separators=(",", ":")).encode())
    except OSError as exc:
        log.warning("cannot write the desired-state mirror %s: %s", path, exc)


class MirrorWriter:
    """Writes the desired-state mirror at most once per `delay` seconds, off the event path (serialising a
    few hundred peers costs milliseconds, which would otherwise sit between an event and the device)."""

    def __init__(self, data_dir: Path, delay: float = 1.0) -> None:
        self.data_dir = data_dir
        self.delay = delay
        self._pending: Any = None
        self._timer: asyncio.TimerHandle | None = None

    def changed(self, desired: Any) -> None:
        self._pending = desired
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.delay, self.flush)
            except RuntimeError:  # no loop (a synchronous caller): write now
                self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        desired, self._pending = self._pending, None
        if desired is not None:
            _save_mirror(self.data_dir, desired)


def install_mesh(agent: Agent) -> MeshHandle:
    """The converger for this machine and the desired model, seeded from the mirror of the last run."""
    from dataclasses import replace

    from plexd.desired import DesiredState
    from plexd.services.reconcile_cmd import build_converger

    cfg = agent.config
    data_dir = Path(cfg.data_dir)
    assert agent.identity is not None
    private_key = base64.b64encode(agent.identity.private_key).decode()
    initial = DesiredState.initial(interface=cfg.mesh.interface, listen_port=cfg.mesh.listen_port, mtu=cfg.mesh.mtu,
                                   private_key=private_key, mesh_ip=agent.identity.mesh_ip)
    mirrored = load_mirror(data_dir, private_key)
    if mirrored is not None and mirrored.mesh_ip == initial.mesh_ip:
        # Peers and policies from the last run; the interface settings always come from the current config.
        initial = replace(mirrored, interface=initial.interface, listen_port=initial.listen_port, mtu=initial.mtu)
        log.info("desired state restored from %s (%d peers)", data_dir / MIRROR_FILE, len(initial.peers))
    converger = build_converger(cfg)
    mirror = MirrorWriter(data_dir)
    mesh = MeshHandle(converger, initial, on_desired_changed=mirror.changed)

    async def teardown(agent: Agent) -> None:
        mirror.flush()
        if cfg.shutdown.deregister and not agent.failed:
            await converger.teardown()
            log.info("mesh interface %s removed", cfg.mesh.interface)

    agent.on_shutdown("mesh teardown", teardown)
    return mesh


def install_connected_stage(agent: Agent) -> Connected:
    """`install_services` hook: the mesh and the connected services. The reconciler's first cycle brings the
    interface and the last known peers up at once, before (or without) the control plane."""
    return install_connected(agent, install_mesh(agent))
