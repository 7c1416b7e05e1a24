"""The node's public endpoint as the control plane knows it: a domain of the converge engine.

What is converged is the control plane's record of where this node can be reached, to what NAT discovery finds
(the NAT service's STUN refreshes, `plexd.nat.nat_service`; or the local endpoint while no server has answered):

    observed   what discovery found last, what waits in the uplink outbox's ``endpoint`` lane, and what the
               control plane last accepted (and when); all in memory or in the outbox, no I/O
    planned    ``endpoint_reported`` when the control plane does not have the current endpoint (never told since
               this start, or told another one); nothing while the same value already waits in the lane
    applied    the report queued in the lane, replacing one still waiting (the latest wins): the one uplink
               delivers it (PUT /endpoint) with the one retry policy, and the answer's peer endpoints go into the
               desired model (`apply_peer_endpoints`) and through the engine like an event. With nothing to
               change, an endpoint last reported more than REPORT_EVERY ago is queued again (the control plane
               may have lost it): a keepalive, not drift, so not a change line

So a report made during an outage waits on disk, and a failing control plane is retried like every other uplink
message, never by a loop of the NAT's own. A queued report is sent only if it is still what discovery finds (one
left by an earlier run, or overtaken by a newer mapping, is dropped unsent). One the control plane refuses for
good (a 4xx) is not queued again for REPORT_EVERY unless the endpoint changes; `report_error` shows the refusal.
The service asks for a converge (an event-like delta) when discovery finds a new mapping; the periodic reconcile
re-reports what is due. Nothing here touches the machine (`touches_machine = False`): an operator's hold, or a
device kept as it is until the first state pull, does not stop the reports; a dry run does.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar

from plexd.controlplane.client import NatInfo, PeerEndpoint
from plexd.controlplane.client_errors import ControlPlaneError
from plexd.controlplane.retry import refused_for_good
from plexd.controlplane.uplink import UplinkOutbox
from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.state.desired import DesiredState

log = logging.getLogger(__name__)

LANE = "endpoint"
KIND = "endpoint_report"
REPORT_EVERY = 600.0  # an unchanged endpoint is reported again this often (the control plane may have lost it)


@dataclass(frozen=True)
class Endpoint:
    """What the control plane is told: ``public_endpoint`` and ``nat_type`` of §1.7."""

    address: str
    nat_type: str

    def __str__(self) -> str:
        return f"{self.address} ({self.nat_type})"

    def to_wire(self) -> dict[str, str]:
        """The report's body, as queued in the uplink lane."""
        return {"public_endpoint": self.address, "nat_type": self.nat_type}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Endpoint:
        """A queued body; one without the fields (never written by this domain) matches no discovered endpoint."""
        return cls(str(body.get("public_endpoint", "")), str(body.get("nat_type", "")))


@dataclass(frozen=True)
class NatObserved:
    current: Endpoint | None  # what discovery says now (None: nothing known yet)
    queued: Endpoint | None  # waiting in the uplink lane
    reported: Endpoint | None  # the control plane's answer was 2xx for this one
    reported_at: float | None
    refused: Endpoint | None = None  # the control plane refused this one for good (a 4xx) ...
    refused_at: float | None = None  # ... then: asked again only after REPORT_EVERY, or for another endpoint


@dataclass(frozen=True)
class EndpointReported(Change):
    correction_type: ClassVar[str] = "endpoint_reported"
    endpoint: Endpoint
    why: str

    @property
    def detail(self) -> str:
        return f"public endpoint {self.endpoint}: {self.why}; report queued"


Report = Callable[[str, str], Awaitable[list[PeerEndpoint]]]


@dataclass(frozen=True)
class NatHooks:
    """What the domain needs from the daemon, as callables (built by plexd.node.builders.nat_hooks): what discovery
    found, the uplink outbox (asked at each use: a test swaps it for a new one, as a restart would), PUT /endpoint,
    and the answer's peers into the desired model."""

    current: Callable[[], Endpoint | None]  # what discovery found (the NAT service)
    uplink: Callable[[], UplinkOutbox | None]
    report: Report  # PUT /endpoint
    apply_peer_endpoints: Callable[[list[PeerEndpoint]], int]  # the answer's peers, into the desired model
    clock: Callable[[], float] = time.time


