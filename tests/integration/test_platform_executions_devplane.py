"""Actions in the platform dialect against the real devplane serving it (real HTTP): the dispatcher, its journal
and outbox and the client, as the daemon wires them (`plexd.node.builders.build_actions`), driven by state pulls.
Whatever the pulls, restarts and refusals, the devplane records exactly the legal callback sequence once; output
goes inline up to 16 KiB and through the upload URL above; and the refusals that settle an execution are never
retried."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from pathlib import Path

import pytest
from test_platform_client import registered

from plexd.actions.audit import LocalAudit
from plexd.actions.builtins import Builtin, NodeView, Output
from plexd.actions.dispatcher import LOST, ActionDispatcher
from plexd.actions.hooks import HookSet
from plexd.actions.journal import LANE, ActionJournal
from plexd.actions.outbox import Outbox, deliver
from plexd.config.settings import ActionsConfig
from plexd.controlplane import platform_actions
from plexd.controlplane.client import ControlPlaneClient
from plexd.controlplane.client_errors import PermanentError
from plexd.controlplane.http_client import TransportError
from plexd.devplane.harness import Devplane
from plexd.trust.integrity import scan_hooks


@pytest.fixture
def platform_dp(tmp_path):
    with Devplane(tmp_path / "dp", dialect="platform") as plane:
        yield plane


async def _none(*args):
    return None


class Node:
    """One node's action side, as the daemon has it, on `data` (its uplink.db survives a `restart`)."""

    def __init__(self, client: ControlPlaneClient, node_id: str, data: Path, builtins: dict[str, Builtin],
                 **config) -> None:
        self.client, self.node_id, self.data, self.builtins, self.config = client, node_id, data, builtins, config
        (data / "hooks").mkdir(parents=True, exist_ok=True)
        self.start()

    def start(self) -> None:
        self.journal = ActionJournal(self.data / "uplink.db")

        async def send(message):
            await deliver(self.client, self.node_id, message)

        self.outbox = Outbox(self.journal, send)
        hooks = HookSet(str(self.data / "hooks"), self.journal, scan_hooks(self.data / "hooks"), _none)
        view = NodeView(lambda: self.node_id, lambda: "10.0.0.1", _none, dict, _none, _none, dict, _none, _none,
                        lambda n: [])
        self.dispatcher = ActionDispatcher(ActionsConfig(**self.config), self.journal, self.outbox, hooks, view,
                                           lambda: self.node_id, LocalAudit(self.data / "audit.log"),
                                           builtins=self.builtins)
        self.dispatcher.recover()

    def restart(self) -> None:
        """The process died: running tasks are gone, the journal and the outbox's file stay."""
        for running in self.dispatcher.running.values():
            if running.task is not None:
                running.task.cancel()
        self.journal.close()
        self.start()

    async def pull(self, deliver_after: bool = True) -> None:
        """What a reconcile does for actions: pull, offer, and (the uplink's service) deliver."""
        state = await self.client.fetch_state(self.node_id)
        await self.dispatcher.offer(state.action_requests)
        if deliver_after:
            await self.deliver()

    async def settle(self) -> None:
        tasks = [r.task for r in self.dispatcher.running.values() if r.task]
        if tasks:
            await asyncio.wait(tasks)

    async def deliver(self) -> None:
        await self.journal.uplink.deliver(LANE)


def statuses(dp: Devplane, node_id: str, eid: str) -> list[tuple]:
    """The callbacks the devplane recorded: (status, http status, code, error)."""
    return [(c["body"]["status"], c["http_status"], c["code"], c["body"].get("error"))
            for c in dp.admin.execution_callbacks(node_id, eid)]


OK = [("ack", 200, "", None), ("started", 200, "", None)]


def walked(terminal: str, error: str | None = None) -> list[tuple]:
    """The one legal sequence: ack, started, then `terminal`, each taken once."""
    return [*OK, (terminal, 200, "", error)]


def echo_builtins(runs: list, stdout: str = "out\n", stderr: str = "err\n", exit_code: int = 0) -> dict:
    async def echo(view, params):
        runs.append(params)
        return Output(exit_code, stdout, stderr)

    return {"echo": Builtin("echo", "", None, echo)}


def run(coro):
    return asyncio.run(coro)


