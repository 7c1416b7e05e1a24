"""plexd killed with SIGKILL at each named point (plexd/base/failpoint.py), then started again: what it promised holds.

A random kill (`bench chaos`, plexd_kill) lands between an answer and the write that keeps it only by luck; these
land there every time. Each test arms one point through PLEXD_TEST_FAILPOINTS, makes the daemon reach it, checks
that it died there (the failpoint's line, status -9), starts it again without the point and checks the promise:
the node keeps its one identity, converges, finishes the key rotation it began, reports an action that was cut
short once and never runs it again, invents no report its writer was not told was stored, opens its journals
without repair, and finishes an upgrade it had switched to.
"""

from __future__ import annotations

import json
import signal
import stat

import pytest
from lab_daemon import Daemon, register_ghost, wait_until, wg_peers

from plexd.base.failpoint import ENV, POINTS

pytestmark = pytest.mark.timeout(180)

KEEP_TUNNELS = "shutdown: {deregister: false}\n"


def armed(lab_dp, point: str, extra: str = "") -> Daemon:
    lab, dp, daemons, tmp_path = lab_dp
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, "1h", extra_config=KEEP_TUNNELS + extra, env={ENV: point})
    daemons.append(d)
    return d


def killed_at(d: Daemon, point: str, daemons) -> None:
    wait_until(lambda: d.proc.poll() is not None, 60, f"plexd killed at {point}", daemons)
    assert d.proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), (d.proc.returncode, d.logged()[-3000:])
    assert f"plexd: failpoint {point} (pass 1): SIGKILL now" in d.logged()


def restarted(d: Daemon, daemons) -> None:
    d.extra_env = {}
    d.restart()
    wait_until(lambda: '"msg": "ready"' in d.logged(), 60, "the daemon started again", daemons)


def errors(d: Daemon) -> list[str]:
    return [line for line in d.logged().splitlines() if '"level": "error"' in line]


