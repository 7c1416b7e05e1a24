"""The builders of the composition root: each takes typed parts and returns its own (`plexd.node.assembly`).

A builder builds; it adds no service and no shutdown step (the assembly lists those in one place, in order).
`reconcile --once` and `plexd deregister` build their engine and mesh with `build_mesh` too.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from plexd.access.sessions_domain import AccessHooks
from plexd.actions.action_routes import add_action_routes
from plexd.actions.audit import LocalAudit
from plexd.actions.builtins import NodeView
from plexd.actions.dispatcher import ActionDispatcher
from plexd.actions.hooks import HookSet
from plexd.actions.journal import ActionJournal, Message
from plexd.actions.outbox import Outbox, deliver
from plexd.base.backoff import Backoff
from plexd.base.errors import PlexdError
from plexd.base.log import recent_lines
from plexd.base.ratelimit import RateLimiter
from plexd.base.slot import Slot
from plexd.config import datadir
from plexd.config.settings import Config
from plexd.controlplane.client import PeerEndpoint
from plexd.controlplane.event_dialects import platform_events
from plexd.controlplane.event_signing import Verifier
from plexd.controlplane.event_stream import EventStream, stream_http_client
from plexd.controlplane.ledger import EventLedger
from plexd.controlplane.uplink import Senders, UplinkOutbox
from plexd.converge.coalesce import Requests
from plexd.converge.hold import ReconcileHold
from plexd.nat.endpoint_domain import NatHooks
from plexd.nat.nat_service import NatService, PortHandover, disabled_status
from plexd.nat.servers import parse_server
from plexd.node.access import SESSION_ACTIVITY, post_session_activity
from plexd.node.agent import Agent
from plexd.node.control import health
from plexd.node.domain_list import build_engine, nat_endpoint, wireguard
from plexd.node.key_rotation import KeyRotation
from plexd.node.mesh import MeshHandle, StatePull, initial_desired, set_peer_endpoints, trusted_key
from plexd.node.parts import Scraped
from plexd.node.protected import ProtectedAddresses
from plexd.node.reload import ConfigReloader
from plexd.nodeapi.local_api import LocalAPI, require_admin
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.routes import NodeApi, add_node_api_routes
from plexd.nodeapi.sync import ReportSync
from plexd.services.event_handlers import EventHandlers
from plexd.services.heartbeat import FailureStreak, HeartbeatService, HeartbeatSnapshot, MeshInfo
from plexd.services.paths import PathSelector
from plexd.services.reconciler import DRIFT, Reconciler
from plexd.state.desired_store import DesiredStore
from plexd.telemetry.service import Telemetry, telemetry_db_paths
from plexd.trust.integrity import HookScan
from plexd.upgrade.upgrader import Upgrader

log = logging.getLogger(__name__)

COMMIT_DELAY_ENV = "PLEXD_TEST_COMMIT_DELAY"


def node_id_of(agent: Agent) -> Callable[[], str]:
    """The node id now: a re-registration after a 401 can bring another, so parts ask at each use."""

    def node_id() -> str:
        assert agent.identity is not None
        return agent.identity.node_id

    return node_id


def backoff(cfg: Config) -> Backoff:
    """The retry schedule of everything that talks to the control plane (sse.*: 1 s doubling to 60 s, ±25 %)."""
    return Backoff(base=cfg.sse.backoff_base, cap=cfg.sse.backoff_max, jitter=cfg.sse.jitter)


def commit_delay() -> float:
    """The group-commit window (1 s). Test hook: PLEXD_TEST_COMMIT_DELAY widens it so a test can kill -9 the
    daemon between an event reaching the device and its bookkeeping being committed."""
    try:
        return float(os.environ.get(COMMIT_DELAY_ENV, "1"))
    except ValueError:
        return 1.0


# -- what the control plane has not taken yet ------------------------------------------------------------------


def drift_poster(agent: Agent, node_id: Callable[[], str]) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """POST /drift for one report (the uplink's drift lane sends with it)."""

    async def post_drift(report: dict[str, Any]) -> None:
        await agent.authed(lambda: agent.client.report_drift(node_id(), report))

    return post_drift


def build_uplink(agent: Agent, node_id: Callable[[], str]) -> tuple[UplinkOutbox, Senders]:
    """The one outbox (data_dir/uplink.db), a lane per stream. The NAT endpoint's lane is added with its domain."""

    senders = Senders({DRIFT: drift_poster(agent, node_id), SESSION_ACTIVITY: post_session_activity(agent, node_id)})
    uplink = UplinkOutbox(Path(agent.config.data_dir) / datadir.UPLINK_DB, senders, backoff=backoff(agent.config))
    return uplink, senders


async def drop_endpoint_report(body: dict[str, Any]) -> None:
    """A queued endpoint report with NAT traversal off since it was queued: stale by the time it could be sent."""
    log.info("a queued endpoint report was dropped unsent: NAT traversal is off")


# -- the mesh ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Nat:
    """STUN discovery, and what the first converge awaits: the listen port's hand-over."""

    service: NatService
    handover: PortHandover | None


def build_nat(cfg: Config, requests: Requests) -> Nat | None:
    """STUN discovery (plexd.nat), when enabled and a server is configured. The listen port is bound here, before
    any converge, so the first discovery asks from it before the device takes it. What it finds, the NAT domain
    reports (`nat_hooks`): a new mapping asks the engine for a converge."""
    nat = cfg.nat_traversal
    off = disabled_status(nat)
    if off is not None:
        log.info("NAT traversal is off: %s", off["reason"])
        return None
    handover = PortHandover.try_bind(cfg.mesh.listen_port)
    service = NatService(
        [parse_server(s) for s in nat.stun_servers], cfg.mesh.listen_port, requests.request,
        refresh_interval=nat.refresh_interval, timeout=nat.stun_timeout, handover=handover,
        local_target=lambda: urlsplit(cfg.api.url).hostname,
        backoff=Backoff(base=min(cfg.sse.backoff_base * 5, nat.refresh_interval), cap=nat.refresh_interval,
                        jitter=cfg.sse.jitter))
    return Nat(service, handover)


def nat_hooks(agent: Agent, node_id: Callable[[], str], nat: Nat, uplink: UplinkOutbox, store: DesiredStore,
              requests: Requests) -> NatHooks:
    """What the NAT domain needs: what discovery found, the uplink's lane, PUT /endpoint, and the answer's peers
    into the desired model."""

    async def report(endpoint: str, nat_type: str) -> list[PeerEndpoint]:
        return await agent.authed(lambda: agent.client.report_endpoint(node_id(), endpoint, nat_type))

    return NatHooks(nat.service.current, lambda: uplink, report, functools.partial(set_peer_endpoints, store, requests))


def build_mesh(cfg: Config, store: DesiredStore, *, verifier: Verifier, requests: Requests | None = None,
               hold: ReconcileHold | None = None,
               access: AccessHooks | None = None, cp_reachable: Callable[[], bool] | None = None,
               nat: NatHooks | None = None, before_first: Callable[[], Awaitable[None]] | None = None,
               persist: Callable[[], None] | None = None, known: bool = False) -> MeshHandle:
    """The engine for this machine and the mesh around the desired model.

    known=False (the daemon): a device that survived the last plexd (killed, or stopped without deregistering) is
    at least as new as the mirror, which is written a moment after each change; it is left as it is until the
    first state pull. Without a live device the mirror brings the interface and the last known peers up.
    `reconcile --once` builds its mesh here too, without the daemon's hooks (no sessions, relay or NAT)."""
    engine = build_engine(cfg, trusted_key(verifier), access, cp_reachable, nat)
    protected = ProtectedAddresses.from_config(cfg, wireguard(engine).links)
    return MeshHandle(engine, store, protected=protected, known=known, requests=requests, hold=hold,
                      before_first=before_first, persist=persist)


def initial_store(agent: Agent, ledger: EventLedger) -> DesiredStore:
    """The desired model at start, seeded from the mirror of the last run."""
    cfg = agent.config
    assert agent.identity is not None
    initial, restored = initial_desired(cfg, agent.identity, ledger.mirror())
    if restored:
        log.info("desired state restored from the mirror in %s (%d peers)", cfg.data_dir, len(initial.peers))
    return DesiredStore(initial)


# -- staying connected -----------------------------------------------------------------------------------------


def build_reconciler(agent: Agent, mesh: MeshHandle, verifier: Verifier, uplink: UplinkOutbox,
                     node_id: Callable[[], str]) -> Reconciler[Any]:
    """GET /state → the model → converge → POST /drift, through the uplink's drift lane."""

    pull = StatePull(mesh, lambda: agent.authed(lambda: agent.client.fetch_state(node_id())), verifier)
    reconciler: Reconciler[Any] = Reconciler(pull, mesh.gate, drift_poster(agent, node_id), clock=agent.clock,
                                             interval=agent.config.reconcile.interval, outbox=uplink)
    # A hold that runs out corrects what it held, as a release does (plexd.node.control)
    mesh.gate.hold.on_expiry(lambda: reconciler.trigger("reconcile hold expired"))
    return reconciler


def build_stream(agent: Agent, node_id: Callable[[], str], ledger: EventLedger, verifier: Verifier,
                 handlers: EventHandlers, reconciler: Reconciler[Any], uplink: UplinkOutbox) -> EventStream:
    cfg = agent.config

    def reconnected() -> None:
        """Whatever happened while we were away is pulled, and what waited to be sent goes now."""
        reconciler.trigger("event stream (re)connected")
        uplink.control_plane_back()

    def registered_key() -> tuple[str, str]:
        """The signing key the registration named, and its id (the platform's events name their key)."""
        identity = agent.identity
        return (identity.signing_public_key, identity.signing_key_id) if identity is not None else ("", "")

    return EventStream(
        agent.client.base_url, node_id, lambda: agent.client.token, ledger, verifier, handlers.dispatch,
        clock=agent.clock,
        on_connected=reconnected,
        on_auth_failure=functools.partial(reauthenticate, agent),
        poll=lambda: reconciler.trigger("polling while the event stream is down"),
        on_clock_agrees=lambda: reconciler.trigger("no event is held for this node's clock any more"),
        poll_interval=cfg.reconcile.interval,
        backoff=backoff(cfg),
        storm_backoff=backoff(cfg),
        idle_timeout=cfg.sse.idle_timeout,
        polling_after=cfg.sse.polling_after,
        reconnect_spread=cfg.sse.reconnect_spread,
        client_factory=lambda: stream_http_client(cfg.api.tls.ca_file, cfg.api.tls.insecure_skip_verify),
        dialect=lambda: agent.client.dialect,  # settled by the registration, before the stream starts
        platform=platform_events(verifier, cfg.data_dir, registered_key, node_id),
    )


async def reauthenticate(agent: Agent) -> None:
    await agent.reauthenticate(agent.client.token)


class DeviceCount:
    """Peers on the live device, counted before each heartbeat. Idle stays idle: the count the WireGuard domain
    keeps (the last full read of the device plus every change applied since) costs nothing; only without one is
    the device dumped."""

    def __init__(self, mesh: MeshHandle) -> None:
        self._mesh = mesh
        self.value = 0

    async def refresh(self) -> None:
        believed = wireguard(self._mesh.engine).believed_peer_count()
        if believed is not None:
            self.value = believed
            return
        try:
            counts = await self._mesh.peers_on_device()
        except PlexdError as exc:
            log.debug("cannot read the device for the heartbeat: %s", exc)
            counts = None
        self.value = counts[0] if counts is not None else 0


def bridge_heartbeat(engine: Any) -> dict[str, Any]:
    # Imported here, not at the top: only a bridge reads its domains (see plexd.bridge.wiring).
    from plexd.bridge.wiring import bridge_heartbeat as blocks

    return blocks(engine)


def path_heartbeat(paths: PathSelector) -> dict[str, Any]:
    """Peers with a bridge's fallback: which path each is on (an addition of plexd's; a control plane that does
    not know the key ignores it). Nothing when no peer has a fallback."""
    by_peer = paths.status()
    if not by_peer:
        return {}
    return {"paths": {"relayed": sum(1 for p in by_peer.values() if p["path"] == "relay"),
                      "peers": {pid: {"path": p["path"], "switches": p["switches"]} for pid, p in by_peer.items()}}}


def build_heartbeat(agent: Agent, node_id: Callable[[], str], mesh: MeshHandle, reconciler: Reconciler[Any],
                    stream: EventStream, rotation: KeyRotation, paths: PathSelector,
                    streak: FailureStreak) -> HeartbeatService:
    cfg = agent.config
    on_device = DeviceCount(mesh)

    def snapshot() -> HeartbeatSnapshot:
        status, reason = health(reconciler, mesh)
        return HeartbeatSnapshot(
            status=status, status_reason=reason,
            binary_checksum=agent.binary_checksum,
            # peers on the live device, not desired peers: the heartbeat reports what is, not what should be
            mesh=MeshInfo(cfg.mesh.interface, on_device.value, cfg.mesh.listen_port),
            nat=nat_part.info() if (nat_part := nat_endpoint(mesh.engine)) is not None else None,
            extra={**(bridge_heartbeat(mesh.engine) if cfg.mode == "bridge" else {}), **path_heartbeat(paths)},
        )

    async def send(body: dict[str, Any]) -> dict[str, bool]:
        # No agent.authed here: the heartbeat's own 401 path re-authenticates and the next tick retries.
        resp = await agent.client.heartbeat(node_id(), body)
        stream.control_plane_answered()  # back: a stream still waiting out its backoff need not
        return {"reconcile": resp.reconcile, "rotate_keys": resp.rotate_keys}

    return HeartbeatService(node_id, send, snapshot, clock=agent.clock, interval=cfg.heartbeat.interval,
                            trigger_reconcile=reconciler.trigger, rotate_keys=rotation.request,
                            on_auth_failure=functools.partial(reauthenticate, agent),
                            uptime=agent.uptime, refresh=on_device.refresh, streak=streak)


def build_paths(cfg: Config, mesh: MeshHandle) -> PathSelector:
    """Peers with a bridge's fallback endpoint: direct first, the relay when the direct path shows no handshake."""
    return PathSelector(mesh.store, wireguard(mesh.engine).device, mesh.request_converge,
                        probe_interval=cfg.mesh.path_probe_interval)


# -- the local socket and the node API -------------------------------------------------------------------------


def build_local_api(cfg: Config) -> LocalAPI:
    api = cfg.node_api
    return LocalAPI(api.socket_path, group=api.socket_group, request_timeout=api.request_timeout,
                    rate_limit=RateLimiter(api.rate_limit, api.rate_burst),
                    tcp_max_connections=api.http_max_connections, header_timeout=api.http_header_timeout)


def build_reports(agent: Agent, node_id: Callable[[], str], uplink: UplinkOutbox) -> tuple[ReportStore, ReportSync]:
    """Report entries from disk, and their lane of the uplink outbox (changes not acknowledged yet)."""
    cfg = agent.config

    async def send(entries: Any, deleted: Any) -> None:
        await agent.authed(lambda: agent.client.sync_reports(node_id(), entries, deleted))

    api_cfg = cfg.node_api
    reports = ReportStore(cfg.data_dir, max_entries=api_cfg.report_max_entries, max_bytes=api_cfg.report_max_bytes,
                          max_entry_bytes=api_cfg.report_max_entry_bytes)
    sync = ReportSync(reports, send, uplink, backoff=backoff(cfg))
    reports.subscribe(sync.changed)
    count = reports.load()
    sync.load(cfg.data_dir)
    if count:
        log.info("%d report entries loaded from %s", count, reports.dir)
    return reports, sync


def add_node_api(agent: Agent, local_api: LocalAPI, mesh: MeshHandle, reports: ReportStore,
                 node_id: Callable[[], str]) -> None:
    """The node API's routes (plexd.nodeapi) on the local socket: metadata, data, secrets, reports."""

    async def fetch_secret(key: str) -> Any:
        return await agent.client.fetch_secret(node_id(), key)

    def node_secret() -> str:
        return agent.identity.node_secret_key if agent.identity else ""

    def node_secret_kdf() -> str:
        return agent.identity.node_secret_kdf if agent.identity else ""

    add_node_api_routes(local_api, NodeApi(mesh.get_desired, reports, fetch_secret, node_secret=node_secret,
                                           node_secret_kdf=node_secret_kdf,
                                           secrets_group=agent.config.node_api.secrets_group))


# -- actions, telemetry ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionParts:
    dispatcher: ActionDispatcher
    journal: ActionJournal
    outbox: Outbox
    hooks: HookSet
    reloader: ConfigReloader


def build_actions(agent: Agent, node_id: Callable[[], str], uplink: UplinkOutbox, local_api: LocalAPI,
                  handlers: EventHandlers, reconciler: Reconciler[Any], upgrader: Upgrader,
                  view: Callable[[ConfigReloader], NodeView]) -> ActionParts:
    """The action dispatcher with its journal and outbox, the watched hook set, and their socket routes. It takes
    the actions of ``action_request`` events and of every state the reconciler pulls."""
    cfg = agent.config
    journal = ActionJournal(uplink, adopt=Path(cfg.data_dir) / datadir.ACTIONS_DB)

    async def send(message: Message) -> None:
        await agent.authed(lambda: deliver(agent.client, node_id(), message))

    outbox = Outbox(journal, send, backoff=backoff(cfg))

    async def publish(scan: HookScan) -> None:
        agent.hooks = scan
        await agent.announce_capabilities(rescan=False)

    hooks = HookSet(cfg.hooks.dir, journal, agent.hooks, publish, reverify=cfg.hooks.reverify, backoff=backoff(cfg))
    if agent.registered_now and agent.client.registration_carries_capabilities:
        hooks.mark_announced(agent.hooks)
    else:
        # A reused identity announces, since the code or the hooks may have changed while plexd was stopped; so
        # does a registration that could not carry them.
        hooks.request_announce(agent.hooks)
    reloader = ConfigReloader(cfg, functools.partial(setattr, agent, "config"))  # shutdown.* is read at the stop
    dispatcher = ActionDispatcher(cfg.actions, journal, outbox, hooks, view(reloader), node_id,
                                  LocalAudit(Path(cfg.data_dir) / datadir.LOCAL_AUDIT))
    reloader.subscribe(dispatcher.reconfigure)
    # An upgrade's execution is finished by the upgrader once its outcome is known, not as "interrupted".
    pending = upgrader.found
    dispatcher.recover(keep=frozenset({pending.execution_id} if pending else ()))
    handlers.register("action_request", dispatcher.handle_event)
    reconciler.on_pull(lambda pulled: dispatcher.offer(pulled.state.action_requests))
    dispatcher.put_off = reconciler.stale
    add_action_routes(local_api, dispatcher, require_admin(cfg.node_api.admin_group))
    return ActionParts(dispatcher, journal, outbox, hooks, reloader)


def build_telemetry(agent: Agent, node_id: Callable[[], str], mesh: MeshHandle, uplink: UplinkOutbox) -> Telemetry:
    """Metrics, logs and audit for the control plane, queued on disk (plexd.telemetry)."""
    cfg = agent.config
    posts = {"metrics": agent.client.send_metrics, "logs": agent.client.send_logs, "audit": agent.client.send_audit}

    async def post(stream: str, entries: Any) -> None:
        await agent.authed(lambda: posts[stream](node_id(), entries))

    async def read_counters() -> Any:
        try:
            return await wireguard(mesh.engine).counter_rows()
        except PlexdError as exc:
            log.debug("telemetry: cannot read the device: %s", exc)
            return None

    return Telemetry(cfg.telemetry, uplink, agent.registrar.hostname(), post,
                     read_counters=read_counters, desired_peers=lambda: mesh.get_desired().peers,
                     local_audit=str(Path(cfg.data_dir) / datadir.LOCAL_AUDIT),
                     older_queues=telemetry_db_paths(cfg.telemetry, cfg.data_dir))


def build_metrics(cfg: Config, mesh: MeshHandle) -> Scraped | None:
    """The local Prometheus endpoint, when config metrics.enabled (it serves the node's families once built)."""
    if not cfg.metrics.enabled:
        return None
    from plexd.node.metrics import MetricsEndpoint  # lazily: prometheus_client only when asked for

    return MetricsEndpoint(cfg.metrics.listen, mesh.gate, token_file=cfg.metrics.token_file,
                           max_connections=cfg.metrics.max_connections)


def node_view(agent: Agent, mesh: MeshHandle, stream: EventStream, reconciler: Reconciler[Any], upgrader: Upgrader,
              status: Callable[[], Awaitable[dict[str, Any]]]) -> Callable[[ConfigReloader], NodeView]:
    """What built-in actions may see and do of this node."""

    def identity() -> Any:
        assert agent.identity is not None
        return agent.identity

    async def device() -> list[dict[str, Any]]:
        from plexd.mesh.peers import peers_report

        rows, now = await peers_report(agent.config)
        return [r.to_json(now) for r in rows]

    async def firewall() -> Any:
        from plexd.node.policies_view import policies_document

        return await policies_document(mesh)

    async def reconnect() -> dict[str, Any]:
        stream.reconnect()
        result = await reconciler.run_once(reasons=("mesh.reconnect action",))
        return {"stream_reconnect": "requested", **result.to_json()}

    def view(reloader: ConfigReloader) -> NodeView:
        async def reload() -> dict[str, Any]:
            return reloader.reload()

        return NodeView(
            node_id=lambda: identity().node_id, mesh_ip=lambda: identity().mesh_ip, status=status,
            peer_ips=lambda: {p.id: p.mesh_ip for p in mesh.get_desired().peers.values()},
            device=device, firewall=firewall, config=lambda: agent.config.shown(), reconnect=reconnect,
            reload_config=reload, recent_logs=recent_lines, upgrade=upgrader.install)

    return view


def node_slot() -> Slot[Any]:
    """The whole node, for the one reader built before it: the `node.status` built-in action."""
    return Slot("node")
