"""`Node`: every long-lived part of a running daemon, as `plexd.node.assembly` (the composition root) built them.

A container in a module of its own, filled once (every part is built before it), so that what reads the parts
(the control routes, the metrics endpoint, the lifecycle, tests and benches) depends on the parts, not on the code
that builds them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from plexd.actions.dispatcher import ActionDispatcher
from plexd.actions.hooks import HookSet
from plexd.actions.journal import ActionJournal
from plexd.actions.outbox import Outbox
from plexd.controlplane.event_signing import InvalidSigningKeys, Verifier, key_fingerprint
from plexd.controlplane.event_stream import EventStream
from plexd.controlplane.uplink import UplinkOutbox
from plexd.identity.identity_store import Identity
from plexd.nat.nat_service import NatService
from plexd.node.agent import Agent
from plexd.node.domain_list import wireguard
from plexd.node.durable import GroupCommit
from plexd.node.key_rotation import KeyRotation
from plexd.node.mesh import MeshHandle
from plexd.node.reload import ConfigReloader
from plexd.node.status_text import utc
from plexd.nodeapi.local_api import LocalAPI
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.sync import ReportSync
from plexd.services.event_handlers import EventHandlers, apply_signing_keys
from plexd.services.heartbeat import HeartbeatService
from plexd.services.paths import PathSelector
from plexd.services.reconciler import Reconciler
from plexd.state.model import SigningKeys
from plexd.telemetry.service import Telemetry
from plexd.upgrade.upgrader import Upgrader

log = logging.getLogger(__name__)


class Scraped(Protocol):
    """The local Prometheus endpoint (`plexd.node.metrics.MetricsEndpoint`, which reads the node's parts: a
    protocol here, so that the parts do not import it)."""

    host: str
    port: int
    scrapes: int

    async def serve(self, node: Any) -> None:
        """The service: `node`'s families on /metrics until cancelled."""
        ...


@dataclass(frozen=True)
class Node:
    """Every long-lived part of a running daemon; what the lifecycle asks of it (`plexd.node.agent.Assembled`)."""

    agent: Agent
    mesh: MeshHandle
    bookkeeping: GroupCommit  # the mirror and the event ledger, written together
    verifier: Verifier
    uplink: UplinkOutbox  # what waits for the control plane: drift, sessions, actions, reports, telemetry
    reconciler: Reconciler[Any]
    handlers: EventHandlers
    stream: EventStream
    heartbeat: HeartbeatService
    key_rotation: KeyRotation
    paths: PathSelector  # automatic path selection (peers with a bridge's fallback endpoint)
    local_api: LocalAPI
    reports: ReportStore
    report_sync: ReportSync
    upgrader: Upgrader
    actions: ActionDispatcher
    action_journal: ActionJournal
    action_outbox: Outbox
    hooks: HookSet
    reloader: ConfigReloader
    telemetry: Telemetry
    nat: NatService | None = None  # STUN discovery, when NAT traversal is on
    metrics: Scraped | None = None  # when config metrics.enabled: plexd.node.metrics.MetricsEndpoint

    async def ready(self) -> None:
        await self.reconciler.started.wait()

    def describe(self) -> str:
        """The node in one line, for systemd's STATUS=: "connected, 12 peers", "control plane unreachable since …"."""
        believed = wireguard(self.mesh.engine).believed_peer_count()
        peers = believed if believed is not None else len(self.mesh.get_desired().peers)
        stream = self.stream.status()
        if stream["state"] == "connected":
            return f"connected, {peers} peers"
        since = utc(stream["since"])
        if stream["state"] == "polling":
            return f"event stream down since {since}, polling the control plane; {peers} peers"
        return f"control plane unreachable since {since}; running from data_dir with {peers} peers"

    def reload_config(self) -> Any:
        return self.reloader.reload()

    def adopt_identity(self, identity: Identity) -> None:
        """A registration is, with a signed rotation event, one of the two sources of the signing key: one that
        answers with another key (a rotation this node missed) must be trusted now, not at the next start; else
        every event is refused and the signing_key domain writes the old key back over the new file."""
        key = identity.signing_public_key
        if self.verifier.keys is not None and self.verifier.keys.current == key:
            return
        try:
            apply_signing_keys(self.verifier, Path(self.agent.config.data_dir), SigningKeys(current=key))
        except InvalidSigningKeys as exc:  # the registrar checked it; a second look costs nothing
            log.error("the registration's signing key is unusable (%s); the previous one stays", exc)
            return
        log.warning("the control plane answered the re-registration with another signing key (%s); trusting it",
                    key_fingerprint(key))