def test_every_point_is_tested_here():
    tested = {name.removeprefix("test_").split("__")[0].replace("_", ".", 1) for name in globals()
              if name.startswith("test_") and "__" in name}
    assert tested == set(POINTS)


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_register_answered__the_same_identity_is_asked_for_again(lab_dp):
    _, dp, daemons, _ = lab_dp
    d = armed(lab_dp, "register.answered")
    killed_at(d, "register.answered", daemons)
    data = d.dir / "data"
    # The token is spent and the answer lost; the key it was sent with is on disk (0600), the token is not.
    pending = data / "private_key.registering"
    assert not (data / "identity.json").exists() and stat.S_IMODE(pending.stat().st_mode) == 0o600
    doc = json.loads(pending.read_text())
    assert sorted(doc) == ["private_key", "token_sha256", "written_at"] and len(doc["token_sha256"]) == 64
    token = (d.dir / "token").read_text().strip()  # still there: it is deleted once the identity is saved
    assert token and token not in pending.read_text()
    assert len(dp.admin.nodes()) == 1
    restarted(d, daemons)
    [node] = dp.admin.nodes()
    assert d.node_id() == node["id"] and not pending.exists()
    assert "bootstrap token already used" not in d.logged() and errors(d) == []


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_converge_between_domains__the_next_start_converges_all_of_them(lab_dp):
    lab, dp, daemons, _ = lab_dp
    _, ghost_key = register_ghost(dp, "ghost")
    d = armed(lab_dp, "converge.between_domains")  # the first domain of the first converge: the firewall
    killed_at(d, "converge.between_domains", daemons)
    assert ghost_key not in wg_peers(lab, d.node)  # the kill split the converge: the device was not reached
    restarted(d, daemons)
    wait_until(lambda: ghost_key in wg_peers(lab, d.node), 30, "the ghost on the device", daemons)
    assert "table inet plexd" in lab.exec(d.node, ["nft", "list", "tables"]).stdout
    assert d.status()["policy"]["enforcement"] == "enforced" and errors(d) == []


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_rotation_announced__the_next_start_finishes_the_rotation(lab_dp):
    lab, dp, daemons, _ = lab_dp
    d = armed(lab_dp, "rotation.announced")
    wait_until(lambda: '"msg": "ready"' in d.logged(), 60, "the daemon", daemons)
    node_id, old = d.node_id(), dp.admin.node(d.node_id())["public_key"]
    d.cli("rotate-keys", check=False)  # the control plane takes the new key; the daemon dies before committing it
    killed_at(d, "rotation.announced", daemons)
    announced = dp.admin.node(node_id)["public_key"]
    assert announced != old and (d.dir / "data" / "private_key.next").exists()
    restarted(d, daemons)
    device_key = lambda: lab.exec(d.node, ["wg", "show", "plexd0", "public-key"]).stdout.strip()  # noqa: E731
    wait_until(lambda: not (d.dir / "data" / "private_key.next").exists() and device_key() == announced, 30,
               "the rotation finished on the key the control plane has", daemons)
    assert dp.admin.node(node_id)["public_key"] == announced and errors(d) == []


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_action_finished__its_result_is_reported_once_and_it_is_not_run_again(lab_dp):
    _, dp, daemons, _ = lab_dp
    d = armed(lab_dp, "action.finished")
    wait_until(lambda: '"msg": "ready"' in d.logged(), 60, "the daemon", daemons)
    node_id = d.node_id()
    execution_id = dp.admin.request_action(node_id, "system.info")
    killed_at(d, "action.finished", daemons)
    restarted(d, daemons)

    def result() -> dict | None:
        return next((e for e in dp.admin.executions(node_id) if e["execution_id"] == execution_id), {}).get("result")

    wait_until(lambda: result() is not None, 30, "the result of the execution cut short", daemons)
    assert result()["status"] == "error" and "not run again" in result()["stderr"], result()
    assert d.logged().count(f"action system.info (execution {execution_id}) finished") == 0
    [done] = [e for e in dp.admin.executions(node_id) if e["execution_id"] == execution_id]
    assert len(done["results"]) == 1, done["results"]  # every result the devplane was sent


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_report_queued__an_unacknowledged_write_is_not_invented_and_the_next_arrives_once(lab_dp):
    _, dp, daemons, tmp_path = lab_dp
    d = armed(lab_dp, "report.queued")
    wait_until(d.api_listening, 60, "the node API socket", daemons)
    node_id = d.node_id()
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps({"status": "starting"}))
    lost = d.cli("state", "report", "put", "app-health", "--file", str(payload), check=False)
    killed_at(d, "report.queued", daemons)
    assert lost.returncode != 0  # the writer was never told it was stored
    restarted(d, daemons)
    wait_until(d.api_listening, 30, "the node API socket", daemons)
    wait_until(lambda: d.status()["node_api"]["report_sync"]["pending"] == 0, 30, "the queued key settled", daemons)
    assert dp.admin.report_entries(node_id) == []
    payload.write_text(json.dumps({"status": "up"}))
    d.cli("state", "report", "put", "app-health", "--file", str(payload))
    wait_until(lambda: dp.admin.report_entries(node_id), 30, "the report upstream", daemons)
    [entry] = dp.admin.report_entries(node_id)
    assert (entry["key"], entry["version"], entry["payload"]) == ("app-health", 1, {"status": "up"})
    assert errors(d) == []


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_mirror_commit__the_journals_open_without_repair(lab_dp):
    lab, dp, daemons, _ = lab_dp
    _, ghost_key = register_ghost(dp, "ghost")
    d = armed(lab_dp, "mirror.commit")  # the first commit of the mirror and the cursor, after the first state pull
    killed_at(d, "mirror.commit", daemons)
    restarted(d, daemons)
    wait_until(lambda: ghost_key in wg_peers(lab, d.node), 30, "the ghost on the device", daemons)
    _, second_key = register_ghost(dp, "second")  # an event after the restart: the ledger takes new cursors
    wait_until(lambda: second_key in wg_peers(lab, d.node), 30, "a peer added by event after the restart", daemons)
    logged = d.logged()
    assert errors(d) == [] and "repair" not in logged and "unreadable" not in logged


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_upgrade_switched__the_next_start_runs_the_new_release_and_reports_it_once(lab_dp, tmp_path):
    from test_actions_lab import finished
    from test_upgrade_lab import RELEASE_KEY, put_signed

    from plexd.upgrade import signing, zipapp

    lab, dp, daemons, workdir = lab_dp
    config = (f"upgrade: {{dir: {workdir / lab.nodes[0].name / 'releases'}, health_deadline: 10s, "
              f"release_keys: ['{signing.public_key(RELEASE_KEY)}']}}\n")
    d = armed(lab_dp, "upgrade.switched", config)
    wait_until(lambda: '"msg": "ready"' in d.logged(), 60, "the daemon", daemons)
    node_id = d.node_id()
    zipapp.build(tmp_path / "next.pyz", version="0.1.1-lab")
    put_signed(dp, "0.1.1-lab", tmp_path / "next.pyz")
    execution_id = dp.admin.start_upgrade(node_id, "0.1.1-lab")["execution_id"]
    killed_at(d, "upgrade.switched", daemons)
    # Started again as a supervisor would: the launcher runs the release the upgrade switched to, which proves
    # itself healthy and reports the upgrade, once, as the action's result.
    restarted(d, daemons)
    result = finished(dp, node_id, execution_id, daemons, timeout=60)["result"]
    assert result["status"] == "success" and json.loads(result["stdout"])["to_version"] == "0.1.1-lab", result
    assert d.status()["daemon"]["version"] == "0.1.1-lab" and not (d.dir / "data" / "upgrade.json").exists()
    [done] = [e for e in dp.admin.executions(node_id) if e["execution_id"] == execution_id]
    assert len(done["results"]) == 1, done["results"]