def test_an_action_listed_on_every_pull_runs_once_and_reports_once(platform_dp, tmp_path):
    client, node_id = registered(platform_dp)
    runs: list = []
    eid = platform_dp.admin.request_action(node_id, "echo", {"target": "/srv", "n": 2}, action_type="builtin")

    async def scenario():
        node = Node(client, node_id, tmp_path / "n", echo_builtins(runs))
        await node.pull(deliver_after=False)
        await node.settle()
        for _ in range(4):  # listed until the terminal callback lands: the journal keeps it to one run
            await node.pull(deliver_after=False)
        await node.deliver()
        await node.pull()
        state = await client.fetch_state(node_id)
        await client.aclose()
        return state

    state = run(scenario())
    assert runs == [{"target": "/srv", "n": "2"}]
    assert statuses(platform_dp, node_id, eid) == walked("succeeded")
    execution = platform_dp.admin.execution(node_id, eid)
    assert (execution["status"], execution["exit_code"]) == ("succeeded", 0)
    assert platform_dp.admin.execution_output(node_id, eid) == b"out\nerr\n"
    assert state.action_requests == ()  # terminal: drained from the block


def test_a_failure_a_restart_mid_run_and_an_execution_lost_elsewhere(platform_dp, tmp_path):
    client, node_id = registered(platform_dp)
    release = asyncio.Event()

    async def slow(view, params):
        await release.wait()
        return Output(0, "")

    runs: list = []
    builtins = {**echo_builtins(runs, "", "no such disk\n", 2), "slow": Builtin("slow", "", None, slow)}
    failed = platform_dp.admin.request_action(node_id, "echo", action_type="builtin")
    cut = platform_dp.admin.request_action(node_id, "slow", action_type="builtin")
    elsewhere = platform_dp.admin.request_action(node_id, "echo", action_type="builtin")

    async def scenario():
        # another agent (or this one before its journal was lost) took `elsewhere` as far as started
        for status in ("ack", "started"):
            await platform_actions._post(client, node_id, elsewhere, {"status": status})
        node = Node(client, node_id, tmp_path / "n", builtins)
        await node.pull()  # failed and cut start, elsewhere is lost; ack and started delivered
        while failed in node.dispatcher.running:
            await asyncio.sleep(0.01)
        node.restart()  # killed while `slow` runs: the recovery reports it, it is never run again
        for _ in range(3):
            await node.pull()
        release.set()
        await client.aclose()

    run(scenario())
    assert statuses(platform_dp, node_id, failed) == walked("failed", "exit status 2")
    assert platform_dp.admin.execution(node_id, failed)["exit_code"] == 2
    [(status, code, _, error)] = statuses(platform_dp, node_id, cut)[2:]
    assert statuses(platform_dp, node_id, cut)[:2] == OK and (status, code) == ("failed", 200)
    assert "not run again" in error
    assert statuses(platform_dp, node_id, elsewhere) == walked("failed", LOST)
    assert len(runs) == 1


def test_refused_requests_walk_to_failed_once(platform_dp, tmp_path):
    client, node_id = registered(platform_dp)
    unknown = platform_dp.admin.request_action(node_id, "no.such.hook", action_type="hook")
    script = platform_dp.admin.request_action(node_id, "echo", action_type="script")
    bad = platform_dp.admin.request_action(node_id, "echo", {"p": {"nested": 1}}, action_type="builtin")

    async def scenario():
        node = Node(client, node_id, tmp_path / "n", echo_builtins([]))
        await platform_actions._post(client, node_id, bad, {"status": "ack"})  # acked already: one edge less
        for _ in range(3):
            await node.pull(deliver_after=False)
        await node.deliver()
        await node.pull()
        await client.aclose()

    run(scenario())
    assert statuses(platform_dp, node_id, unknown) == walked("failed", "unknown_action")
    assert statuses(platform_dp, node_id, script) == walked("failed", "unsupported_action_type")
    assert statuses(platform_dp, node_id, bad) == walked("failed", "invalid_request")


