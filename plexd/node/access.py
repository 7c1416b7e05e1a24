"""The daemon's side of the access sessions: what the sessions domain (`plexd.access.sessions_domain`) is given to
verify tokens, report activity and audit, and how `plexd sessions` reads it.

    keys            the control plane's signing keys the verifier trusts now (rotations included)
    report          §A1.4 activity into the durable uplink (kind "session_activity"): nothing is lost in an outage
    record_command  an SSH exec's command-started report, posted now: the command runs only if it was taken
    audit           one line each in the local audit log (data_dir/actions/local-audit.log, 0600), which the
                    telemetry audit stream ships; a token appears there only as its session's id
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from plexd.access.k8s import ApiServer
from plexd.access.sessions_domain import AccessHooks
from plexd.actions.audit import LocalAudit
from plexd.base import gojson
from plexd.base.errors import PlexdError
from plexd.config.settings import Config
from plexd.controlplane.event_signing import Verifier
from plexd.controlplane.uplink import UplinkOutbox
from plexd.node.agent import Agent

log = logging.getLogger(__name__)

SESSION_ACTIVITY = "session_activity"  # the uplink outbox's kind for §A1.4 reports


def access_hooks(agent: Agent, verifier: Verifier, node_id: Callable[[], str], audit_path: Path,
                 uplink: UplinkOutbox) -> AccessHooks:
    """What the access sessions need from the daemon: activity goes by the uplink's lane."""
    audit_log = LocalAudit(audit_path)

    def report(session_id: str, activity: dict[str, Any]) -> None:
        uplink.put(SESSION_ACTIVITY, {"session_id": session_id, "activity": activity})

    async def record_command(session_id: str, command: str) -> bool:
        body = {"ssh": {"command": command, "started_at": gojson.format_unix(time.time())}}
        try:
            await agent.authed(lambda: agent.client.report_session_activity(node_id(), session_id, body))
        except PlexdError as exc:
            log.warning("session %s: the control plane did not record a command (%s)", session_id, exc)
            return False
        return True

    def audit(event: str, fields: dict[str, Any]) -> None:
        audit_log.record(event, origin="plexd-access", **fields)

    return AccessHooks(keys=verifier.trusted_keys, report=report, record_command=record_command, audit=audit,
                       k8s_api=lambda: kubernetes_api(agent.config))


def post_session_activity(agent: Agent, node_id: Callable[[], str]) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """How the uplink sends one queued `session_activity` entry."""

    async def post(body: dict[str, Any]) -> None:
        session_id, activity = body["session_id"], body["activity"]
        await agent.authed(lambda: agent.client.report_session_activity(node_id(), session_id, activity))

    return post


def kubernetes_api(config: Config) -> ApiServer | None:
    """The API server of `access.kubernetes` (url, token file, CA), else the in-cluster one, else None."""
    k8s = config.access.kubernetes
    if not k8s.url:
        return ApiServer.in_cluster()
    token = ""
    if k8s.token_file:
        try:
            token = Path(k8s.token_file).read_text().strip()
        except OSError as exc:
            log.error("access.kubernetes.token_file %s: %s", k8s.token_file, exc.strerror)
    return ApiServer(k8s.url, token, k8s.ca_file or None)
