"""The converge engine on its own, with small in-memory domains: order, isolation, the event path's fallback."""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import ClassVar

import pytest

from plexd.base.errors import PlexdError
from plexd.converge.change import Change
from plexd.converge.coalesce import Requests
from plexd.converge.domain import DomainResult
from plexd.converge.engine import Engine, Mode
from plexd.converge.gate import Gate
from plexd.converge.hold import ReconcileHold
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore
from plexd.state.model import Peer


@dataclass(frozen=True)
class Set(Change):
    correction_type: ClassVar[str] = "value_set"
    domain: str
    value: int

    @property
    def detail(self) -> str:
        return f"{self.domain}: set to {self.value}"


class Counter:
    """Owns one number that should equal the number of desired peers."""

    touches_machine = True
    acts_while_held = False

    def __init__(self, name: str, log: list[str], *, value: int = 0) -> None:
        self.name, self.log, self.value = name, log, value
        self.baseline: int | None = None
        self.fail_observe: BaseException | None = None
        self.fail_apply: BaseException | None = None

    async def observe(self, desired):
        self.log.append(f"observe {self.name}")
        if self.fail_observe is not None:
            raise self.fail_observe
        return self.value

    def plan(self, desired, observed):
        want = len(desired.peers)
        return DomainResult((Set(self.name, want),) if observed != want else ())

    async def apply(self, desired, planned, observed):
        self.log.append(f"apply {self.name}")
        if self.fail_apply is not None:
            raise self.fail_apply
        for c in planned.changes:
            self.value = c.value
        self.baseline = self.value
        return DomainResult(planned.changes)

    async def apply_delta(self, desired, touched):
        if self.baseline is None:
            return None
        self.log.append(f"delta {self.name}")
        want = len(desired.peers)
        if want == self.baseline:
            return DomainResult()
        self.value = self.baseline = want
        return DomainResult((Set(self.name, want),))

    async def teardown(self):
        self.log.append(f"teardown {self.name}")
        self.value = 0

    def status(self):
        return {"value": self.value}


def model(peers: int) -> DesiredState:
    d = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.100.0.1")
    return d.with_peers([Peer(f"n_{i}", base64.b64encode(bytes([i + 1]) * 32).decode(), f"10.100.0.{i + 2}")
                         for i in range(peers)])


async def test_domains_are_observed_then_applied_in_list_order_and_corrections_counted():
    log: list[str] = []
    a, b = Counter("a", log), Counter("b", log, value=2)
    engine = Engine([a, b])
    r = await engine.converge(model(2))
    assert log == ["observe a", "observe b", "apply a", "apply b"]
    assert r.ok and [c.detail for c in r.changes] == ["a: set to 2"] and a.value == 2
    assert engine.corrections == {"value_set": 1} and engine.last_result is r
    assert engine.status() == {"a": {"value": 2}, "b": {"value": 2}}


async def test_dry_run_plans_every_domain_and_applies_none():
    log: list[str] = []
    a = Counter("a", log)
    r = await Engine([a]).converge(model(3), Mode.DRY_RUN)
    assert r.mode is Mode.DRY_RUN and [c.detail for c in r.changes] == ["a: set to 3"] and a.value == 0
    assert "apply a" not in log


@pytest.mark.parametrize("where", ["observe", "apply"])
@pytest.mark.parametrize("error", [PlexdError("the thing is gone"), RuntimeError("a bug")])
async def test_a_failing_domain_is_an_error_line_and_the_others_still_converge(where, error, caplog):
    log: list[str] = []
    bad, good = Counter("bad", log), Counter("good", log)
    setattr(bad, f"fail_{where}", error)
    caplog.set_level(logging.ERROR, "plexd.converge.engine")
    r = await Engine([bad, good]).converge(model(1))
    assert good.value == 1 and [c.detail for c in r.changes] == ["good: set to 1"]
    assert len(r.errors) == 1
    if isinstance(error, PlexdError):
        assert r.errors[0] == "the thing is gone"
    else:
        assert r.errors[0].startswith("bad: internal error") and "a bug" in r.errors[0]
    assert any(rec.name == "plexd.converge.engine" for rec in caplog.records)


async def test_the_event_path_uses_each_domains_delta_and_converges_in_full_only_the_one_that_cannot():
    log: list[str] = []
    a, b = Counter("a", log), Counter("b", log)
    engine = Engine([a, b])
    await engine.converge(model(1))
    b.baseline = None  # b lost its baseline (say its last apply failed)
    log.clear()
    r = await engine.apply_delta(model(2), touched=["n_1"])
    assert log == ["delta a", "observe b", "apply b"]
    assert [c.detail for c in r.changes] == ["a: set to 2", "b: set to 2"] and a.value == b.value == 2
    assert engine.corrections["value_set"] == 3  # 2 at the first converge, b's full one; a's delta is no drift


