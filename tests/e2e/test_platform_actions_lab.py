"""Actions in the platform dialect on a real `plexd up` (lab namespace, real wireguard-go) against the devplane
serving the platform contract: an execution requested through the admin API is a pending entry of the node's
state, pulled every second and on every `action_request` event until its terminal callback lands. Whatever the
number of pulls, the hook runs once and the devplane records the one legal callback sequence once (with an output
over 16 KiB declared and uploaded); killed (SIGKILL) after ack and started, the restarted node reports it failed
once and never runs it again; and with its journal lost too, the node reports it lost once."""

from __future__ import annotations

import os
import signal

import pytest
from lab_daemon import Daemon, wait_until
from test_actions_lab import write_hook

from plexd.actions.dispatcher import LOST

pytestmark = pytest.mark.root

PLATFORM = {"nodes": 1, "dialect": "platform"}


def callbacks(dp, node_id: str, eid: str) -> list[tuple]:
    """(status, http status) of every callback the devplane recorded for `eid`, in order."""
    return [(c["body"]["status"], c["http_status"]) for c in dp.admin.execution_callbacks(node_id, eid)]


def terminal(dp, node_id: str, eid: str, daemons, timeout: float = 30) -> dict:
    wait_until(lambda: dp.admin.execution(node_id, eid)["status"] in ("succeeded", "failed", "cancelled"), timeout,
               f"execution {eid} finished", daemons)
    return dp.admin.execution(node_id, eid)


def cycles(d: Daemon) -> int:
    return d.status()["reconcile"]["cycles"]


def kill(d: Daemon) -> None:
    """SIGKILL to plexd's process group (its hooks run in groups of their own and outlive it)."""
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait(10)


@pytest.mark.parametrize("lab_dp", [PLATFORM], indirect=True)
def test_an_execution_runs_once_through_many_pulls_a_kill_and_a_lost_journal(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    work = tmp_path / "work"
    work.mkdir()
    hooks = tmp_path / lab.nodes[0].name / "hooks"
    write_hook(hooks, "steady.sh", f'echo "$PLEXD_EXECUTION_ID $PLEXD_PARAM_TARGET" >> {work}/runs\nsleep 4\n'
                                   'seq 1 6000\necho "to stderr" >&2\n')
    write_hook(hooks, "held.sh", f'echo "$PLEXD_EXECUTION_ID" >> {work}/runs\n'
                                 f'while [ ! -e {work}/go ]; do sleep 0.1; done\n')
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, "1s", extra_config="shutdown: {deregister: false}\n")
    daemons.append(d)
    wait_until(lambda: d.node_id() is not None, 30, "registration", daemons)
    node_id = d.node_id()

    def declared() -> set[str]:
        return {h["name"] for m in dp.admin.capabilities(node_id) for h in m.get("declared_hooks") or ()}

    wait_until(lambda: declared() >= {"steady.sh", "held.sh"}, 20, "the hooks declared", daemons)

    try:
        # Listed on every pull (one a second, and one per action_request event) while it runs: run once, told once.
        eid = dp.admin.request_action(node_id, "steady.sh", {"target": "/srv"})
        wait_until(lambda: (work / "runs").exists(), 20, "the hook started", daemons)
        before = cycles(d)
        for _ in range(3):
            dp.admin.resend_action(node_id, eid)
        ex = terminal(dp, node_id, eid, daemons)
        assert cycles(d) - before >= 2  # pulled while it ran (besides the event refreshes)
        assert callbacks(dp, node_id, eid) == [("ack", 200), ("started", 200), ("started", 200), ("succeeded", 200)]
        output = "".join(f"{i}\n" for i in range(1, 6001)) + "to stderr\n"
        assert (ex["exit_code"], ex["error"]) == (0, None) and len(output) > 16 * 1024
        assert ex["type"] == "hook" and ex["output"]["object_key"] and ex["output"]["sha256"]
        assert dp.admin.execution_output(node_id, eid) == output.encode()
        assert (work / "runs").read_text() == f"{eid} /srv\n"

        # Killed after ack and started: the restart reports it failed once (the journal knew it ran), never again.
        held = dp.admin.request_action(node_id, "held.sh")
        wait_until(lambda: callbacks(dp, node_id, held) == [("ack", 200), ("started", 200)], 20, "ack and started",
                   daemons)
        kill(d)
        d.restart()
        ex = terminal(dp, node_id, held, daemons)
        assert ex["error"].startswith("plexd stopped while this action was running")
        assert "was running when plexd stopped" in d.logged()

        # Killed again, and its journal lost with it: the entry it finds started is reported lost once.
        lost = dp.admin.request_action(node_id, "held.sh")
        wait_until(lambda: callbacks(dp, node_id, lost) == [("ack", 200), ("started", 200)], 20, "ack and started",
                   daemons)
        kill(d)
        for name in ("uplink.db", "uplink.db-wal", "uplink.db-shm"):
            (d.dir / "data" / name).unlink(missing_ok=True)
        d.restart()
        ex = terminal(dp, node_id, lost, daemons)
        assert ex["error"] == LOST
        wait_until(lambda: cycles(d) >= 3, 20, "more pulls", daemons)
        assert callbacks(dp, node_id, held) == [("ack", 200), ("started", 200), ("failed", 200)]
        assert callbacks(dp, node_id, lost) == [("ack", 200), ("started", 200), ("failed", 200)]
        assert (work / "runs").read_text() == f"{eid} /srv\n{held}\n{lost}\n"
    finally:
        (work / "go").touch()  # the hooks orphaned by the kills end
