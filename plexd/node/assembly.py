"""The composition root: the one place that builds the daemon's parts from the config and wires them together.

    Agent (lifecycle: start → register → supervised services → shutdown)       plexd.node.agent
      └─ assemble(agent) → Node
           mesh        MeshHandle: Engine (domains from plexd.node.domain_list) + DesiredStore + mirror + hold
           verifier    signing key and persisted nonces
           reconciler  GET /state → DesiredStore.replace_from_pull → converge → POST /drift
           handlers    verified events → DesiredStore.edit → converge
           stream      the signed SSE stream; reconnect → reconcile; 401 → agent.reauthenticate
           heartbeat   live values (peers on the device); reconcile:true → reconcile
           local_api   the daemon's Unix socket: status, reconcile, hold (plexd.node.control) and the node API
                       (plexd.nodeapi), which is also on TCP when node_api.http_enabled
           uplink      the one outbox (data_dir/uplink.db) of what the control plane has not taken yet, a lane
                       per stream: drift reports, session reports, action messages, report changes, telemetry
                       (service "uplink")
           report_sync report entries written through the node API → POST /report, by the uplink's lane
           actions     action_request → validate, ack, run (plexd.actions); acks, results and integrity
                       violations go by the uplink's lane, queued with their journal rows (in uplink.db); hooks
                       are watched and re-announced (services "hooks", "capabilities"); running actions are
                       drained at shutdown
           telemetry   metrics, logs and audit, collected (plexd.telemetry; services "telemetry_metrics",
                       "telemetry_logs", "telemetry_audit") → the uplink's lanes → POST /metrics, /logs, /audit

Every service is added to the agent by name and runs under its supervisor. Tests build a Node with their own
parts through the keyword arguments of `assemble` (a recording engine, say) rather than by patching.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
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
from plexd.base.clock import Clock
from plexd.base.errors import PlexdError
from plexd.base.heap import HeapSettler
from plexd.base.log import recent_lines
from plexd.base.ratelimit import RateLimiter
from plexd.bridge.status import status_reports
from plexd.config import datadir
from plexd.config.settings import Config
from plexd.controlplane.client import ControlPlaneClient, PeerEndpoint
from plexd.controlplane.event_signing import InvalidSigningKeys, Verifier, key_fingerprint
from plexd.controlplane.event_stream import EventStream, stream_http_client
from plexd.controlplane.ledger import EventLedger
from plexd.controlplane.uplink import UplinkOutbox
from plexd.converge.engine import Engine
from plexd.identity.identity_store import Identity
from plexd.nat.endpoint_domain import KIND as NAT_KIND
from plexd.nat.endpoint_domain import Endpoint, NatHooks
from plexd.nat.nat_service import NatService, PortHandover, disabled_status
from plexd.nat.servers import parse_server
from plexd.node.access import SESSION_ACTIVITY, access_hooks, post_session_activity
from plexd.node.agent import Agent
from plexd.node.control import add_control_routes, health, live_status
from plexd.node.domain_list import build_engine, nat_endpoint, sessions, wireguard
from plexd.node.durable import GroupCommit
from plexd.node.key_rotation import KeyRotation
from plexd.node.mesh import (
    MeshHandle,
    build_verifier,
    initial_desired,
    state_applier,
    state_fetcher,
    state_planner,
    trusted_key,
)
from plexd.node.parts import Node
from plexd.node.protected import ProtectedAddresses
from plexd.node.reload import ConfigReloader
from plexd.node.status_text import utc
from plexd.node.supervisor import FatalError
from plexd.nodeapi.local_api import LocalAPI, require_admin
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.routes import NodeApi, add_node_api_routes
from plexd.nodeapi.sync import ReportSync
from plexd.services.event_handlers import EventHandlers, apply_signing_keys
from plexd.services.heartbeat import HeartbeatService, HeartbeatSnapshot, MeshInfo
from plexd.services.paths import PathSelector
from plexd.services.reconciler import Reconciler, drift_uplink
from plexd.services.status_reports import StatusReports
from plexd.state.model import SigningKeys
from plexd.system.systemd import Watchdog, watchdog_interval
from plexd.telemetry.service import Telemetry, telemetry_db_paths
from plexd.trust.integrity import HookScan
from plexd.upgrade.upgrader import Upgrader

log = logging.getLogger(__name__)

COMMIT_DELAY_ENV = "PLEXD_TEST_COMMIT_DELAY"
OUTBOX_FLUSH = 5.0  # at shutdown, how long undelivered action results may hold up the exit
SESSION_REPORTS_FLUSH = 2.0  # at shutdown, how long the sessions' last reports may hold up the exit
DRAIN_RESERVE = 4.0  # of the stop budget, kept after the actions drain: 1 s flush, deregister, teardown
WATCHDOG_STUCK = 0.5  # of WatchdogSec: a converge running longer than this withholds the watchdog ping


def assemble(agent: Agent, *, mesh: MeshHandle | None = None) -> Node:
    cfg = agent.config
    data_dir = Path(cfg.data_dir)
    assert agent.identity is not None
    ledger = EventLedger(data_dir / datadir.EVENT_LEDGER)

    def node_id() -> str:
        assert agent.identity is not None
        return agent.identity.node_id

    verifier = build_verifier(data_dir, agent.clock, agent.identity.signing_public_key, ledger, node_id)
    nat_service: list[NatService | None] = [None]  # built after the mesh: its hand-over holds the first converge
    if mesh is None:
        access = access_hooks(agent, verifier, node_id, data_dir / datadir.LOCAL_AUDIT, lambda: uplink)
        # A bridge's relay keeps its sessions through an outage: the control plane is "reachable" until the
        # heartbeat, which runs every interval, fails.
        mesh = _build_mesh(agent, ledger.mirror(), verifier, access, lambda: heartbeat.consecutive_failures == 0,
                           _nat_hooks(agent, node_id, lambda: nat_service[0], lambda: uplink, lambda: mesh))
    durable = GroupCommit(ledger, delay=_commit_delay(), touched=lambda: mesh.store.take_touched("mirror"))
    mesh.store.on_changed = durable.desired_changed
    mesh.persist = durable.persist_now

    async def close_bookkeeping(agent: Agent) -> None:
        await durable.close()
        ledger.close(agent.clock.now().timestamp())

    agent.on_shutdown("event bookkeeping", close_bookkeeping)  # added last: runs first of the teardown steps

    async def reauthenticate() -> None:
        await agent.reauthenticate(agent.client.token)

    def adopt_identity(identity: Identity) -> None:
        # A registration is, with a signed rotation event, one of the two sources of the signing key: one that
        # answers with another key (a rotation this node missed) must be trusted now, not at the next start;
        # else every event is refused and the signing_key domain writes the old key back over the new file.
        key = identity.signing_public_key
        if verifier.keys is not None and verifier.keys.current == key:
            return
        try:
            apply_signing_keys(verifier, data_dir, SigningKeys(current=key))
        except InvalidSigningKeys as exc:  # the registrar checked it; a second look costs nothing
            log.error("the registration's signing key is unusable (%s); the previous one stays", exc)
            return
        log.warning("the control plane answered the re-registration with another signing key (%s); trusting it",
                    key_fingerprint(key))

    agent.adopt_identity = adopt_identity

    async def post_drift(report: dict[str, Any]) -> None:
        await agent.authed(lambda: agent.client.report_drift(node_id(), report))

    async def post_endpoint(body: dict[str, Any]) -> None:
        part = nat_endpoint(mesh.engine)
        if part is None:  # NAT traversal turned off since it was queued: stale by the time it could be sent
            log.info("a queued endpoint report was dropped unsent: NAT traversal is off")
            return
        await part.deliver(body)

    uplink = drift_uplink(data_dir / datadir.UPLINK_DB, post_drift, _backoff(cfg),
                          **{SESSION_ACTIVITY: post_session_activity(agent, node_id), NAT_KIND: post_endpoint})
    agent.on_shutdown("uplink outbox", lambda a: _close(uplink))
    # In the drain, on every stop (a plain stop too: the listeners die with the process anyway).
    agent.on_shutdown("access sessions", lambda a: close_sessions(a, mesh.engine, uplink), phase="drain")
    reconciler = Reconciler(
        state_fetcher(mesh, lambda: agent.authed(lambda: agent.client.fetch_state(node_id()))),
        state_applier(mesh, verifier), mesh.converge, post_drift,
        clock=agent.clock, interval=cfg.reconcile.interval, refusals=mesh.take_refusals, outbox=uplink,
        apply_events=lambda dry_run=False: mesh.apply_events(), events_pending=lambda: mesh.pending_requests,
        plan_state=state_planner(mesh))

    # A hold that runs out corrects what it held, as a release does (plexd.node.control)
    mesh.hold.on_expired = lambda: reconciler.trigger("reconcile hold expired")
    rotation = KeyRotation(agent, mesh)
    handlers = EventHandlers(mesh.store, mesh.request_converge, reconciler.trigger, verifier, data_dir,
                             rotate_keys=rotation.request, refresh_state=reconciler.refresh)
    def reconnected() -> None:
        """Whatever happened while we were away is pulled, and what waited to be sent goes now."""
        reconciler.trigger("event stream (re)connected")
        uplink.control_plane_back()

    stream = EventStream(
        agent.client.base_url, node_id, lambda: agent.client.token, ledger, verifier, handlers.dispatch,
        clock=agent.clock,
        on_connected=reconnected,
        on_auth_failure=reauthenticate,
        poll=lambda: reconciler.trigger("polling while the event stream is down"),
        poll_interval=cfg.reconcile.interval,
        backoff=_backoff(cfg),
        storm_backoff=_backoff(cfg),
        idle_timeout=cfg.sse.idle_timeout,
        polling_after=cfg.sse.polling_after,
        reconnect_spread=cfg.sse.reconnect_spread,
        client_factory=lambda: stream_http_client(cfg.api.tls.ca_file, cfg.api.tls.insecure_skip_verify),
    )
    nat = nat_service[0] = _build_nat(agent, mesh)
    on_device = [0]  # peers on the device, counted before each heartbeat

    async def observe_device() -> None:
        # Idle stays idle: the count the WireGuard domain keeps (the last full read of the device plus every change
        # applied since) costs nothing; only without one is the device dumped.
        believed = wireguard(mesh.engine).believed_peer_count()
        if believed is not None:
            on_device[0] = believed
            return
        try:
            counts = await mesh.peers_on_device()
        except PlexdError as exc:
            log.debug("cannot read the device for the heartbeat: %s", exc)
            counts = None
        on_device[0] = counts[0] if counts is not None else 0

    def bridge_heartbeat(engine: Any) -> dict[str, Any]:
        # Imported here, not at the top: only a bridge reads its domains (see plexd.bridge.wiring).
        from plexd.bridge.wiring import bridge_heartbeat as blocks

        return blocks(engine)

    def path_heartbeat() -> dict[str, Any]:
        """Peers with a bridge's fallback: which path each is on (an addition of plexd's; a control plane that
        does not know the key ignores it). Nothing when no peer has a fallback."""
        by_peer = node.paths.status() if node.paths is not None else {}
        if not by_peer:
            return {}
        return {"paths": {"relayed": sum(1 for p in by_peer.values() if p["path"] == "relay"),
                          "peers": {pid: {"path": p["path"], "switches": p["switches"]} for pid, p in by_peer.items()}}}

    def snapshot() -> HeartbeatSnapshot:
        status, reason = health(reconciler, mesh)
        return HeartbeatSnapshot(
            status=status, status_reason=reason,
            binary_checksum=agent.binary_checksum,
            # peers on the live device, not desired peers: the heartbeat reports what is, not what should be
            mesh=MeshInfo(cfg.mesh.interface, on_device[0], cfg.mesh.listen_port),
            nat=nat_part.info() if (nat_part := nat_endpoint(mesh.engine)) is not None else None,
            extra={**(bridge_heartbeat(mesh.engine) if cfg.mode == "bridge" else {}), **path_heartbeat()},
        )

    async def send(body: dict[str, Any]) -> dict[str, bool]:
        # No agent.authed here: the heartbeat's own 401 path re-authenticates and the next tick retries.
        resp = await agent.client.heartbeat(node_id(), body)
        stream.control_plane_answered()  # back: a stream still waiting out its backoff need not
        return {"reconcile": resp.reconcile, "rotate_keys": resp.rotate_keys}

    heartbeat = HeartbeatService(node_id, send, snapshot, clock=agent.clock, interval=cfg.heartbeat.interval,
                                 trigger_reconcile=reconciler.trigger, rotate_keys=rotation.request,
                                 on_auth_failure=reauthenticate,
                                 uptime=agent.uptime, refresh=observe_device)
    api_cfg = cfg.node_api
    local_api = LocalAPI(api_cfg.socket_path, group=api_cfg.socket_group, request_timeout=api_cfg.request_timeout,
                         rate_limit=RateLimiter(api_cfg.rate_limit, api_cfg.rate_burst),
                         tcp_max_connections=api_cfg.http_max_connections,
                         header_timeout=api_cfg.http_header_timeout)
    reports, report_sync = _build_reports(agent, node_id, uplink)
    node = Node(agent, mesh, verifier, reconciler, handlers, stream, heartbeat, local_api, rotation, nat, reports,
                report_sync, uplink=uplink)
    add_control_routes(local_api, node)
    node.upgrader = Upgrader(agent, lambda: upgrade_health(reconciler, heartbeat))
    node.actions = _build_actions(node, node_id)
    node.upgrader.finish = node.actions.finish_deferred

    async def fetch_secret(key: str) -> Any:
        return await agent.client.fetch_secret(node_id(), key)

    add_node_api_routes(local_api, NodeApi(mesh.get_desired, reports, fetch_secret,
                                           node_secret=lambda: agent.identity.node_secret_key if agent.identity else "",
                                           node_secret_kdf=lambda: agent.identity.node_secret_kdf if agent.identity
                                           else "",
                                           secrets_group=api_cfg.secrets_group))
    http_token = read_http_token(cfg) if api_cfg.http_enabled else None

    agent.add_service("reconciler", lambda a: reconciler.run())
    agent.add_service("uplink", lambda a: uplink.run())
    agent.add_service("event_converge", lambda a: mesh.converge_requested())
    agent.add_service("events", lambda a: stream.run())
    agent.add_service("heartbeat", lambda a: heartbeat.run())
    agent.add_service("key_rotation", lambda a: rotation.run())
    agent.add_service("upgrade", lambda a: node.upgrader.run())  # ends once an upgrade's outcome is reported
    # The socket stops last: `plexd deregister` is answered once the teardown is done.
    agent.add_service("local_api", lambda a: _serve_local_api(local_api, api_cfg.http_listen, http_token),
                      stop_last=True)
    agent.on_shutdown("local socket", lambda a: local_api.stop(grace=2.0), phase="final")
    if cfg.mode == "bridge":  # the bridge's state as status.* report entries, republished when it changes
        status = StatusReports(reports, lambda: status_reports(bridge_heartbeat(mesh.engine)), cfg.heartbeat.interval)
        agent.add_service("status_reports", lambda a: status.run())
    # Peers with a bridge's fallback endpoint: direct first, the relay when the direct path shows no handshake.
    paths = node.paths = PathSelector(mesh.store, wireguard(mesh.engine).device, mesh.request_converge,
                                      probe_interval=cfg.mesh.path_probe_interval)
    agent.add_service("paths", lambda a: paths.run())
    if nat is not None:
        agent.add_service("nat", lambda a: nat.run())
    telemetry = node.telemetry = _build_telemetry(node, node_id)
    for name, run in telemetry.services().items():
        agent.add_service(name, lambda a, run=run: run())
    # teardown, not final: `plexd deregister --purge` is answered after the teardown and removes data_dir
    agent.on_shutdown("telemetry queue", lambda a: telemetry.close())
    if cfg.metrics.enabled:
        from plexd.node.metrics import MetricsEndpoint  # lazily: prometheus_client only when asked for

        node.metrics = MetricsEndpoint(node, cfg.metrics.listen, token_file=cfg.metrics.token_file,
                                       max_connections=cfg.metrics.max_connections)
        agent.add_service("metrics", lambda a: node.metrics.serve())
    agent.ready = reconciler.started.wait
    agent.describe = lambda: describe(node)
    _add_watchdog(node)
    return node


def upgrade_health(reconciler: Reconciler, heartbeat: HeartbeatService) -> str | None:
    """What a newly upgraded daemon still lacks to be called healthy, or None: its first converge ran and the
    control plane accepted a heartbeat, which carries the new binary checksum."""
    if not reconciler.started.is_set():
        return "its first converge has not run"
    if heartbeat.sent == 0:
        return "no heartbeat accepted yet" + (f" ({heartbeat.last_error})" if heartbeat.last_error else "")
    return None


def describe(node: Node) -> str:
    """The node in one line, for systemd's STATUS=: "connected, 12 peers", "control plane unreachable since …"."""
    believed = wireguard(node.mesh.engine).believed_peer_count()
    peers = believed if believed is not None else len(node.mesh.get_desired().peers)
    stream = node.stream.status()
    if stream["state"] == "connected":
        return f"connected, {peers} peers"
    since = utc(stream["since"])
    if stream["state"] == "polling":
        return f"event stream down since {since}, polling the control plane; {peers} peers"
    return f"control plane unreachable since {since}; running from data_dir with {peers} peers"


