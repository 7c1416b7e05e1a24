"""The daemon's own control routes on the local socket, and the `plexd status --json` document.

    GET    /v1/daemon/status             the status document below
    GET    /v1/daemon/policies           policies, visible peers, rule counters (plexd.node.policies_view)
    POST   /v1/daemon/reconcile          {"dry_run": bool} → one reconcile cycle through the daemon's reconciler
    POST   /v1/daemon/reconcile/hold     {"seconds": n, "reason": "..."} → pause corrections (at most 24 h)
    DELETE /v1/daemon/reconcile/hold     release the hold
    POST   /v1/daemon/deregister         {"purge": bool, "force": bool} → the stop sequence (plexd.node.departure)
    POST   /v1/daemon/rotate-keys        a WireGuard key rotation, answered when done (plexd.node.key_rotation)

Every route needs uid 0 or membership of ``node_api.admin_group`` (default ``plexd-admin``), checked on the
caller's SO_PEERCRED credentials.

Status document (``"version": 1``; fields are only ever added, under a new version if one changes meaning)::

    version, plexd_version
    daemon         running, pid, started_at, uptime_seconds, version, binary_checksum
    node           registered, node_id, mesh_ip, control_plane, data_dir, interface, identity_problem
    event_stream   state (connected | polling | offline), since, last_event_id, last_event_at,
                   last_event_age_seconds, connects, events_accepted, events_rejected
    reconcile      interval_seconds, cycles, failures, hold (null or until/since/reason/remaining_seconds),
                   last (null or at/age_seconds/reasons/ok/dry_run/error/corrections/updates/held/
                   drift_reported)
    heartbeat      last_at, ok, error, consecutive_failures, sent, interval_seconds
    peers          desired, rejected, on_device, recent_handshake (a handshake in the last 3 minutes),
                   hidden_by_policy
    health         status (healthy | degraded), reason
    policy         enforcement (enforced | degraded | disabled), reason, policies, rules, skipped_rules
    nat            enabled (false: reason), servers, public_endpoint, nat_type, local_endpoint, server,
                   last_success_at, last_attempt_at, last_error, consecutive_failures, refresh_interval_seconds,
                   reported_endpoint, reported_nat_type, reported_at, report_pending (queued in the uplink),
                   report_error
    node_api       socket, tcp (null or host:port), reports, report_bytes, rate_limited, tcp_refused (TCP
                   connections turned away at the door: budget full or too many 401s), report_sync (pending,
                   sent_batches, dropped_batches (refused), dropped (entries refused or over the cap),
                   last_sent_at, last_error)
    key_rotation   rotations, last_at, last_error, pending (a rotation the control plane has not taken yet)
    metrics        null (off) or listen, scrapes
    upgrade        release (the zipapp running, or "installed package"), dir, installing, pending (null or
                   to_version, state), last (null or the last outcome: status, from/to_version, binary_checksum,
                   reason)
    actions        enabled, max_concurrent, running [{execution_id, action, origin, running_seconds}], accepted,
                   rejected {reason: count}, outbox (pending, sent, refused, dropped_full, last_sent_at,
                   last_error), hooks (directory, hooks, refused, scans, announcements, announce_pending,
                   last_announce_error)
    services       [{name, state, restarts, last_error, last_error_at, running_since}]

Times are unix seconds. Without a running daemon, `plexd status` prints the same document from the stored
files with ``daemon.running: false`` and no live sections.
"""

from __future__ import annotations

import os
from typing import Any

from plexd import __version__
from plexd.base.errors import PlexdError
from plexd.base.heap import gc_stats, glibc
from plexd.config.settings import Config
from plexd.nat.nat_service import disabled_status
from plexd.node.departure import DEREGISTER_PATH
from plexd.node.domain_list import nat_endpoint
from plexd.node.domain_list import sessions as sessions_domain
from plexd.node.mesh import MeshHandle
from plexd.node.parts import Node
from plexd.nodeapi.local_api import LocalAPI, LocalAPIError, Request, Response, require_admin
from plexd.services.reconciler import Reconciler

STATUS_VERSION = 1
STATUS_PATH = "/v1/daemon/status"
POLICIES_PATH = "/v1/daemon/policies"
SESSIONS_PATH = "/v1/daemon/sessions"
RECONCILE_PATH = "/v1/daemon/reconcile"
HOLD_PATH = "/v1/daemon/reconcile/hold"
ROTATE_KEYS_PATH = "/v1/daemon/rotate-keys"