def test_actions_disabled_and_a_busy_node(platform_dp, tmp_path):
    client, node_id = registered(platform_dp)
    release = asyncio.Event()

    async def slow(view, params):
        await release.wait()
        return Output(0, "")

    first = platform_dp.admin.request_action(node_id, "slow", action_type="builtin")
    second = platform_dp.admin.request_action(node_id, "slow", action_type="builtin")

    async def scenario():
        node = Node(client, node_id, tmp_path / "n", {"slow": Builtin("slow", "", None, slow)}, max_concurrent=1)
        await node.pull()
        await node.pull()  # no slot for `second`: not answered, offered again
        busy = [c["body"]["status"] for c in platform_dp.admin.execution_callbacks(node_id, second)]
        release.set()
        await node.settle()
        await node.pull()
        await node.settle()
        await node.deliver()
        node.dispatcher.config = ActionsConfig(enabled=False)
        disabled = platform_dp.admin.request_action(node_id, "slow", action_type="builtin")
        await node.pull()
        await client.aclose()
        return busy, disabled

    busy, disabled = run(scenario())
    assert busy == []
    for eid in (first, second):
        assert statuses(platform_dp, node_id, eid) == walked("succeeded")
    assert statuses(platform_dp, node_id, disabled) == walked("failed", "actions_disabled")


# -- the callbacks, the client alone ------------------------------------------------------------------------------

RESULT = {"execution_id": "", "status": "success", "exit_code": 0, "stdout": "", "stderr": "", "duration": "1s",
          "finished_at": "2026-01-01T00:00:00Z"}


def test_output_over_16_kib_is_uploaded_and_named_and_a_failed_upload_goes_inline_cut(platform_dp):
    client, node_id = registered(platform_dp)
    big = platform_dp.admin.request_action(node_id, "echo", action_type="builtin")
    cut = platform_dp.admin.request_action(node_id, "echo", action_type="builtin")
    stdout = "".join(f"line {i:06d}\n" for i in range(4000))  # 48 KiB

    async def scenario():
        await client.fetch_state(node_id)
        for eid in (big, cut):
            await client.ack_execution(node_id, eid, "accepted")
        await client.report_result(node_id, big, {**RESULT, "stdout": stdout, "stderr": "done\n"})
        real_send = client._http.send

        async def refuse_uploads(method, url, **kwargs):
            if method == "PUT":
                raise TransportError("cannot connect", "refused")
            return await real_send(method, url, **kwargs)

        client._http.send = refuse_uploads
        await client.report_result(node_id, cut, {**RESULT, "stdout": stdout})
        await client.aclose()

    run(scenario())
    data = (stdout + "done\n").encode()
    assert platform_dp.admin.execution_output(node_id, big) == data
    [declared, terminal] = platform_dp.admin.execution_callbacks(node_id, big)[2:]
    assert declared["body"] == {"status": "started", "declared_output_bytes": len(data)}
    assert terminal["body"]["output"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert terminal["body"]["output"]["object_key"].startswith("v1/uploads/")
    assert platform_dp.admin.execution_output(node_id, cut) == stdout.encode()[:16 * 1024]
    last = platform_dp.admin.execution_callbacks(node_id, cut)[-1]
    assert last["http_status"] == 200 and len(base64.b64decode(last["body"]["output"]["inline"])) == 16 * 1024


def test_a_resent_ack_steps_over_taken_edges_and_settled_executions_are_not_retried(platform_dp):
    client, node_id = registered(platform_dp)
    eid = platform_dp.admin.request_action(node_id, "echo", action_type="builtin")

    async def scenario():
        await client.ack_execution(node_id, eid, "accepted")
        # After a restart, before any pull: the ack again (its delete was lost). Taken edges are stepped over; the
        # last one refused settles it.
        fresh = ControlPlaneClient(client.base_url, token=client.token, dialect="platform")
        with pytest.raises(PermanentError) as refused:
            await fresh.ack_execution(node_id, eid, "accepted")
        await fresh.report_result(node_id, eid, {**RESULT, "stdout": "ok\n"})
        with pytest.raises(PermanentError) as terminal:
            await fresh.report_result(node_id, eid, {**RESULT, "stdout": "ok\n"})
        await fresh.aclose()
        await client.aclose()
        return refused.value, terminal.value

    refused, terminal = run(scenario())
    assert refused.code == "invalid_state_transition" and "settled" in str(refused)
    assert terminal.code == "execution_already_terminal"
    assert statuses(platform_dp, node_id, eid) == [
        *OK, ("ack", 409, "invalid_state_transition", None), ("started", 409, "invalid_state_transition", None),
        ("succeeded", 200, "", None), ("succeeded", 409, "execution_already_terminal", None)]