def _add_watchdog(node: Node) -> None:
    """STATUS= lines while systemd supervises us; WATCHDOG=1 too when the unit has WatchdogSec."""
    agent = node.agent
    interval = watchdog_interval()
    if interval is None and not os.environ.get("NOTIFY_SOCKET"):
        return
    stuck_limit = (interval or 0) * 3 * WATCHDOG_STUCK

    def healthy() -> str | None:
        stuck = node.mesh.stuck_for()
        if stuck > stuck_limit:
            return f"a converge has been running for {stuck:.0f}s"
        return None

    dog = Watchdog(interval or 5.0, healthy, agent.status_line, ping=interval is not None, clock=agent.clock)
    agent.add_service("watchdog", lambda a: dog.run(), stop_last=True)  # pings through a long drain too


def _build_mesh(agent: Agent, mirror: dict | None, verifier: Verifier, access: AccessHooks,
                cp_reachable: Callable[[], bool], nat: NatHooks | None) -> MeshHandle:
    """The engine for this machine and the desired model, seeded from the mirror of the last run."""
    cfg = agent.config
    assert agent.identity is not None
    initial, restored = initial_desired(cfg, agent.identity, mirror)
    if restored:
        log.info("desired state restored from the mirror in %s (%d peers)", cfg.data_dir, len(initial.peers))
    engine = build_engine(cfg, trusted_key(verifier), access, cp_reachable, nat)
    protected = ProtectedAddresses.from_config(cfg, wireguard(engine).links)
    # known=False: a device that survived the last plexd (killed, or stopped without deregistering) is at least
    # as new as the mirror, which is written a moment after each change; it is left as it is until the first
    # state pull. Without a live device the mirror brings the interface and the last known peers up.
    mesh = MeshHandle(engine, initial, protected=protected, known=False)

    async def teardown(agent: Agent) -> None:
        if agent.tears_down:
            await engine.teardown()
            log.info("mesh interface %s removed", cfg.mesh.interface)

    agent.on_shutdown("mesh teardown", teardown)
    return mesh