def stored_status(config: Config) -> dict[str, Any]:
    """What the files in data_dir say (no daemon needed)."""
    from plexd.identity.identity_store import IdentityStore

    loaded = IdentityStore(config.data_dir).load()
    ident = loaded.identity
    return {
        "version": STATUS_VERSION,
        "plexd_version": __version__,
        # the flat keys of the first status document, kept for scripts that read them
        "registered": ident is not None,
        "node_id": ident.node_id if ident else "",
        "mesh_ip": ident.mesh_ip if ident else "",
        "control_plane": config.api.url,
        "data_dir": config.data_dir,
        "identity_problem": loaded.problem,
        "daemon": {"running": False},
        "node": {"registered": ident is not None, "node_id": ident.node_id if ident else "",
                 "mesh_ip": ident.mesh_ip if ident else "", "control_plane": config.api.url,
                 # the contract spoken: the identity's once registered, else what api.dialect says
                 "dialect": ident.dialect if ident else config.api.dialect,
                 "data_dir": config.data_dir, "interface": config.mesh.interface,
                 "identity_problem": loaded.problem},
    }


async def live_status(node: Node) -> dict[str, Any]:
    agent = node.agent
    doc = stored_status(agent.config)
    now = agent.clock.now().timestamp()
    doc["daemon"] = {"running": True, "pid": os.getpid(), "uptime_seconds": round(agent.uptime(), 1),
                     "started_at": round(now - agent.uptime(), 1), "version": __version__,
                     "binary_checksum": agent.binary_checksum, "malloc_mib": glibc.stats(),
                     "gc": gc_stats()}
    rec = node.reconciler
    hold = node.mesh.gate.hold.current()
    doc["event_stream"] = node.stream.status()
    now = agent.clock.monotonic()
    doc["reconcile"] = {"interval_seconds": rec.interval, "cycles": rec.cycles, "failures": rec.failures,
                        # the state pull: skipped while the event stream kept the model current (pull_freshness)
                        "pulls_skipped": rec.pulls_skipped, "pull_due": rec.freshness.due() or None,
                        "last_pull_age_seconds": None if rec.pulled_at is None else round(now - rec.pulled_at, 1),
                        "hold": hold.to_json() if hold else None,
                        "last": rec.last.to_json(agent.clock.monotonic()) if rec.last is not None else None}
    doc["heartbeat"] = node.heartbeat.status()
    desired = node.mesh.get_desired()
    try:
        counts = await node.mesh.peers_on_device()
    except Exception:  # the status must come back even when the device cannot be read
        counts = None
    doc["peers"] = {"desired": len(desired.peers), "rejected": len(desired.rejected),
                    "on_device": counts[0] if counts else None, "recent_handshake": counts[1] if counts else None,
                    "hidden_by_policy": len(desired.peers) - len(desired.shown_peers)}
    status, reason = health(node.reconciler, node.mesh)
    doc["health"] = {"status": status, "reason": reason}
    enforcement, why = node.mesh.enforcement()
    compiled = desired.compiled_policy
    doc["policy"] = {"enforcement": enforcement, "reason": why,
                     "policies": len({r.policy_id for r in compiled.rules}), "rules": len(compiled.rules),
                     "skipped_rules": len(compiled.skipped)}
    reported = nat_endpoint(node.mesh.engine)  # what the control plane was told: the domain (discovery: the service)
    doc["nat"] = ({**node.nat.status(), **(reported.status() if reported is not None else {})} if node.nat is not None
                  else disabled_status(agent.config.nat_traversal))
    doc["node_api"] = _node_api_status(node)
    doc["key_rotation"] = node.key_rotation.status()
    m = node.metrics
    doc["metrics"] = None if m is None else {"listen": f"{m.host}:{m.port}", "scrapes": m.scrapes}
    doc["upgrade"] = node.upgrader.status()
    doc["actions"] = node.actions.status()
    doc["telemetry"] = node.telemetry.status()
    doc["paths"] = node.paths.status()  # peer id -> direct/relay/probing
    doc["domains"] = node.mesh.engine.status()  # each piece of machine state: the firewall, sessions, relay...
    doc["services"] = agent.supervisor.to_json()
    return doc


def _node_api_status(node: Node) -> dict[str, Any]:
    api = node.local_api
    return {"socket": api.socket_path, "tcp": "{}:{}".format(*api.tcp_address) if api.tcp_address else None,
            "reports": len(node.reports), "report_bytes": node.reports.total_bytes,
            "rate_limited": api.rate_limit.refused, "tcp_refused": api.tcp_refused,
            "report_sync": node.report_sync.status()}


def health(reconciler: Reconciler[Any], mesh: MeshHandle) -> tuple[str, str]:
    """("healthy" | "degraded", why): the last reconcile failed, or policy enforcement cannot be applied."""
    reasons = []
    last = reconciler.last
    if last is not None and not last.ok:
        reasons.append(last.error or "the last reconcile failed")
    enforcement, why = mesh.enforcement()
    if enforcement == "degraded":
        reasons.append(why)
    return ("degraded" if reasons else "healthy"), "; ".join(reasons)


