"""A newer event is never undone by an older state pull (the stale-state-pull race), driven deterministically:
the state request is held open while an event is applied, then answered with the state as it was before."""

from __future__ import annotations

import asyncio
import base64

import nacl.signing
import pytest
from nacl.public import PrivateKey

from plexd.base.clock import Clock
from plexd.controlplane.envelope import parse_envelope, sign_event
from plexd.controlplane.event_signing import NonceStore, Verifier
from plexd.converge.domain import DomainResult
from plexd.converge.engine import Engine
from plexd.node.mesh import MeshHandle, PulledState, StatePull
from plexd.services.event_handlers import EventHandlers
from plexd.services.reconciler import Reconciler
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore, StalePull
from plexd.state.model import Peer, SigningKeys, State

SIGNER = nacl.signing.SigningKey.generate()


def wgkey() -> str:
    return base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()


def peer(n: int) -> Peer:
    return Peer(id=f"n_{n}", public_key=wgkey(), mesh_ip=f"10.100.0.{n}", allowed_ips=(f"10.100.0.{n}/32",))


def initial() -> DesiredState:
    return DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, mesh_ip="10.100.0.1",
                                private_key=base64.b64encode(bytes(PrivateKey.generate())).decode())


def test_edits_made_during_a_pull_are_replayed_on_top_of_it():
    store = DesiredStore(initial())
    old, new = peer(2), peer(3)
    since = store.mark()
    store.edit(lambda d: d.with_peer(new), "peer_added e1")
    replayed = store.replace_from_pull(lambda d: d.with_state(State(peers=(old,))), since)
    assert replayed == ["peer_added e1"]
    assert set(store.value.peers) == {"n_2", "n_3"}


def test_a_removal_during_a_pull_stays_removed_and_edits_before_the_pull_are_not_replayed():
    store = DesiredStore(initial())
    gone = peer(2)
    store.edit(lambda d: d.with_peer(peer(9)), "before the pull")
    since = store.mark()
    store.edit(lambda d: d.without_peer("n_2"), "peer_removed e2")
    assert store.replace_from_pull(lambda d: d.with_state(State(peers=(gone,))), since) == ["peer_removed e2"]
    assert store.value.peers == {}  # the pull is the truth for everything before it: n_9 is gone too


def test_a_pull_overtaken_by_more_events_than_the_journal_holds_is_refused_and_changes_nothing():
    store = DesiredStore(initial(), journal_size=4)
    since = store.mark()
    for i in range(5):
        store.edit(lambda d, i=i: d.with_peer(peer(10 + i)), f"e{i}")
    before = store.value
    with pytest.raises(StalePull, match="5 events arrived"):
        store.replace_from_pull(lambda d: d.with_state(State()), since)
    assert store.value is before


class RecordingDomain:
    """A domain of the real engine that only records the peers of each model it is converged to."""

    name = "recording"
    touches_machine = True
    acts_while_held = False

    def __init__(self):
        self.seen: list[set[str]] = []

    async def observe(self, desired):
        self.seen.append(set(desired.peers))

    def plan(self, desired, observed):
        return DomainResult()

    async def apply(self, desired, planned, observed):
        return DomainResult()

    async def apply_delta(self, desired, touched):
        return None  # converge me in full: recorded like a reconcile

    async def teardown(self):
        pass

    def status(self):
        return None