class NatEndpointDomain:
    name = "nat"
    acts_while_held = False
    touches_machine = False  # what it converges is the control plane's record: a hold does not stop it

    def __init__(self, hooks: NatHooks) -> None:
        self._current, self._uplink = hooks.current, hooks.uplink
        self._report, self._apply_peers = hooks.report, hooks.apply_peer_endpoints
        self._clock = hooks.clock
        self.reported: Endpoint | None = None
        self.reported_at: float | None = None
        self.refused: Endpoint | None = None
        self.refused_at: float | None = None
        self.refusal = ""

    # -- the engine's side ------------------------------------------------------------------------------------

    async def observe(self, desired: DesiredState) -> NatObserved:
        return NatObserved(self._current(), self._queued(), self.reported, self.reported_at, self.refused,
                           self.refused_at)

    def plan(self, desired: DesiredState, observed: NatObserved) -> DomainResult:
        now, was = observed.current, observed.reported
        if now is None or now == observed.queued or now == was:
            return DomainResult()
        if (now == observed.refused and observed.refused_at is not None
                and self._clock() - observed.refused_at < REPORT_EVERY):
            return DomainResult()  # refused for good: not asked again each reconcile (`report_error` says so)
        why = "not reported to the control plane yet" if was is None else f"the control plane has {was}"
        return DomainResult((EndpointReported(now, why),))

    async def apply(self, desired: DesiredState, planned: DomainResult, observed: NatObserved) -> DomainResult:
        uplink = self._uplink()
        due = (observed.current is not None and observed.current == observed.reported and observed.queued is None
               and observed.reported_at is not None and self._clock() - observed.reported_at >= REPORT_EVERY)
        if not planned.changes and not due:
            return DomainResult()
        if uplink is None:
            return DomainResult(errors=("nat: no uplink outbox to queue the endpoint report in",))
        change = planned.changes[0] if planned.changes else None  # a plan holds one report at most
        assert change is None or isinstance(change, EndpointReported)
        endpoint = change.endpoint if change is not None else observed.current
        assert endpoint is not None
        uplink.put(KIND, endpoint.to_wire(), lane=LANE, key=LANE)
        return planned

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        """Everything this domain reads is in memory: a delta is the full converge, at no cost."""
        return None

    async def teardown(self) -> None:
        """Nothing on the machine. A report still queued stays (a purge removes the outbox with the rest): the
        next daemon drops it unsent unless its own discovery finds the same endpoint (`deliver`)."""

    def status(self) -> dict[str, Any] | None:
        lane: dict[str, Any] = {}
        uplink = self._uplink()
        with contextlib.suppress(sqlite3.Error):  # the outbox closed at shutdown: the status still answers
            lane = uplink.status(LANE) if uplink is not None else {}
        return {"reported_endpoint": self.reported.address if self.reported else "",
                "reported_nat_type": self.reported.nat_type if self.reported else "",
                "reported_at": self.reported_at, "report_pending": self._queued() is not None,
                "report_error": lane.get("last_error") or self.refusal}

    def info(self) -> NatInfo | None:
        """The heartbeat's `nat` block: what the control plane was last told (and took)."""
        return NatInfo(self.reported.address, self.reported.nat_type) if self.reported is not None else None

    # -- the uplink's side ------------------------------------------------------------------------------------

    async def deliver(self, body: dict[str, Any]) -> None:
        """How the uplink sends a queued report (kind KIND): PUT, then the peers' endpoints it answered."""
        sent = Endpoint.from_wire(body)
        current = self._current()
        if sent != current:  # left by an earlier run, or overtaken: the next converge queues what is current
            log.debug("endpoint report %s dropped unsent: discovery has %s now", sent, current)
            return
        try:
            peers = await self._report(sent.address, sent.nat_type)
        except ControlPlaneError as exc:
            if refused_for_good(exc):
                self.refused, self.refused_at, self.refusal = sent, self._clock(), str(exc)
            raise  # the outbox's one policy: retried, or dropped with its log line
        if sent != self.reported:
            log.info("endpoint %s reported to the control plane", sent)
        self.reported, self.reported_at = sent, self._clock()
        self.refused, self.refused_at, self.refusal = None, None, ""
        changed = self._apply_peers([p for p in peers if p.endpoint])
        if changed:
            log.info("endpoint exchange: %d peer endpoint(s) changed", changed)

    def _queued(self) -> Endpoint | None:
        uplink = self._uplink()
        if uplink is None:
            return None
        try:
            waiting = uplink.pending(LANE)
        except sqlite3.Error:  # the outbox's file is in trouble: the uplink says so; plan as if nothing waits
            return None
        return Endpoint.from_wire(waiting[-1].body) if waiting else None
