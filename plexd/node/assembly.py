"""The composition root: the one place that builds the daemon's parts from the config and wires them together.

    Agent (lifecycle: start → register → supervised services → shutdown)       plexd.node.agent
      └─ assemble(agent) → Node (plexd.node.parts), each part made by a builder of plexd.node.builders
           mesh        MeshHandle: Engine (domains from plexd.node.domain_list) + DesiredStore + mirror, and its
                       Gate (plexd.converge.gate): full or delta, applied, dry run, held or kept
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

Parts are built in dependency order and the Node is filled once. The one circle (the `node.status` built-in
action reads the whole node, which holds the action dispatcher) is closed by a typed `Slot`. Every service is
added to the agent by name, and every shutdown step, here and in order; each service runs under its supervisor.
Tests build a Node with their own mesh through the keyword argument of `assemble` (a recording engine, say)
rather than by patching.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexd.base import failpoint
from plexd.base.clock import Clock
from plexd.base.errors import PlexdError
from plexd.base.heap import HeapSettler
from plexd.base.slot import Slot
from plexd.bridge.status import status_reports
from plexd.config import datadir
from plexd.config.settings import Config
from plexd.controlplane.client import ControlPlaneClient
from plexd.controlplane.ledger import EventLedger
from plexd.controlplane.uplink import UplinkOutbox
from plexd.converge.coalesce import Requests
from plexd.converge.engine import Engine
from plexd.converge.hold import ReconcileHold
from plexd.nat.endpoint_domain import KIND as NAT_KIND
from plexd.node import builders as b
from plexd.node.access import SESSION_ACTIVITY, access_hooks
from plexd.node.agent import Agent
from plexd.node.control import add_control_routes, live_status
from plexd.node.domain_list import nat_endpoint, sessions
from plexd.node.durable import GroupCommit
from plexd.node.key_rotation import KeyRotation
from plexd.node.mesh import MeshHandle, build_verifier
from plexd.node.parts import Node
from plexd.node.supervisor import FatalError
from plexd.nodeapi.local_api import LocalAPI
from plexd.services.event_handlers import EventHandlers
from plexd.services.heartbeat import FailureStreak, HeartbeatService
from plexd.services.pull_freshness import PullFreshness
from plexd.services.reconciler import Reconciler
from plexd.services.status_reports import StatusReports
from plexd.system.systemd import Watchdog, watchdog_interval
from plexd.upgrade.upgrader import Upgrader

log = logging.getLogger(__name__)

OUTBOX_FLUSH = 5.0  # at shutdown, how long undelivered action results may hold up the exit
SESSION_REPORTS_FLUSH = 2.0  # at shutdown, how long the sessions' last reports may hold up the exit
DRAIN_RESERVE = 4.0  # of the stop budget, kept after the actions drain: 1 s flush, deregister, teardown
WATCHDOG_STUCK = 0.5  # of WatchdogSec: a converge running longer than this withholds the watchdog ping


def assemble(agent: Agent, *, mesh: MeshHandle | None = None) -> Node:
    """Every part, in dependency order. `mesh`: a test's own (a recording engine, say) instead of the machine's; it
    brings its own `persist` and NAT hand-over, if it wants them (`MeshHandle`'s keyword arguments)."""
    cfg, data_dir, node_id = agent.config, Path(agent.config.data_dir), b.node_id_of(agent)
    assert agent.identity is not None
    own_mesh = mesh is None
    ledger = EventLedger(data_dir / datadir.EVENT_LEDGER)
    verifier = build_verifier(data_dir, agent.clock, agent.identity.signing_public_key, ledger, node_id)
    uplink, senders = b.build_uplink(agent, node_id)
    streak = FailureStreak()  # the heartbeat's; a bridge's relay keeps its sessions while the control plane is away
    requests = mesh.gate.requests if mesh is not None else Requests()
    nat = b.build_nat(cfg, requests)
    if mesh is None:
        store = b.initial_store(agent, ledger)
        bookkeeping = GroupCommit(ledger, store, b.commit_delay())
        mesh = b.build_mesh(
            cfg, store, verifier=verifier, requests=requests, hold=ReconcileHold(), cp_reachable=streak.reachable,
            access=access_hooks(agent, verifier, node_id, data_dir / datadir.LOCAL_AUDIT, uplink),
            nat=b.nat_hooks(agent, node_id, nat, uplink, store, requests) if nat is not None else None,
            before_first=nat.handover.released if nat is not None and nat.handover is not None else None,
            persist=bookkeeping.persist_now)
    else:
        bookkeeping = GroupCommit(ledger, mesh.store, b.commit_delay())
    nat_domain = nat_endpoint(mesh.engine)
    senders.add(NAT_KIND, nat_domain.deliver if nat_domain is not None else b.drop_endpoint_report)
    reconciler = b.build_reconciler(agent, mesh, verifier, uplink, node_id)
    rotation = KeyRotation(agent, mesh)
    handlers = EventHandlers(mesh.store, mesh.request_converge, reconciler.trigger, verifier, data_dir,
                             rotate_keys=rotation.request, refresh_state=reconciler.refresh, stale=reconciler.stale)
    stream = b.build_stream(agent, node_id, ledger, verifier, handlers, reconciler, uplink)
    # An interval cycle skips the state pull while this stream has carried every event since the last one
    reconciler.freshness = PullFreshness(lambda: stream.continuity, agent.clock, cfg.reconcile.pull_interval)
    paths = b.build_paths(cfg, mesh)
    heartbeat = b.build_heartbeat(agent, node_id, mesh, reconciler, stream, rotation, paths, streak)
    local_api = b.build_local_api(cfg)
    reports, report_sync = b.build_reports(agent, node_id, uplink)
    b.add_node_api(agent, local_api, mesh, reports, node_id)
    upgrader = Upgrader(agent, lambda: upgrade_health(reconciler, heartbeat))
    whole: Slot[Node] = Slot("node")  # the node.status built-in action reads the node that holds the dispatcher
    actions = b.build_actions(agent, node_id, uplink, local_api, handlers, reconciler, upgrader,
                              b.node_view(agent, mesh, stream, reconciler, upgrader, lambda: live_status(whole.get())))
    node = whole.fill(Node(
        agent, mesh, bookkeeping, verifier, uplink, reconciler, handlers, stream, heartbeat, rotation, paths,
        local_api, reports, report_sync, upgrader, actions.dispatcher, actions.journal, actions.outbox,
        actions.hooks, actions.reloader, b.build_telemetry(agent, node_id, mesh, uplink),
        nat.service if nat is not None else None, b.build_metrics(cfg, mesh)))
    add_control_routes(local_api, node)
    add_services(node)
    add_shutdown_steps(node, own_mesh)
    return node



def add_services(node: Node) -> None:
    """Every service of the daemon, by name, each under its supervisor."""
    agent, cfg = node.agent, node.agent.config
    http_token = read_http_token(cfg) if cfg.node_api.http_enabled else None
    services: dict[str, Callable[[], Any]] = {
        "hooks": node.hooks.watch,
        "capabilities": node.hooks.announce,
        "reconciler": node.reconciler.run,
        "uplink": node.uplink.run,
        "event_converge": node.mesh.gate.serve_requests,
        "events": node.stream.run,
        "heartbeat": node.heartbeat.run,
        "key_rotation": node.key_rotation.run,
        # ends once an upgrade's outcome is reported; its execution's result goes by the dispatcher
        "upgrade": lambda: node.upgrader.run(node.actions.finish_deferred),
        "paths": node.paths.run,
        **({"nat": node.nat.run} if node.nat is not None else {}),
        **node.telemetry.services(),
        **({"metrics": lambda: metrics.serve(node)} if (metrics := node.metrics) is not None else {}),
    }
    if cfg.mode == "bridge":  # the bridge's state as status.* report entries, republished when it changes
        status = StatusReports(node.reports, lambda: status_reports(b.bridge_heartbeat(node.mesh.engine)),
                               cfg.heartbeat.interval)
        services["status_reports"] = status.run
    for name, run in services.items():
        agent.add_service(name, lambda a, run=run: run())
    # The socket stops last: `plexd deregister` is answered once the teardown is done.
    agent.add_service("local_api", lambda a: _serve_local_api(node.local_api, cfg.node_api.http_listen, http_token),
                      stop_last=True)
    _add_watchdog(node)


def add_shutdown_steps(node: Node, own_mesh: bool) -> None:
    """Every shutdown step, in the order added: the drain's run in it, the teardown's last added first."""
    agent = node.agent
    # drain: while the services still run
    agent.on_shutdown("access sessions", lambda a: close_sessions(a, node.mesh.engine, node.uplink), phase="drain")
    agent.on_shutdown("actions drain", lambda a: drain_actions(a, node), phase="drain")
    # teardown (last added runs first): the telemetry queue, the uplink, the bookkeeping, then the mesh
    if own_mesh:
        agent.on_shutdown("mesh teardown", lambda a: teardown_mesh(a, node.mesh.engine))
    agent.on_shutdown("event bookkeeping", lambda a: close_bookkeeping(a, node.bookkeeping))
    agent.on_shutdown("uplink outbox", lambda a: _close(node.uplink))
    # `plexd deregister --purge` is answered after the teardown and removes data_dir
    agent.on_shutdown("telemetry queue", lambda a: node.telemetry.close())
    agent.on_shutdown("local socket", lambda a: node.local_api.stop(grace=2.0), phase="final")


async def teardown_mesh(agent: Agent, engine: Engine) -> None:
    if agent.tears_down:
        await engine.teardown()
        log.info("mesh interface %s removed", agent.config.mesh.interface)


async def close_bookkeeping(agent: Agent, bookkeeping: GroupCommit) -> None:
    await bookkeeping.close()
    bookkeeping.ledger.close(agent.clock.now().timestamp())


async def drain_actions(agent: Agent, node: Node) -> None:
    """Running actions finished within the stop budget (the flush, the deregistration and the teardown keep their
    share), then their results sent."""
    await node.actions.drain(min(agent.config.shutdown.drain, agent.time_left(reserve=DRAIN_RESERVE)))
    if not await node.action_outbox.flush(min(OUTBOX_FLUSH, agent.time_left(reserve=DRAIN_RESERVE - 1))):
        log.warning("%d action message(s) not delivered before shutdown; they are sent after the next start",
                    node.action_journal.outbox_size())


async def _close(store: UplinkOutbox) -> None:
    store.close()


def upgrade_health(reconciler: Reconciler, heartbeat: HeartbeatService) -> str | None:
    """What a newly upgraded daemon still lacks to be called healthy, or None: its first converge ran and the
    control plane accepted a heartbeat, which carries the new binary checksum."""
    if not reconciler.started.is_set():
        return "its first converge has not run"
    if heartbeat.sent == 0:
        return "no heartbeat accepted yet" + (f" ({heartbeat.last_error})" if heartbeat.last_error else "")
    return None


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


def _add_watchdog(node: Node) -> None:
    """STATUS= lines while systemd supervises us; WATCHDOG=1 too when the unit has WatchdogSec."""
    agent = node.agent
    interval = watchdog_interval()
    if interval is None and not os.environ.get("NOTIFY_SOCKET"):
        return
    stuck_limit = (interval or 0) * 3 * WATCHDOG_STUCK

    def healthy() -> str | None:
        stuck = node.mesh.gate.stuck_for()
        if stuck > stuck_limit:
            return f"a converge has been running for {stuck:.0f}s"
        return None

    dog = Watchdog(interval or 5.0, healthy, agent.status_line, ping=interval is not None, clock=agent.clock)
    agent.add_service("watchdog", lambda a: dog.run(), stop_last=True)  # pings through a long drain too


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

    failpoint.check()  # a test's PLEXD_TEST_FAILPOINTS that names no point: refused, not a test of nothing
    if config.node_api.http_enabled:
        read_http_token(config)  # refuse to start at once, before registering, with one clear line
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    try:
        with HeapSettler(asyncio.get_running_loop()):
            return await lifecycle.run(config, assemble, clock=clock, stop_event=stop_event, client=client)
    finally:
        sys.setswitchinterval(switch_interval)  # run in-process (tests): leave the interpreter as it was