class SlowDomain(RecordingDomain):
    """Every converge waits until `release` is set: a converge held in flight."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def observe(self, desired):
        await self.release.wait()
        return await super().observe(desired)


async def test_event_applied_while_the_reconcile_waits_for_get_state_survives_the_pull():
    """The e2e failure of test_cursor_and_nonces_survive_a_plexd_up_restart, without timing: the reconcile after
    a stream reconnect asks for the state; a peer_added event is applied before the (older) answer arrives."""
    domain = RecordingDomain()
    mesh = MeshHandle(Engine([domain]), initial())
    clock = Clock()
    verifier = Verifier(SigningKeys(current=base64.b64encode(bytes(SIGNER.verify_key)).decode()),
                        NonceStore(clock), clock)
    handlers = EventHandlers(mesh.store, mesh.request_converge, lambda why: None, verifier)

    asked, answer = asyncio.Event(), asyncio.Event()
    existing, added = peer(2), peer(3)

    async def get_state() -> State:  # the control plane answers with the state from before the change
        asked.set()
        await answer.wait()
        return State(peers=(existing,))

    reconciler = Reconciler(StatePull(mesh, get_state, None), mesh.gate, lambda report: None)
    cycle = asyncio.ensure_future(reconciler.run_once(reasons=("event stream (re)connected",)))
    await asyncio.wait_for(asked.wait(), 5)
    env = parse_envelope(sign_event(SIGNER, "peer_added", "evt_new", {
        "id": added.id, "public_key": added.public_key, "mesh_ip": added.mesh_ip,
        "allowed_ips": list(added.allowed_ips)}))
    verifier.verify(env)  # as the event stream does before dispatching
    await handlers.dispatch(env)
    assert "n_3" in mesh.get_desired().peers
    answer.set()
    result = await asyncio.wait_for(cycle, 5)
    assert result.ok, result.error
    assert set(mesh.get_desired().peers) == {"n_2", "n_3"}  # the event was not undone
    assert domain.seen[-1] == {"n_2", "n_3"}  # and the device was converged to both
    assert not any(c.type == "peer_removed" for c in result.updates)


async def test_a_burst_of_events_coalesces_into_few_converges_that_see_every_change():
    """Events request converges; while one runs, any number of requests make exactly one more, and it applies the
    model as it is then (every event of the burst)."""

    domain = SlowDomain()
    mesh = MeshHandle(Engine([domain]), initial())
    service = asyncio.create_task(mesh.gate.serve_requests())
    first = peer(2)
    mesh.store.edit(lambda d: d.with_peer(first), "e0")
    mesh.request_converge("e0")
    await asyncio.sleep(0)  # the first converge starts and waits
    burst = [peer(10 + i) for i in range(100)]
    for i, p in enumerate(burst):
        mesh.store.edit(lambda d, p=p: d.with_peer(p), f"e{i + 1}")
        mesh.request_converge(f"e{i + 1}")
    domain.release.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(domain.seen) == 2  # the one running, and one for the whole burst
    assert domain.seen[-1] == {"n_2", *(p.id for p in burst)}
    service.cancel()
    with pytest.raises(asyncio.CancelledError):
        await service


async def test_a_reconcile_whose_pull_changes_nothing_reads_the_machine_once():
    """Phase 1 (drift) converges the machine to the model; when the state pull leaves the model as it was, phase 2
    has nothing to do and does not read the machine again. A pull that changes the model, and every later cycle
    (drift can happen at any moment), still converge in full."""
    domain = RecordingDomain()
    mesh = MeshHandle(Engine([domain]), initial().with_peer(peer(2)))
    state = State(peers=(peer(2),))

    async def get_state():
        return state

    reconciler = Reconciler(StatePull(mesh, get_state, None), mesh.gate, lambda report: None)
    assert (await reconciler.run_once(reasons=("interval",))).ok
    assert len(domain.seen) == 2  # the first cycle: nothing was converged to this model yet
    assert (await reconciler.run_once(reasons=("interval",))).ok
    assert len(domain.seen) == 3  # drift phase only: the pull changed nothing
    state = State(peers=(peer(2), peer(3)))
    assert (await reconciler.run_once(reasons=("interval",))).ok
    assert len(domain.seen) == 5 and domain.seen[-1] == {"n_2", "n_3"}


def test_edits_name_the_peers_they_touch_and_a_pull_makes_them_unknown():
    store = DesiredStore(initial())
    assert store.take_touched() is None  # nothing known at start: the first apply scans
    store.edit(lambda d: d.with_peer(peer(2)), "e1", ("n_2",))
    store.edit(lambda d: d.with_signing_keys(SigningKeys(current=wgkey())), "e2", ())
    assert store.take_touched() == {"n_2"}
    assert store.take_touched() == set()
    since = store.mark()
    store.edit(lambda d: d.with_peer(peer(3)), "e3", ("n_3",))
    store.replace_from_pull(lambda d: d.with_peer(peer(4)), since)
    assert store.take_touched() is None  # a pull changes any peer: the next apply scans


async def test_an_apply_waiting_behind_a_reconcile_applies_the_model_after_its_pull():
    """An event's apply queued while a reconcile converges reads the model when its turn comes, so it cannot put
    back the model from before the reconcile's state pull."""

    domain = SlowDomain()
    mesh = MeshHandle(Engine([domain]), initial())
    reconcile = asyncio.create_task(mesh.gate.converge())
    await asyncio.sleep(0)  # the reconcile's converge holds the turn
    since = mesh.store.mark()
    mesh.store.edit(lambda d: d.with_peer(peer(5)), "event", ("n_5",))
    event_apply = asyncio.create_task(mesh.gate.apply_events())
    await asyncio.sleep(0)
    mesh.store.replace_from_pull(lambda d: d.with_peer(peer(9)), since)  # the reconcile's pull lands meanwhile
    domain.release.set()
    await asyncio.wait_for(asyncio.gather(reconcile, event_apply), 5)
    assert domain.seen[-1] == {"n_5", "n_9"}  # not {"n_5"}: the pull's peer is not undone