async def close_sessions(agent: Agent, engine: Engine, uplink: UplinkOutbox) -> None:
    """Every access session closed (clients told, processes hung up), then their session_ended reports sent
    while the node is still registered (what does not go in time stays queued in uplink.db)."""
    domain = sessions(engine)
    if domain is None:
        return
    await domain.close_all("plexd_close")
    try:
        await asyncio.wait_for(uplink.deliver(SESSION_ACTIVITY),
                               timeout=min(SESSION_REPORTS_FLUSH, agent.time_left(DRAIN_RESERVE)))
    except TimeoutError:
        log.warning("session_ended reports not all sent before leaving; %d queued", uplink.size(SESSION_ACTIVITY))


def _build_reports(agent: Agent, node_id: Callable[[], str],
                   uplink: UplinkOutbox) -> tuple[ReportStore, ReportSync]:
    """Report entries from disk, and their lane of the uplink outbox (changes not acknowledged yet)."""
    cfg = agent.config

    async def send(entries: Any, deleted: Any) -> None:
        await agent.authed(lambda: agent.client.sync_reports(node_id(), entries, deleted))

    api_cfg = cfg.node_api
    reports = ReportStore(cfg.data_dir, max_entries=api_cfg.report_max_entries, max_bytes=api_cfg.report_max_bytes,
                          max_entry_bytes=api_cfg.report_max_entry_bytes)
    sync = ReportSync(reports, send, uplink, backoff=_backoff(cfg))
    reports.on_change = sync.changed
    count = reports.load()
    sync.load(cfg.data_dir)
    if count:
        log.info("%d report entries loaded from %s", count, reports.dir)
    return reports, sync


