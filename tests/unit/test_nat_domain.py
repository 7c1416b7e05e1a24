"""The NAT endpoint as a domain of the converge engine, with a real uplink outbox (SQLite in tmp_path) and the real
engine: the first endpoint found is planned and queued as one drift line, delivered through the outbox (which
keeps it through a failing control plane), the answer's peer endpoints applied; a new mapping replaces a report
still waiting; an unchanged endpoint is re-reported after REPORT_EVERY without a drift line; a restart re-reads
what waits on disk and still sends it when discovery agrees; a report overtaken by a new mapping is dropped
unsent; a 4xx refusal is shown and not asked again every reconcile; an operator's hold does not stop reports (they
touch no machine), a dry run does."""

from __future__ import annotations

from plexd.controlplane.client import PeerEndpoint
from plexd.controlplane.client_errors import PermanentError, TransientError
from plexd.controlplane.uplink import UplinkOutbox, by_kind
from plexd.converge.engine import Engine, Mode
from plexd.converge.hold import ReconcileHold
from plexd.nat.endpoint_domain import KIND, LANE, REPORT_EVERY, Endpoint, NatEndpointDomain, NatHooks
from plexd.node.mesh import MeshHandle
from plexd.state.desired import DesiredState

DESIRED = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.100.0.1",
                               node_id="n_a")


class World:
    """The domain's surroundings: what discovery found, the control plane's answers, the peers it applied."""

    def __init__(self, tmp_path) -> None:
        self.current: Endpoint | None = None
        self.reports: list[tuple[str, str]] = []
        self.failing = 0
        self.refusing = False
        self.applied: list[list[PeerEndpoint]] = []
        self.now = 1_000_000.0
        self.path = tmp_path / "uplink.db"
        self.domain = NatEndpointDomain(NatHooks(lambda: self.current, lambda: self.uplink, self.report,
                                                 lambda peers: self.applied.append(peers) or len(peers),
                                                 clock=lambda: self.now))
        self.uplink = self.outbox()
        self.engine = Engine([self.domain])

    def outbox(self) -> UplinkOutbox:
        return UplinkOutbox(self.path, by_kind({KIND: self.domain.deliver}))

    async def report(self, endpoint: str, nat_type: str) -> list[PeerEndpoint]:
        if self.refusing:
            raise PermanentError("endpoint report", 404, "no such node")
        if self.failing:
            self.failing -= 1
            raise TransientError("control plane unreachable")
        self.reports.append((endpoint, nat_type))
        return [PeerEndpoint("n_b", "198.51.100.5:51820"), PeerEndpoint("n_quiet", "")]

    def queued(self) -> list[dict]:
        return [e.body for e in self.uplink.pending(LANE)]

    async def reported(self, endpoint: Endpoint) -> None:
        """Discovery finds `endpoint`; a converge queues it and the uplink delivers it."""
        self.current = endpoint
        await self.engine.converge(DESIRED)
        await self.uplink.deliver()


def lines(result) -> list[tuple[str, str]]:
    return [(c.type, c.detail) for c in result.corrections()]


async def test_the_first_endpoint_is_one_drift_line_queued_then_delivered_with_the_peers_applied(tmp_path):
    w = World(tmp_path)
    assert (await w.engine.converge(DESIRED)).changes == ()  # nothing discovered yet: nothing to tell
    w.current = Endpoint("203.0.113.7:51820", "full_cone")
    r = await w.engine.converge(DESIRED)
    assert lines(r) == [("endpoint_reported", "public endpoint 203.0.113.7:51820 (full_cone): not reported to the "
                                              "control plane yet; report queued")]
    assert w.queued() == [{"public_endpoint": "203.0.113.7:51820", "nat_type": "full_cone"}]
    assert (await w.engine.converge(DESIRED)).changes == ()  # waiting in the lane: not queued twice
    assert len(w.queued()) == 1 and w.domain.status()["report_pending"] is True

    await w.uplink.deliver()
    assert w.reports == [("203.0.113.7:51820", "full_cone")] and w.queued() == []
    assert w.applied == [[PeerEndpoint("n_b", "198.51.100.5:51820")]]  # an empty endpoint is not applied
    assert w.domain.info().to_wire() == {"public_endpoint": "203.0.113.7:51820", "type": "full_cone"}
    assert (await w.engine.converge(DESIRED)).changes == ()