async def test_peer_endpoints_from_the_exchange_change_only_endpoints_and_refuse_what_is_not_host_port(caplog):
    """The NAT endpoint exchange (`MeshHandle.set_peer_endpoints`): each peer looked up by id, only its endpoint
    edited (journaled, so a pull in flight replays it), one converge asked for; an unusable endpoint is refused
    with a log line and the peer keeps the endpoint it had (it is not dropped from the mesh)."""
    from plexd.controlplane.client import PeerEndpoint

    domain = RecordingDomain()
    p2, p3 = peer(2), peer(3)
    mesh = MeshHandle(Engine([domain]), initial().with_peers([p2, p3]))
    before = mesh.store.value.peers["n_3"]
    since = mesh.store.mark()
    changed = mesh.set_peer_endpoints([
        PeerEndpoint("n_2", "198.51.100.5:51820"), PeerEndpoint("n_3", "not an endpoint"),
        PeerEndpoint("n_unknown", "198.51.100.6:51820"), PeerEndpoint("n_2", "198.51.100.5:51820")])
    assert changed == 1
    peers = mesh.store.value.peers
    assert peers["n_2"].endpoint == "198.51.100.5:51820" and peers["n_2"].public_key == p2.public_key
    assert peers["n_3"] == before and "n_unknown" not in peers and not mesh.store.value.rejected
    assert "endpoint of peer n_3 refused" in caplog.text
    assert mesh.gate.pending == 1  # one converge asked for
    replayed = mesh.store.replace_from_pull(lambda d: d.with_state(State(peers=(p2, p3))), since)
    assert replayed == ["endpoint exchange"] and mesh.store.value.peers["n_2"].endpoint == "198.51.100.5:51820"


async def no_fetch() -> State:
    raise AssertionError("this test applies pulls it made itself")


def test_the_same_pulled_state_with_no_event_since_rebuilds_nothing():
    """The client hands back the state it parsed last time when nothing changed (304 or the same bytes): the model
    is kept as it is, not rebuilt; after an event, or with another state, the pull is applied as always."""
    mesh = MeshHandle(Engine([RecordingDomain()]), initial())
    apply = StatePull(mesh, no_fetch, None).apply
    state = State(peers=(peer(2),))
    apply(PulledState(state, mesh.store.mark()))
    model = mesh.store.value
    apply(PulledState(state, mesh.store.mark()))
    assert mesh.store.value is model  # kept, not rebuilt
    mesh.store.edit(lambda d: d.with_peer(peer(3)), "peer_added", ("n_3",))
    apply(PulledState(state, mesh.store.mark()))
    assert set(mesh.store.value.peers) == {"n_2"}  # the pull applied again: the event's peer is not in the state
    apply(PulledState(State(peers=(peer(2), peer(4))), mesh.store.mark()))
    assert set(mesh.store.value.peers) == {"n_2", "n_4"}