def _build_telemetry(node: Node, node_id: Callable[[], str]) -> Telemetry:
    """Metrics, logs and audit for the control plane, queued on disk (plexd.telemetry)."""
    agent, cfg = node.agent, node.agent.config
    posts = {"metrics": agent.client.send_metrics, "logs": agent.client.send_logs, "audit": agent.client.send_audit}

    async def post(stream: str, entries: Any) -> None:
        await agent.authed(lambda: posts[stream](node_id(), entries))

    async def read_counters() -> Any:
        try:
            return await wireguard(node.mesh.engine).counter_rows()
        except PlexdError as exc:
            log.debug("telemetry: cannot read the device: %s", exc)
            return None

    assert node.uplink is not None
    return Telemetry(cfg.telemetry, node.uplink, agent.registrar.hostname(), post,
                     read_counters=read_counters, desired_peers=lambda: node.mesh.get_desired().peers,
                     local_audit=str(Path(cfg.data_dir) / datadir.LOCAL_AUDIT),
                     older_queues=telemetry_db_paths(cfg.telemetry, cfg.data_dir))


def _build_actions(node: Node, node_id: Callable[[], str]) -> ActionDispatcher:
    """The action dispatcher with its journal and outbox, the watched hook set, and their socket routes."""
    agent, cfg = node.agent, node.agent.config
    assert node.uplink is not None
    journal = ActionJournal(node.uplink, adopt=Path(cfg.data_dir) / datadir.ACTIONS_DB)

    async def send(message: Message) -> None:
        await agent.authed(lambda: deliver(agent.client, node_id(), message))

    outbox = Outbox(journal, send, backoff=_backoff(cfg))

    async def publish(scan: HookScan) -> None:
        agent.hooks = scan
        await agent.announce_capabilities(rescan=False)

    hooks = HookSet(cfg.hooks.dir, journal, agent.hooks, publish, reverify=cfg.hooks.reverify, backoff=_backoff(cfg))
    if agent.registered_now:
        hooks.mark_announced(agent.hooks)  # the registration carried them
    else:
        # A reused identity announces, since the code or the hooks may have changed while plexd was stopped.
        hooks.request_announce(agent.hooks)
    def apply(running: Config) -> None:
        dispatcher.config = running.actions
        agent.config = running  # shutdown.* is read at the stop

    reloader = ConfigReloader(cfg, apply)
    agent.reload_config = reloader.reload  # SIGHUP
    dispatcher = ActionDispatcher(cfg.actions, journal, outbox, hooks, _node_view(node, reloader), node_id,
                                  LocalAudit(Path(cfg.data_dir) / datadir.LOCAL_AUDIT))
    # An upgrade's execution is finished by the upgrader once its outcome is known, not as "interrupted".
    pending = node.upgrader.found if node.upgrader is not None else None
    dispatcher.recover(keep=frozenset({pending.execution_id} if pending else ()))
    node.handlers.register("action_request", dispatcher.handle_event)
    add_action_routes(node.local_api, dispatcher, require_admin(cfg.node_api.admin_group))

    async def drain(agent: Agent) -> None:
        # Within the stop budget: the flush, the deregistration and the teardown keep their share.
        await dispatcher.drain(min(agent.config.shutdown.drain, agent.time_left(reserve=DRAIN_RESERVE)))
        if not await outbox.flush(min(OUTBOX_FLUSH, agent.time_left(reserve=DRAIN_RESERVE - 1))):
            log.warning("%d action message(s) not delivered before shutdown; they are sent after the next start",
                        journal.outbox_size())

    agent.on_shutdown("actions drain", drain, phase="drain")
    agent.add_service("hooks", lambda a: hooks.watch())
    agent.add_service("capabilities", lambda a: hooks.announce())
    return dispatcher


