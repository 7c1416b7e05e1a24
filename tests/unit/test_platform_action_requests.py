"""The platform state's executions block as action requests (plexd.controlplane.platform_actions), what the
dispatcher does with them when a pull offers them (once, across repeated pulls and a restart; lapsed, lost, refused
for now or for good), and the result body as the terminal callback's. The callbacks against the real devplane are
tests/integration/test_platform_executions_devplane.py."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest
from test_actions import Harness

from plexd.actions import request as rq
from plexd.actions.builtins import Builtin, Output
from plexd.actions.dispatcher import LOST, ActionDispatcher
from plexd.base.gojson import format_time
from plexd.config.settings import ActionsConfig
from plexd.controlplane.platform_actions import Statuses, action_requests, terminal_body
from plexd.controlplane.platform_snapshot import state_from_snapshot
from plexd.state.model import State

SOON = datetime.now(UTC) + timedelta(minutes=5)


def entry(execution_id: str = "e1", action: str = "echo", status: str = "pending", **fields) -> dict:
    return {"execution_id": execution_id, "action": action, "type": "builtin", "parameters": None,
            "status": status, "requested_at": format_time(datetime.now(UTC)), "expires_at": format_time(SOON),
            **fields}


# -- the translation --------------------------------------------------------------------------------------------


def test_an_entry_becomes_the_request_a_spec_event_would_with_what_the_platform_adds():
    [req] = action_requests([entry(parameters={"include_network": True, "n": 3, "x": None})])
    assert (req.execution_id, req.action, req.kind) == ("e1", "echo", "builtin")
    assert req.parameters == {"include_network": "true", "n": "3", "x": ""}
    assert req.expires_at == pytest.approx(SOON.timestamp(), abs=1)
    assert not req.reported_started and req.checksum_announced and not req.problem
    assert (req.timeout, req.checksum, req.triggered_by) == (None, "", None)
    assert [r.reported_started for r in action_requests([entry(status="ack"), entry("e2", status="started")])] == [
        False, True]


@pytest.mark.parametrize("bad", [
    None, "e1", [], {"action": "echo", "status": "pending"}, {"execution_id": "", "status": "pending"},
    {"execution_id": 7, "status": "pending"}, {"execution_id": "a\nb", "status": "pending"},
    entry(status="succeeded"), entry(status="timeout"), entry(status=None)])
def test_an_entry_without_a_usable_id_or_a_status_to_act_on_is_dropped(bad):
    assert action_requests([bad, entry("kept")])[0].execution_id == "kept"
    assert len(action_requests([bad])) == 0


@pytest.mark.parametrize("expires", [None, "", "soon", "0001-01-01T00:00:00Z", 5])
def test_a_missing_zero_or_unreadable_expiry_has_lapsed(expires):
    assert action_requests([entry(expires_at=expires)])[0].expires_at == 0.0


@pytest.mark.parametrize("fields, problem, action", [
    ({"parameters": {"p": {"a": 1}}}, "parameters.p: is an object", "echo"),
    ({"parameters": [1]}, "parameters: must be an object", "echo"),
    ({"action": "../x"}, "must not contain", ""),
    ({"action": None}, "action: missing", ""),
])
def test_an_entry_that_cannot_be_read_is_kept_to_be_refused_by_name(fields, problem, action):
    [req] = action_requests([entry(**fields)])
    assert problem in req.problem and req.action == action and req.execution_id == "e1"


def test_the_type_is_carried_as_it_came():
    kinds = [r.kind for r in action_requests([entry(type="hook"), entry(type="script"), entry(type=None),
                                              entry(type=3)])]
    assert kinds == ["hook", "script", "", "?"]


def test_the_block_null_or_not_an_array_is_no_action_and_the_spec_state_has_none():
    assert action_requests(None) == () and action_requests({"e1": {}}) == ()
    snapshot = {"peers": [], "reachability": None, "policy": None, "bridge": None, "state": None, "reports": None,
                "executions": [entry()], "sessions": []}
    assert [r.execution_id for r in state_from_snapshot(snapshot).action_requests] == ["e1"]
    assert State.from_wire({"peers": []}).action_requests == ()


def test_statuses_remember_what_the_last_pull_said():
    statuses = Statuses()
    statuses.note({"executions": [entry(status="ack"), entry("e2", status="started"), "junk"]})
    assert (statuses.of("e1"), statuses.of("e2"), statuses.of("e3")) == ("ack", "started", "pending")
    statuses.note({"executions": None})
    assert statuses.of("e1") == "pending"


# -- the result as the terminal callback ------------------------------------------------------------------------


@pytest.mark.parametrize("result, body", [
    ({"status": "success", "exit_code": 0}, {"status": "succeeded", "exit_code": 0}),
    ({"status": "failed", "exit_code": 3}, {"status": "failed", "exit_code": 3, "error": "exit status 3"}),
    ({"status": "timeout", "exit_code": -1, "duration": "30s"}, {"status": "failed", "error": "timed out after 30s"}),
    ({"status": "cancelled", "exit_code": -1}, {"status": "cancelled"}),
    ({"status": "error", "exit_code": 1, "stderr": "out\nplexd stopped while this action was running\n"},
     {"status": "failed", "error": "plexd stopped while this action was running"}),
    ({"status": "error", "exit_code": 1, "stderr": ""}, {"status": "failed", "error": "error"}),
])
def test_each_outcome_has_its_terminal_status_exit_code_and_error(result, body):
    assert terminal_body(result) == body


# -- offered by pulls -------------------------------------------------------------------------------------------


def pulled(*entries: dict) -> tuple:
    return action_requests(list(entries))


def counting(h_runs: list) -> dict:
    async def echo(view, params):
        h_runs.append(params)
        return Output(0, "hi\n")

    return {"echo": Builtin("echo", "", None, echo)}


async def settle(h: Harness) -> None:
    tasks = [r.task for r in h.d.running.values() if r.task]
    if tasks:
        await asyncio.wait(tasks)


def kinds(messages: list) -> list[tuple[str, str, str]]:
    return [(kind, eid, body.get("reason") if kind == "ack" else body["status"]) for kind, eid, body in messages]


async def test_an_entry_pulled_again_and_again_runs_once_and_is_answered_once(tmp_path):
    runs: list = []
    h = Harness(tmp_path, builtins=counting(runs))
    for _ in range(5):  # every pull lists it until the control plane has the result
        await h.d.offer(pulled(entry(parameters={"a": 1})))
        await settle(h)
    assert runs == [{"a": "1"}]
    assert kinds(h.messages()) == [("ack", "e1", ""), ("result", "e1", "success")]

    # a restart: a new dispatcher on the same journal, the entry still listed (its result not delivered yet)
    again = ActionDispatcher(ActionsConfig(), h.journal, h.outbox, h.hookset, h.d.view, lambda: "n_1", h.d.audit,
                             builtins=h.d.builtins)
    assert again.recover() == 0
    await again.offer(pulled(entry(status="started")))
    assert runs == [{"a": "1"}] and h.messages() == []


async def test_a_run_cut_short_by_a_crash_is_reported_once_by_the_recovery_not_as_lost(tmp_path):
    h = Harness(tmp_path, builtins=counting([]))
    h.journal.accept("e1", "echo", "control_plane", {}, {"execution_id": "e1", "status": "accepted", "reason": ""})
    assert h.d.recover() == 1
    await h.d.offer(pulled(entry(status="started")))
    [(_, _, accepted), (kind, eid, body)] = h.messages()
    assert accepted["status"] == "accepted"
    assert (kind, eid, body["status"]) == ("result", "e1", "error") and "not run again" in body["stderr"]


async def test_started_elsewhere_is_reported_lost_once_and_never_run(tmp_path):
    runs: list = []
    h = Harness(tmp_path, builtins=counting(runs))
    for _ in range(3):
        await h.d.offer(pulled(entry(status="started")))
    [(kind, eid, body)] = h.messages()
    assert (kind, eid, body["status"], body["stderr"]) == ("result", "e1", "error", LOST + "\n")
    assert terminal_body(body) == {"status": "failed", "error": LOST}
    assert runs == [] and h.journal.known("e1").status == "error"


async def test_a_lapsed_entry_is_left_to_the_control_plane(tmp_path):
    runs: list = []
    h = Harness(tmp_path, builtins=counting(runs))
    await h.d.offer(pulled(entry(expires_at=format_time(datetime.now(UTC) - timedelta(seconds=1))),
                           entry("e2", expires_at=None), entry("e3", status="started", expires_at=None)))
    assert runs == [] and h.messages() == [] and h.journal.known("e1") is None


async def test_the_run_never_outlasts_the_expiry(tmp_path):
    h = Harness(tmp_path)
    h.hook("slow.sh", "sleep 30\n")
    await h.rescan()
    started = time.monotonic()
    await h.d.offer(pulled(entry(action="slow.sh", type="hook",
                                 expires_at=format_time(datetime.now(UTC) + timedelta(seconds=2)))))
    await settle(h)
    [_, (_, _, result)] = h.messages()
    assert result["status"] == "timeout" and time.monotonic() - started < 10


async def test_refusals_for_good_are_answered_once_and_refusals_for_now_not_at_all(tmp_path):
    release = asyncio.Event()

    async def wait(view, params):
        await release.wait()
        return Output(0, "")

    h = Harness(tmp_path, max_concurrent=1, builtins={"wait": Builtin("wait", "", (), wait)})
    h.hook("h.sh", "echo hi\n")
    await h.rescan()
    block = (entry("busy", action="wait"), entry("queued", action="wait"), entry("nope", action="no.such"),
             entry("kind", type="script"), entry("bad", parameters={"p": [1]}),
             entry("not-a-builtin", action="h.sh", type="builtin"), entry("not-a-hook", action="wait", type="hook"))
    for _ in range(3):
        await h.d.offer(pulled(*block))
    got = kinds(h.messages())
    assert got == [("ack", "busy", ""), ("ack", "nope", "unknown_action"),
                   ("ack", "kind", "unsupported_action_type"), ("ack", "bad", "invalid_request"),
                   ("ack", "not-a-builtin", "unknown_action"), ("ack", "not-a-hook", "unknown_action")]
    assert h.journal.known("queued") is None  # busy: no answer, the next pull offers it again
    release.set()
    await settle(h)
    await h.d.offer(pulled(*block))
    await settle(h)
    assert kinds(h.messages()) == [("result", "busy", "success"), ("ack", "queued", ""),
                                   ("result", "queued", "success")]


async def test_a_hook_runs_as_last_announced_when_the_entry_names_no_checksum(tmp_path):
    h = Harness(tmp_path)
    h.hook("h.sh", f"touch {tmp_path}/ran\n")
    await h.rescan()
    await h.d.offer(pulled(entry(action="h.sh", type="hook")))
    await settle(h)
    assert (tmp_path / "ran").exists()
    h.hook("h.sh", "echo edited\n")  # edited, scanned, never announced: refused as in a local run
    await h.hookset.rescan("test")
    await h.d.offer(pulled(entry("e2", action="h.sh", type="hook")))
    assert kinds([m for m in h.messages() if m[0] == "ack"]) == [("ack", "e1", ""),
                                                                 ("ack", "e2", "integrity_violation")]


async def test_disabled_actions_and_a_shutdown(tmp_path):
    h = Harness(tmp_path, builtins=counting([]))
    h.d.config = ActionsConfig(enabled=False)
    await h.d.offer(pulled(entry()))
    h.d.config = ActionsConfig()
    await h.d.drain(1)
    await h.d.offer(pulled(entry("e2")))
    assert kinds(h.messages()) == [("ack", "e1", rq.ACTIONS_DISABLED)]