async def test_a_delta_that_raises_falls_back_to_a_full_converge_of_that_domain():
    log: list[str] = []
    a = Counter("a", log)
    engine = Engine([a])
    await engine.converge(model(1))

    async def broken(desired, touched):
        raise PlexdError("device went away")

    a.apply_delta = broken
    r = await engine.apply_delta(model(2))
    assert r.ok and a.value == 2 and log[-2:] == ["observe a", "apply a"]


async def test_teardown_runs_last_listed_first_and_goes_on_past_a_failure():
    log: list[str] = []
    a, b = Counter("a", log), Counter("b", log)

    async def fails():
        log.append("teardown b")
        raise PlexdError("cannot remove b")

    b.teardown = fails
    await Engine([a, b]).teardown()
    assert log == ["teardown b", "teardown a"]


def test_two_domains_with_one_name_are_refused():
    with pytest.raises(ValueError, match="share a name"):
        Engine([Counter("a", []), Counter("a", [])])


class Guard:
    """The gate's guard (plexd.node.mesh in the daemon): whether a device was left up, and what it was told."""

    def __init__(self, *, left_up: bool = False, ready: bool = True) -> None:
        self.left_up, self.ready_for_delta = left_up, ready
        self.calls: list[str] = []

    async def before_full(self) -> None:
        self.calls.append("before_full")
        self.ready_for_delta = True  # what the mesh does: the protected addresses are read now

    def after_apply(self, desired) -> None:
        self.calls.append("after_apply")

    def after_full(self) -> None:
        self.calls.append("after_full")

    async def machine_left_up(self) -> bool:
        return self.left_up


def gate(domains, desired, guard=None, *, known=True) -> Gate:
    return Gate(Engine(domains), DesiredStore(desired), guard or Guard(), requests=Requests(), hold=ReconcileHold(),
                known=known)


async def test_while_held_every_converge_and_every_event_only_plans():
    log: list[str] = []
    a = Counter("a", log)
    g = gate([a], model(1))
    await g.converge()
    g.hold.set(60, "debugging by hand")
    g.store.replace(model(2))
    held = await g.converge()
    g.store.edit(lambda d: model(3), "an event", ["n_2"])
    event = await g.apply_events()
    assert held.mode is event.mode is Mode.HELD and a.value == 1  # planned, not applied
    assert [c.detail for c in event.changes] == ["a: set to 3"] and "delta a" not in log
    g.hold.release()
    assert (await g.converge()).mode is Mode.APPLIED and a.value == 3


async def test_the_gate_applies_events_as_a_delta_once_it_may():
    log: list[str] = []
    a = Counter("a", log)
    guard = Guard(ready=False)
    g = gate([a], model(1), guard)
    first = await g.apply_events()  # the protected addresses not read yet: in full
    assert first.mode is Mode.APPLIED and log == ["observe a", "apply a"]
    assert guard.calls == ["before_full", "after_full"]
    g.store.edit(lambda d: model(2), "an event", ["n_1"])
    second = await g.apply_events()
    assert log[-1] == "delta a" and a.value == 2 and guard.calls[-1] == "after_apply"
    assert [c.detail for c in second.changes] == ["a: set to 2"]


async def test_a_device_left_up_is_kept_until_the_first_pull_and_a_dry_run_only_plans():
    log: list[str] = []
    a = Counter("a", log)
    g = gate([a], model(2), Guard(left_up=True), known=False)
    kept = await g.converge()
    assert kept.mode is Mode.KEPT and kept.held_back and a.value == 0
    assert (await g.converge(dry_run=True)).mode is Mode.DRY_RUN and a.value == 0
    g.mark_known()  # the first state pull was applied
    assert (await g.converge()).mode is Mode.APPLIED and a.value == 2


async def test_a_pull_that_changed_nothing_after_a_full_converge_reads_nothing_again():
    log: list[str] = []
    a = Counter("a", log)
    g = gate([a], model(2))
    await g.converge()
    g.pulled()  # the model is still the one the converge left
    skipped = await g.converge()
    assert skipped.mode is Mode.APPLIED and skipped.changes == () and log == ["observe a", "apply a"]
    g.store.replace(model(3))
    g.pulled()
    await g.converge()
    assert a.value == 3 and log[-2:] == ["observe a", "apply a"]