async def _close(store: UplinkOutbox) -> None:
    store.close()



def _node_view(node: Node, reloader: ConfigReloader) -> NodeView:
    """What built-in actions may see and do of this node."""
    agent, mesh = node.agent, node.mesh

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
        node.stream.reconnect()
        result = await node.reconciler.run_once(reasons=("mesh.reconnect action",))
        return {"stream_reconnect": "requested", **result.to_json()}

    async def reload() -> dict[str, Any]:
        return reloader.reload()

    return NodeView(
        node_id=lambda: identity().node_id, mesh_ip=lambda: identity().mesh_ip,
        status=lambda: live_status(node),
        peer_ips=lambda: {p.id: p.mesh_ip for p in mesh.get_desired().peers.values()},
        device=device, firewall=firewall, config=lambda: agent.config.shown(), reconnect=reconnect,
        reload_config=reload, recent_logs=recent_lines,
        upgrade=node.upgrader.install if node.upgrader is not None else None)


def read_http_token(config: Config) -> str:
    """The TCP listener's bearer token (node_api.http_token_file, whitespace trimmed). Missing or empty: the
    daemon does not start, since the listener would otherwise be open or useless."""
    path = config.node_api.http_token_file
    if not path:
        raise PlexdError("node_api.http_enabled is true but node_api.http_token_file is not set: the TCP listener "
                         "needs a bearer token file")
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PlexdError(f"node_api.http_token_file: cannot read {path}: {reason}") from None
    if not token:
        raise PlexdError(f"node_api.http_token_file: {path} is empty; the TCP listener needs a bearer token")
    return token


