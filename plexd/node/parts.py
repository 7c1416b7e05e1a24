"""`Node`: every long-lived part of a running daemon, as `plexd.node.assembly` (the composition root) built them.

A plain container in a module of its own, so that what reads the parts (the control routes, the metrics
endpoint, tests and benches) depends on the parts, not on the code that builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plexd.actions.dispatcher import ActionDispatcher
from plexd.controlplane.event_signing import Verifier
from plexd.controlplane.event_stream import EventStream
from plexd.controlplane.uplink import UplinkOutbox
from plexd.nat.nat_service import NatService
from plexd.node.agent import Agent
from plexd.node.key_rotation import KeyRotation
from plexd.node.mesh import MeshHandle
from plexd.nodeapi.local_api import LocalAPI
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.sync import ReportSync
from plexd.services.event_handlers import EventHandlers
from plexd.services.heartbeat import HeartbeatService
from plexd.services.paths import PathSelector
from plexd.services.reconciler import Reconciler
from plexd.telemetry.service import Telemetry
from plexd.upgrade.upgrader import Upgrader


@dataclass
class Node:
    """Every long-lived part of a running daemon, for the control routes, tests and benches."""

    agent: Agent
    mesh: MeshHandle
    verifier: Verifier
    reconciler: Reconciler
    handlers: EventHandlers
    stream: EventStream
    heartbeat: HeartbeatService
    local_api: LocalAPI
    key_rotation: KeyRotation
    nat: NatService | None = None
    reports: ReportStore | None = None
    report_sync: ReportSync | None = None
    actions: ActionDispatcher | None = None
    metrics: Any = None  # plexd.node.metrics.MetricsEndpoint when config metrics.enabled
    upgrader: Upgrader | None = None
    telemetry: Telemetry | None = None
    paths: PathSelector | None = None  # automatic path selection (peers with a bridge's fallback endpoint)
    uplink: UplinkOutbox | None = None  # what waits for the control plane: drift, sessions, actions, reports