def add_control_routes(api: LocalAPI, node: Node) -> None:
    """The daemon's own routes on its socket (plexd status, reconcile, hold, rotate-keys, deregister): admin only."""
    admin = require_admin(node.agent.config.node_api.admin_group)
    routes = ControlRoutes(node)
    for method, path, handler in (
        ("GET", STATUS_PATH, routes.status),
        ("POST", ROTATE_KEYS_PATH, routes.rotate_keys),
        ("POST", DEREGISTER_PATH, routes.deregister),
        ("GET", POLICIES_PATH, routes.policies),
        ("GET", SESSIONS_PATH, routes.sessions),
        ("POST", RECONCILE_PATH, routes.reconcile),
        ("POST", HOLD_PATH, routes.hold),
        ("DELETE", HOLD_PATH, routes.release),
    ):
        api.add(method, path, handler, admin)


class ControlRoutes:
    def __init__(self, node: Node) -> None:
        self.node = node

    async def status(self, req: Request) -> Response:
        return Response(200, await live_status(self.node))

    async def policies(self, req: Request) -> Response:
        from plexd.node.policies_view import policies_document

        return Response(200, await policies_document(self.node.mesh))

    async def sessions(self, req: Request) -> Response:
        domain = sessions_domain(self.node.mesh.engine)
        doc = domain.status() if domain is not None else None
        return Response(200, {"enabled": domain is not None, **(doc or {"live": [], "ended": {}, "refused": []})})

    async def reconcile(self, req: Request) -> Response:
        body = _object(req)
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise LocalAPIError(400, "dry_run must be true or false")
        result = await self.node.reconciler.run_once(dry_run=dry_run, reasons=("plexd reconcile --once",))
        doc = result.to_json()
        doc["errors"] = [result.error] if result.error else []
        last = self.node.mesh.engine.last_result
        if last is not None:
            doc["errors"] += [e for e in last.errors if e not in doc["errors"]]
        doc["ok"] = result.ok and not doc["errors"]
        hold = self.node.mesh.gate.hold.current()
        doc["hold"] = hold.to_json() if hold else None
        return Response(200, doc)

    async def hold(self, req: Request) -> Response:
        body = _object(req)
        seconds, reason = body.get("seconds"), body.get("reason", "")
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise LocalAPIError(400, "seconds must be a number")
        if not isinstance(reason, str) or len(reason) > 500:
            raise LocalAPIError(400, "reason must be a string of at most 500 characters")
        try:
            held = self.node.mesh.gate.hold.set(float(seconds), reason)
        except ValueError as exc:
            raise LocalAPIError(400, str(exc)) from None
        return Response(200, {"hold": held.to_json()})

    async def release(self, req: Request) -> Response:
        old = self.node.mesh.gate.hold.release()
        if old is not None:
            self.node.reconciler.trigger("reconcile hold released")  # correct what was held, now
        return Response(200, {"released": old is not None})

    async def deregister(self, req: Request) -> Response:
        body = _object(req)
        flags = {name: body.get(name, False) for name in ("purge", "force")}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise LocalAPIError(400, f"{name} must be true or false")
        try:
            leaving = await self.node.agent.leave(**flags)
        except PlexdError as exc:
            raise LocalAPIError(409, str(exc)) from None
        if not leaving.deregistered and not flags["force"]:
            raise LocalAPIError(502, f"the control plane did not take the deregistration: {leaving.error}")
        cfg = self.node.agent.config
        return Response(200, {"node_id": self.node.agent.identity.node_id if self.node.agent.identity else "",
                              "deregistered": leaving.deregistered, "error": leaving.error, "torn_down": True,
                              # what `--purge` removes: the daemon's own, whatever the command's config says
                              "paths": {"data_dir": str(cfg.data_dir), "token_file": cfg.token.file,
                                        "telemetry_queue_dir": cfg.telemetry.queue_dir}})

    async def rotate_keys(self, req: Request) -> Response:
        from plexd.node.key_rotation import RotationFailed

        try:
            return Response(200, await self.node.key_rotation.rotate())
        except RotationFailed as exc:
            if exc.retrying:
                self.node.key_rotation.request("plexd rotate-keys could not finish")
            raise LocalAPIError(502, str(exc)) from None


def _object(req: Request) -> dict[str, Any]:
    body = req.json()
    if not isinstance(body, dict):
        raise LocalAPIError(400, "body must be a JSON object")
    return body