async def test_a_failing_control_plane_keeps_the_report_and_a_new_mapping_replaces_it(tmp_path):
    w = World(tmp_path)
    w.failing = 5
    w.current = Endpoint("203.0.113.7:51820", "full_cone")
    await w.engine.converge(DESIRED)
    await w.uplink.deliver()
    assert w.reports == [] and len(w.queued()) == 1
    assert "control plane unreachable" in w.domain.status()["report_error"]
    w.current = Endpoint("203.0.113.9:40000", "symmetric")  # the NAT remapped meanwhile
    r = await w.engine.apply_delta(DESIRED, ())
    assert [c.type for c in r.corrections()] == ["endpoint_reported"]
    assert w.queued() == [{"public_endpoint": "203.0.113.9:40000", "nat_type": "symmetric"}]  # the latest only

    # a restart: the report waits on disk and is what the next daemon sends
    w.uplink.close()
    w.failing = 0
    w.domain = NatEndpointDomain(NatHooks(lambda: w.current, lambda: w.uplink, w.report, lambda peers: 0,
                                          clock=lambda: w.now))
    w.uplink = w.outbox()
    assert (await Engine([w.domain]).converge(DESIRED)).changes == ()  # already queued: not planned again
    await w.uplink.deliver()
    assert w.reports == [("203.0.113.9:40000", "symmetric")]
    w.uplink.close()


async def test_a_changed_mapping_names_what_the_control_plane_has(tmp_path):
    w = World(tmp_path)
    await w.reported(Endpoint("203.0.113.7:51820", "full_cone"))
    w.current = Endpoint("198.51.100.20:51820", "full_cone")
    r = await w.engine.converge(DESIRED)
    assert lines(r) == [("endpoint_reported", "public endpoint 198.51.100.20:51820 (full_cone): the control plane "
                                              "has 203.0.113.7:51820 (full_cone); report queued")]
    w.uplink.close()


async def test_an_unchanged_endpoint_is_reported_again_after_report_every_without_a_drift_line(tmp_path):
    w = World(tmp_path)
    await w.reported(Endpoint("203.0.113.7:51820", "full_cone"))
    w.now += REPORT_EVERY - 1
    assert (await w.engine.converge(DESIRED)).changes == () and w.queued() == []
    w.now += 2
    assert (await w.engine.converge(DESIRED)).changes == ()  # a keepalive, not drift
    assert w.queued() == [{"public_endpoint": "203.0.113.7:51820", "nat_type": "full_cone"}]
    await w.uplink.deliver()
    assert len(w.reports) == 2 and w.domain.reported_at == w.now
    w.uplink.close()


async def test_a_report_overtaken_by_a_new_mapping_is_dropped_unsent(tmp_path):
    w = World(tmp_path)
    w.current = Endpoint("203.0.113.7:51820", "full_cone")
    await w.engine.converge(DESIRED)
    w.current = Endpoint("203.0.113.8:51820", "full_cone")  # remapped before the uplink got to it
    await w.uplink.deliver()
    assert w.reports == [] and w.queued() == [] and w.domain.reported is None
    await w.engine.converge(DESIRED)
    await w.uplink.deliver()
    assert w.reports == [("203.0.113.8:51820", "full_cone")]
    w.uplink.close()


async def test_a_refusal_is_shown_and_not_asked_again_every_reconcile(tmp_path):
    w = World(tmp_path)
    w.refusing = True
    await w.reported(Endpoint("203.0.113.7:51820", "full_cone"))  # refused for good: the outbox drops it, counted
    assert w.queued() == [] and w.uplink.status(LANE)["refused"] == 1
    assert "HTTP 404" in w.domain.status()["report_error"]
    for _ in range(3):
        assert (await w.engine.converge(DESIRED)).changes == ()
    assert w.queued() == []
    w.now += REPORT_EVERY  # asked again, once, after a while
    w.refusing = False
    assert [c.type for c in (await w.engine.converge(DESIRED)).corrections()] == ["endpoint_reported"]
    await w.uplink.deliver()
    assert w.reports == [("203.0.113.7:51820", "full_cone")] and w.domain.status()["report_error"] == ""
    w.uplink.close()


async def test_a_hold_keeps_the_machine_but_not_the_reports_and_a_dry_run_sends_nothing(tmp_path):
    w = World(tmp_path)
    w.current = Endpoint("203.0.113.7:51820", "full_cone")
    assert (await w.engine.converge(DESIRED, Mode.DRY_RUN)).changes != () and w.queued() == []
    hold = ReconcileHold()
    hold.set(300, "debugging routes")
    held = MeshHandle(Engine([w.domain]), DESIRED, hold=hold)
    r = await held.gate.converge()
    assert r.mode is Mode.HELD and r.changes == ()  # nothing listed as "not corrected": the report was made
    assert len(w.queued()) == 1 and held.engine.corrections["endpoint_reported"] == 1
    w.current = Endpoint("203.0.113.9:51820", "full_cone")
    await held.gate.apply_events()  # an event while held: plans in full, and reports still go
    assert w.queued() == [{"public_endpoint": "203.0.113.9:51820", "nat_type": "full_cone"}]
    w.uplink.close()