def _build_nat(agent: Agent, mesh: MeshHandle) -> NatService | None:
    """STUN discovery (plexd.nat), when enabled and a server is configured. The listen port is bound here, before
    any converge, so the first discovery asks from it before the device takes it. What it finds, the NAT domain
    reports (`_nat_hooks`): a new mapping asks the engine for a converge."""
    cfg = agent.config
    nat = cfg.nat_traversal
    off = disabled_status(nat)
    if off is not None:
        log.info("NAT traversal is off: %s", off["reason"])
        return None
    handover = PortHandover.try_bind(cfg.mesh.listen_port)
    if handover is not None:
        mesh.before_first_converge = handover.released
    return NatService(
        [parse_server(s) for s in nat.stun_servers], cfg.mesh.listen_port, mesh.request_converge,
        refresh_interval=nat.refresh_interval, timeout=nat.stun_timeout, handover=handover,
        local_target=lambda: urlsplit(cfg.api.url).hostname,
        backoff=Backoff(base=min(cfg.sse.backoff_base * 5, nat.refresh_interval), cap=nat.refresh_interval,
                        jitter=cfg.sse.jitter))


def _nat_hooks(agent: Agent, node_id: Callable[[], str], service: Callable[[], NatService | None],
               uplink: Callable[[], UplinkOutbox], mesh: Callable[[], MeshHandle]) -> NatHooks | None:
    """What the NAT domain needs, when NAT traversal is on; the service, the uplink and the mesh are built after
    the engine, so each is asked for when used."""
    if disabled_status(agent.config.nat_traversal) is not None:
        return None

    async def report(endpoint: str, nat_type: str) -> list[PeerEndpoint]:
        return await agent.authed(lambda: agent.client.report_endpoint(node_id(), endpoint, nat_type))

    def current() -> Endpoint | None:
        nat = service()
        return nat.current() if nat is not None else None

    return NatHooks(current, uplink, report, lambda peers: mesh().set_peer_endpoints(peers))


