"""Actions without a daemon: the request parser, the hook environment, the journal (exactly-once, crash
recovery, a corrupt file), the outbox (order, refusals, retries) and the dispatcher's admission (concurrency,
integrity against the request and the announcement, drain). Hooks here are real files run by the real runner;
the control plane is a recording `send` (the devplane round trip is tests/e2e/test_actions_lab.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
from pathlib import Path

import pytest

from plexd.actions import request as rq
from plexd.actions.audit import LocalAudit
from plexd.actions.builtins import EXECUTION, Builtin, NodeView, Output
from plexd.actions.dispatcher import CONTROL_PLANE, LOCAL, ActionDispatcher
from plexd.actions.hooks import HookSet, describe_changes
from plexd.actions.journal import ActionJournal
from plexd.actions.outbox import Outbox
from plexd.base.backoff import Backoff
from plexd.config.settings import ActionsConfig
from plexd.controlplane.client_errors import ControlPlaneError, TransientError
from plexd.controlplane.envelope import Envelope
from plexd.controlplane.uplink import UplinkOutbox
from plexd.trust.integrity import scan_hooks

# -- the request ----------------------------------------------------------------------------------------------


def test_scalars_are_stringified_and_keys_are_case_insensitive():
    req = rq.parse_request({"EXECUTION_ID": "e1", "Action": "backup", "parameters": {
        "s": "x", "t": True, "f": False, "n": 3, "x": 1.5, "z": None}, "timeout": "30s", "checksum": "AB",
        "triggered_by": {"type": "control_plane"}})
    assert req.parameters == {"s": "x", "t": "true", "f": "false", "n": "3", "x": "1.5", "z": ""}
    assert (req.execution_id, req.action, req.timeout, req.checksum) == ("e1", "backup", 30.0, "ab")
    assert req.triggered_by == {"type": "control_plane"}


@pytest.mark.parametrize("payload, message", [
    ({"parameters": {"p": {"a": 1}}}, "parameters.p: is an object"),
    ({"parameters": {"p": [1]}}, "parameters.p: is an array"),
    ({"parameters": ["a"]}, "parameters: must be an object"),
    ({"action": "a/b"}, "must not contain '/', '\\' or '..'"),
    ({"action": "a\\b"}, "must not contain"),
    ({"action": ".."}, "must not contain"),
    ({"action": ""}, "action: missing"),
    ({"action": 3}, "action: must be a string"),
    ({"timeout": "soon"}, "timeout: invalid duration"),
    ({"timeout": "-1s"}, "must be positive"),
    ({"timeout": 30}, "timeout: must be a Go duration"),
    ({"parameters": {"a-b": "1", "a_b": "2"}}, "both become PLEXD_PARAM_A_B"),
    ({"parameters": {"p": "x" * (rq.MAX_PARAMETER_BYTES + 1)}}, "longer than"),
    ({"parameters": {str(i): "" for i in range(rq.MAX_PARAMETERS + 1)}}, "more than"),
    ({"triggered_by": "me"}, "triggered_by: must be an object"),
])
def test_bad_requests_are_refused_naming_what_is_wrong(payload, message):
    with pytest.raises(rq.InvalidRequest) as err:
        rq.parse_request({"execution_id": "e1", "action": "ok", **payload})
    assert message in str(err.value) and err.value.reason == rq.INVALID_REQUEST


@pytest.mark.parametrize("payload", [{"action": "x"}, {"execution_id": ""}, {"execution_id": 5}, [], None,
                                     {"execution_id": "a\nb"}, {"execution_id": "x" * 300}])
def test_without_a_usable_execution_id_nothing_can_be_acked(payload):
    with pytest.raises(rq.MissingExecutionId):
        rq.parse_request(payload)


def test_the_environment_is_exactly_the_documented_one(monkeypatch):
    monkeypatch.setenv("PATH", "/bin")
    monkeypatch.setenv("HOME", "/home/daemon")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.delenv("LC_ALL", raising=False)
    monkeypatch.setenv("SECRET_FROM_DAEMON", "x")
    monkeypatch.setenv("PLEXD_BOOTSTRAP_TOKEN", "plx_enroll_secret")
    req = rq.ActionRequest("e1", "h", {"my-param.name!": "v"})
    assert rq.hook_environment("n_1", req) == {
        "PATH": "/bin", "LANG": "C.UTF-8", "HOME": "/root", "PLEXD_NODE_ID": "n_1", "PLEXD_EXECUTION_ID": "e1",
        "PLEXD_ACTION_NAME": "h", "PLEXD_PARAM_MY_PARAM_NAME_": "v"}
    # a hook finds the files beside it by these ($0 is the sealed copy's /proc/self/fd/N)
    hook = rq.hook_environment("n_1", req, "/etc/plexd/hooks.d/backup")
    assert (hook["PLEXD_HOOK_PATH"], hook["PLEXD_HOOKS_DIR"]) == ("/etc/plexd/hooks.d/backup", "/etc/plexd/hooks.d")


def test_declared_parameters_are_enforced():
    declared = [{"name": "target", "required": True}, {"name": "dry"}]
    rq.check_declared({"target": "x"}, declared)
    rq.check_declared({"anything": "x"}, None)
    with pytest.raises(rq.InvalidRequest, match="required 'target' missing"):
        rq.check_declared({"dry": "1"}, declared)
    with pytest.raises(rq.InvalidRequest, match="'other' not declared"):
        rq.check_declared({"target": "x", "other": "y"}, declared)


# -- the journal ----------------------------------------------------------------------------------------------


def test_accepted_executions_are_known_after_reopening_and_crashes_are_found(tmp_path):
    j = ActionJournal(tmp_path / "uplink.db")
    j.accept("e1", "h", CONTROL_PLANE, {"execution_id": "e1"}, {"execution_id": "e1", "status": "accepted",
                                                                 "reason": ""})
    j.accept("e2", "h", LOCAL, {}, None)
    j.finish("e2", "success", {"execution_id": "e2"})
    j.close()
    assert oct(os.stat(tmp_path / "uplink.db").st_mode & 0o777) == "0o600"
    j = ActionJournal(tmp_path / "uplink.db")
    assert j.known("e1").state == "running" and j.known("e2").status == "success"
    assert [e.execution_id for e in j.interrupted()] == ["e1"]
    assert [(m.kind, m.execution_id) for m in _drain(j)] == [("ack", "e1"), ("result", "e2")]


def test_a_corrupt_journal_is_moved_aside_and_an_empty_one_started(tmp_path, caplog):
    (tmp_path / "uplink.db").write_bytes(b"not a database" * 100)
    j = ActionJournal(tmp_path / "uplink.db")
    assert j.known("x") is None and (tmp_path / "uplink.db.corrupt").exists()
    assert "cannot be recognised as replays" in caplog.text


def test_an_older_actions_db_is_taken_over_with_its_executions_messages_and_announcement(tmp_path, caplog):
    """The layout before the uplink outbox: journal and outbox in actions.db (schema as that version wrote it)."""
    caplog.set_level(logging.INFO)
    old = sqlite3.connect(tmp_path / "actions.db")
    old.executescript("""
        CREATE TABLE executions (execution_id TEXT PRIMARY KEY, action TEXT NOT NULL, origin TEXT NOT NULL,
            state TEXT NOT NULL, accepted_at REAL NOT NULL, finished_at REAL, status TEXT NOT NULL DEFAULT '',
            request TEXT NOT NULL DEFAULT '');
        CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, execution_id TEXT NOT NULL,
            body TEXT NOT NULL, queued_at REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE announced (name TEXT PRIMARY KEY, checksum TEXT NOT NULL) WITHOUT ROWID;
        INSERT INTO executions VALUES ('e1', 'h', 'control_plane', 'finished', 1.0, 2.0, 'success', '{}');
        INSERT INTO executions VALUES ('e2', 'h', 'control_plane', 'running', 3.0, NULL, '', '{}');
        INSERT INTO outbox (kind, execution_id, body, queued_at) VALUES ('result', 'e1', '{"status":"success"}', 2);
        INSERT INTO announced VALUES ('h', 'abc');
        PRAGMA user_version=1;
    """)
    old.close()
    os.link(tmp_path / "actions.db", tmp_path / "kept.db")  # the same file, to put back below
    j = ActionJournal(tmp_path / "uplink.db", adopt=tmp_path / "actions.db")
    assert j.known("e1").status == "success" and [e.execution_id for e in j.interrupted()] == ["e2"]
    assert j.announced() == {"h": "abc"}
    assert [(m.kind, m.execution_id, m.body) for m in j.messages()] == [("result", "e1", {"status": "success"})]
    assert not (tmp_path / "actions.db").exists() and "taken over" in caplog.text
    # a crash after the move committed but before the old file was removed: it is removed, not taken twice
    os.link(tmp_path / "kept.db", tmp_path / "actions.db")
    j = ActionJournal(tmp_path / "uplink.db", adopt=tmp_path / "actions.db")
    assert len(j.messages()) == 1 and not (tmp_path / "actions.db").exists()
    # an unreadable one is moved aside, the daemon goes on with what it has
    (tmp_path / "actions.db").write_bytes(b"garbage" * 100)
    j = ActionJournal(tmp_path / "uplink.db", adopt=tmp_path / "actions.db")
    assert (tmp_path / "actions.db.unreadable").exists() and j.known("e1") is not None


def test_a_full_outbox_drops_the_oldest_and_counts_them(tmp_path):
    j = ActionJournal(UplinkOutbox(tmp_path / "uplink.db", _refuse, max_entries=3))
    for i in range(5):
        j.queue("result", f"e{i}", {})
    assert [m.execution_id for m in _drain(j)] == ["e2", "e3", "e4"]
    assert j.uplink.counter("dropped_full", "actions") == 2


def test_finished_executions_are_forgotten_after_the_retention(tmp_path):
    j = ActionJournal(tmp_path / "uplink.db")
    j.accept("old", "h", LOCAL, {}, None)
    j.finish("old", "success", {})
    j.accept("running", "h", LOCAL, {}, None)
    import time

    assert j.prune(time.time() + 31 * 86400) == 1
    assert j.known("old") is None and j.known("running") is not None


def test_announced_checksums_survive_a_restart(tmp_path):
    j = ActionJournal(tmp_path / "uplink.db")
    assert j.announced() is None
    j.set_announced({"a": "1"})
    j.close()
    assert ActionJournal(tmp_path / "uplink.db").announced() == {"a": "1"}


async def _refuse(kind, body):
    raise AssertionError("no default lane in these tests")


def _drain(j: ActionJournal) -> list:
    """The messages queued so far, taken out of the outbox as if delivered."""
    out = j.messages()
    j.uplink.db.execute("DELETE FROM outbox WHERE lane = 'actions'")
    return out


# -- the outbox -----------------------------------------------------------------------------------------------


async def test_outbox_delivers_in_order_drops_refusals_and_retries_transient_failures(tmp_path):
    j = ActionJournal(tmp_path / "uplink.db")
    sent, fail = [], {"e2": [TransientError("result", 503), None], "e3": [ControlPlaneError("ack", 422)]}

    async def send(m):
        outcome = fail.get(m.execution_id, [None]).pop(0) if fail.get(m.execution_id) else None
        if outcome is not None:
            raise outcome
        sent.append(m.execution_id)

    outbox = Outbox(j, send, backoff=Backoff(base=0.01, cap=0.02, jitter=0))
    for e in ("e1", "e2", "e3", "e4"):
        j.queue("ack", e, {})
    task = asyncio.create_task(j.uplink.run())
    assert await outbox.flush(5)
    task.cancel()
    assert sent == ["e1", "e2", "e4"] and outbox.status()["refused"] == 1 and j.outbox_size() == 0


# -- the dispatcher -------------------------------------------------------------------------------------------


class Harness:
    def __init__(self, tmp: Path, *, max_concurrent: int = 5, builtins: dict | None = None) -> None:
        self.hooks_dir = tmp / "hooks"
        self.hooks_dir.mkdir(mode=0o755)
        self.journal = ActionJournal(tmp / "uplink.db")
        self.hookset = HookSet(str(self.hooks_dir), self.journal, scan_hooks(self.hooks_dir), self._publish)
        self.outbox = Outbox(self.journal, self._send)
        view = NodeView(lambda: "n_1", lambda: "10.100.0.1", _status, dict, _none, _none, dict, _none, _none,
                        lambda n: [])
        self.d = ActionDispatcher(ActionsConfig(max_concurrent=max_concurrent), self.journal, self.outbox,
                                  self.hookset, view, lambda: "n_1", LocalAudit(tmp / "audit.log"),
                                  builtins=builtins)

    async def _publish(self, scan):
        pass

    async def _send(self, m):
        pass

    def hook(self, name: str, body: str) -> str:
        path = self.hooks_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return hashlib.sha256(path.read_bytes()).hexdigest()

    async def rescan(self) -> None:
        await self.hookset.rescan("test")
        self.hookset.mark_announced(self.hookset.current)

    async def event(self, payload: dict) -> None:
        await self.d.handle_event(Envelope("action_request", "evt", "2026-01-01T00:00:00Z", "n",
                                           json.dumps(payload), ""))

    def messages(self) -> list:
        return [(m.kind, m.execution_id, m.body) for m in _drain(self.journal)]


async def _status():
    return {"health": {"status": "healthy"}}


async def _none(*a):
    return None


def acks(messages: list) -> dict[str, str]:
    return {eid: body["reason"] or body["status"] for kind, eid, body in messages if kind == "ack"}


async def test_six_at_once_with_a_limit_of_five_refuses_exactly_one(tmp_path):
    release = asyncio.Event()

    async def wait(view, params):
        await release.wait()
        return Output(0, "ok\n")

    h = Harness(tmp_path, builtins={"wait": Builtin("wait", "", (), wait)})
    for i in range(6):
        await h.event({"execution_id": f"e{i}", "action": "wait"})
    assert len(h.d.running) == 5
    release.set()
    await asyncio.wait([r.task for r in h.d.running.values()])
    got = h.messages()
    assert sorted(acks(got).values()) == ["accepted"] * 5 + ["max_concurrent_reached"]
    assert sum(1 for kind, _, body in got if kind == "result" and body["status"] == "success") == 5


async def test_a_hook_differing_from_the_request_or_the_announcement_is_refused_and_reported(tmp_path):
    h = Harness(tmp_path)
    good = h.hook("h.sh", f"touch {tmp_path}/ran\n")
    await h.rescan()
    h.hook("h.sh", f"touch {tmp_path}/ran\necho changed\n")  # edited; not re-scanned, not re-announced
    await h.event({"execution_id": "e1", "action": "h.sh", "checksum": good})
    got = h.messages()
    assert acks(got) == {"e1": "integrity_violation"}
    [(_, _, violation)] = [m for m in got if m[0] == "violation"]
    assert violation["expected_checksum"] == good and "differs from the request's checksum" in violation["detail"]
    # the request names the new file, but the control plane was never told about it
    new = hashlib.sha256((h.hooks_dir / "h.sh").read_bytes()).hexdigest()
    await h.hookset.rescan("test")  # scanned, the announcement not delivered
    await h.event({"execution_id": "e2", "action": "h.sh", "checksum": new})
    got = h.messages()
    assert acks(got) == {"e2": "integrity_violation"}
    assert "differs from the checksum last announced" in next(m for m in got if m[0] == "violation")[2]["detail"]
    assert not (tmp_path / "ran").exists()


async def test_a_request_without_checksum_for_a_hook_is_invalid_and_a_replay_is_a_duplicate(tmp_path):
    h = Harness(tmp_path)
    sha = h.hook("h.sh", "echo hi\n")
    await h.rescan()
    await h.event({"execution_id": "e1", "action": "h.sh"})
    await h.event({"execution_id": "e2", "action": "h.sh", "checksum": sha})
    await asyncio.wait([r.task for r in h.d.running.values()])
    await h.event({"execution_id": "e2", "action": "h.sh", "checksum": sha})
    got = h.messages()
    assert [(k, e, b.get("reason", b.get("status"))) for k, e, b in got] == [
        ("ack", "e1", "invalid_request"), ("ack", "e2", ""), ("result", "e2", "success"),
        ("ack", "e2", "duplicate_execution_id")]


async def test_an_execution_cut_short_by_a_crash_is_reported_as_error_and_never_rerun(tmp_path):
    h = Harness(tmp_path)
    h.journal.accept("e1", "h.sh", CONTROL_PLANE, {"triggered_by": {"type": "control_plane"}}, None)
    assert h.d.recover() == 1
    [(kind, eid, body)] = h.messages()
    assert (kind, eid, body["status"], body["exit_code"]) == ("result", "e1", "error", 1)
    assert "not run again" in body["stderr"] and body["triggered_by"] == {"type": "control_plane"}
    await h.event({"execution_id": "e1", "action": "h.sh", "checksum": "x"})
    assert acks(h.messages()) == {"e1": "duplicate_execution_id"}


async def test_a_deferred_result_is_kept_across_a_restart_and_reported_once_by_finish_deferred(tmp_path):
    seen = []

    async def install(view, params):
        seen.append(EXECUTION.get())
        return Output(0, "installed\n", deferred=True)

    builtins = {"svc.later": Builtin("svc.later", "", (), install)}
    h = Harness(tmp_path, builtins=builtins)
    await h.event({"execution_id": "e1", "action": "svc.later", "triggered_by": {"type": "control_plane"}})
    await asyncio.wait_for(asyncio.gather(*[r.task for r in h.d.running.values() if r.task]), 5)
    assert seen == ["e1"] and h.d.running == {}
    assert [(k, e) for k, e, _ in h.messages()] == [("ack", "e1")], "no result yet"
    assert h.journal.known("e1").state == "running"

    # The restart: a new dispatcher on the same journal keeps it for its owner instead of calling it interrupted.
    again = ActionDispatcher(ActionsConfig(), h.journal, h.outbox, h.hookset, h.d.view, lambda: "n_1", h.d.audit,
                             builtins=builtins)
    assert again.recover(keep=frozenset({"e1"})) == 0 and h.journal.known("e1").state == "running"
    again.finish_deferred("e1", 1, "{}\n", "went wrong; rolled back\n", "rolled back")
    [(kind, eid, body)] = h.messages()
    assert (kind, eid, body["status"], body["exit_code"], body["stderr"]) == (
        "result", "e1", "failed", 1, "went wrong; rolled back\n")
    assert body["triggered_by"] == {"type": "control_plane"}
    again.finish_deferred("e1", 0, "", "", "again")  # finished already: not reported twice
    assert h.messages() == []


async def test_disabled_and_shutting_down_refuse_before_anything_else(tmp_path):
    h = Harness(tmp_path)
    h.d.config = ActionsConfig(enabled=False)
    await h.event({"execution_id": "e1", "action": "nope"})
    h.d.config = ActionsConfig()
    await h.d.drain(1)
    await h.event({"execution_id": "e2", "action": "nope"})
    assert acks(h.messages()) == {"e1": "actions_disabled", "e2": "shutting_down"}


async def test_drain_cancels_what_outlives_the_window_and_its_result_is_queued(tmp_path):
    h = Harness(tmp_path)
    h.d.config = ActionsConfig(kill_grace=0.2)
    sha = h.hook("stuck.sh", "trap '' TERM\nsleep 60\n")
    await h.rescan()
    await h.event({"execution_id": "e1", "action": "stuck.sh", "checksum": sha})
    await asyncio.sleep(0.2)
    await h.d.drain(0.3)
    results = [b for k, _, b in h.messages() if k == "result"]
    assert [r["status"] for r in results] == ["cancelled"] and not h.d.running


async def test_a_request_whose_hook_check_outlasts_the_drain_is_refused_not_started(tmp_path, monkeypatch):
    # The drain began while the hook was being checked (files read in threads): the request was journaled and the
    # hook started after the drain had returned, waited for by nobody. The one stand-in: the check is slowed.
    from plexd.actions import dispatcher as dispatcher_module

    real_image = dispatcher_module.image_hook
    checking = asyncio.Event()

    def slow_image(path):
        checking.set()
        import time
        time.sleep(0.5)
        return real_image(path)
    monkeypatch.setattr(dispatcher_module, "image_hook", slow_image)
    h = Harness(tmp_path)
    sha = h.hook("slow.sh", f"touch {tmp_path / 'ran'}\n")
    await h.rescan()
    request = asyncio.ensure_future(h.event({"execution_id": "e1", "action": "slow.sh", "checksum": sha}))
    while not checking.is_set():
        await asyncio.sleep(0.01)
    await h.d.drain(5)
    await request
    assert acks(h.messages()) == {"e1": "shutting_down"} and not h.d.running
    await asyncio.sleep(0.2)
    assert not (tmp_path / "ran").exists() and h.journal.known("e1") is None


def test_the_audit_line_of_a_lone_surrogate_is_written_escaped(tmp_path):
    # An unauthorized local run naming "x\ud800" crashed the audit (no answer, no record) in the authorize step.
    audit = LocalAudit(tmp_path / "audit.log")
    audit.record("local_run_refused", action="system.info\ud800", uid=65534)
    line = json.loads((tmp_path / "audit.log").read_text())
    assert line["action"] == "system.info\ud800" and line["uid"] == 65534


def test_describe_changes_names_each_change():
    from plexd.trust.integrity import Hook, HookScan, RefusedHook

    a, b = Hook("a", "/a", "1" * 64), Hook("b", "/b", "2" * 64)
    old = HookScan((a, b))
    new = HookScan((Hook("a", "/a", "3" * 64), Hook("c", "/c", "4" * 64)), (RefusedHook("d", "/d", "mode"),))
    assert describe_changes(old, new) == ["c added", "b removed", "a changed (sha256 111111111111… → 333333333333…)",
                                          "d refused: mode"]


async def test_verify_names_a_hook_edited_since_the_scan_and_one_never_announced(tmp_path):
    from plexd.actions.action_routes import verify_hooks

    h = Harness(tmp_path)
    h.hook("a.sh", "echo a\n")
    await h.rescan()
    assert (await verify_hooks(h.d))["ok"] is True
    h.hook("a.sh", "echo changed\n")
    h.hook("b.sh", "echo b\n")
    await h.hookset.rescan("test")  # b.sh scanned, not announced; a.sh re-scanned, not announced
    h.hook("a.sh", "echo changed again\n")
    doc = await verify_hooks(h.d)
    assert doc["ok"] is False
    assert {r["name"]: r["problem"] for r in doc["hooks"]} == {
        "a.sh": "changed since the last scan", "b.sh": "was never announced to the control plane"}


async def test_an_announcement_that_cannot_re_register_waits_the_backoff_cap(tmp_path, caplog):
    """Without a token to re-register with, retrying fast only repeats the refusal: wait the cap, say why."""
    from plexd.base.errors import PlexdError
    from plexd.trust.integrity import HookScan

    failures = [TransientError("capabilities", 503), PlexdError("no bootstrap token to re-register with")]

    async def publish(scan):
        raise failures.pop(0)

    hs = HookSet(str(tmp_path), ActionJournal(tmp_path / "uplink.db"), HookScan(), publish,
                 backoff=Backoff(base=1, cap=60, jitter=0))
    assert await hs._announce_once(HookScan()) == 1
    assert await hs._announce_once(HookScan()) == 60
    assert "no bootstrap token" in caplog.text and hs.last_announce_error.startswith("no bootstrap token")


@pytest.mark.parametrize("payload, refusal", [
    ({"execution_id": "\ud800"}, "MissingExecutionId"),
    ({"execution_id": "x", "action": "\ud800"}, "InvalidRequest"),
    ({"execution_id": "x", "action": "a", "parameters": {"\ud800": "v"}}, "InvalidRequest"),
    ({"execution_id": "x", "action": "a", "parameters": {"k": "\udfff"}}, "InvalidRequest"),
])
def test_a_lone_surrogate_anywhere_in_a_request_is_a_named_refusal_not_an_encoding_crash(payload, refusal):
    # "\ud800" in the JSON decodes to a lone surrogate, which no file name, environment or log line can carry
    # (hypothesis found the execution id's; the others are the same hole)
    from plexd.actions.request import parse_request

    with pytest.raises(Exception) as caught:
        parse_request(payload)
    assert type(caught.value).__name__ == refusal and "lone surrogate" in str(caught.value) + repr(caught.value)


async def test_a_rejection_and_a_result_the_full_journal_cannot_take_are_written_once_it_can(tmp_path):
    """Found by `python -m bench chaos` (disk_full): a request refused while data_dir was full was never
    acknowledged, and a result finished then was lost. The journal's file is made full for real (SQLite's
    max_page_count: "database or disk is full"); both wait in memory and reach the outbox once it has room."""
    release = asyncio.Event()

    async def wait(view, params):
        await release.wait()
        return Output(0, "done\n")

    h = Harness(tmp_path, builtins={"wait": Builtin("wait", "", (), wait)})
    h.d.unwritten.retry_every = 0.05
    await h.event({"execution_id": "e1", "action": "wait"})
    assert acks(h.messages()) == {"e1": "accepted"}

    db = h.journal.uplink.db
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    filled = 0
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        for filled in range(10_000):  # the rows that fit before the file is full
            h.journal.uplink.put("filler", {"n": filled}, lane="filler")
    await h.event({"execution_id": "e2", "action": "no.such.action"})
    release.set()
    await asyncio.wait([r.task for r in h.d.running.values() if r.task])
    assert h.d.status()["unwritten"] == 2 and h.messages() == []

    db.execute("DELETE FROM outbox WHERE lane = 'filler'")  # room again, as when the disk is freed
    for _ in range(100):
        if not h.d.status()["unwritten"]:
            break
        await asyncio.sleep(0.05)
    got = h.messages()
    assert acks(got) == {"e2": "unknown_action"}
    assert [(eid, body["status"]) for kind, eid, body in got if kind == "result"] == [("e1", "success")]
    assert h.d.status()["unwritten"] == 0 and filled > 0