def _backoff(cfg: Config) -> Backoff:
    """The retry schedule of everything that talks to the control plane (sse.*: 1 s doubling to 60 s, ±25 %)."""
    return Backoff(base=cfg.sse.backoff_base, cap=cfg.sse.backoff_max, jitter=cfg.sse.jitter)


def _commit_delay() -> float:
    """The group-commit window (1 s). Test hook: PLEXD_TEST_COMMIT_DELAY widens it so a test can kill -9 the
    daemon between an event reaching the device and its bookkeeping being committed."""
    try:
        return float(os.environ.get(COMMIT_DELAY_ENV, "1"))
    except ValueError:
        return 1.0


async def _serve_local_api(api: LocalAPI, http_listen: str, http_token: str | None) -> None:
    try:
        await api.start()
    except PlexdError as exc:
        if "another plexd" in str(exc):  # two daemons would fight over one interface: no restart fixes that
            raise FatalError(str(exc)) from None
        raise
    try:
        if http_token is not None:
            host, _, port = http_listen.rpartition(":")
            await api.listen_tcp(host.strip("[]"), int(port), http_token)
        await asyncio.Event().wait()  # serve until cancelled
    finally:
        await api.stop()


# The event path shares the GIL with worker threads that parse a device dump or queue telemetry (tens of ms each
# at 5,000 peers). Python makes a waiting thread wait up to 5 ms for the GIL by default, and an event waits at each
# of its I/O steps: 30-60 ms in all while telemetry collected (bench event_latency --peers 5000). At 0.5 ms the
# event loop gets the GIL back at once; the extra switches happen only while a worker thread is busy.
GIL_SWITCH_INTERVAL = 0.0005


async def run(config: Config, *, clock: Clock | None = None, stop_event: asyncio.Event | None = None,
              client: ControlPlaneClient | None = None, assemble: Callable[[Agent], Node] = assemble) -> int:
    """``plexd up``: the lifecycle with this assembly."""
    from plexd.node import agent as lifecycle

    if config.node_api.http_enabled:
        read_http_token(config)  # refuse to start at once, before registering, with one clear line
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    try:
        with HeapSettler(asyncio.get_running_loop()):
            return await lifecycle.run(config, assemble, clock=clock, stop_event=stop_event, client=client)
    finally:
        sys.setswitchinterval(switch_interval)  # run in-process (tests): leave the interpreter as it was
