"""Hooks and actions in a real `plexd up` (real wireguard-go in a lab namespace) against the real devplane: an
admin-requested hook runs once with its parameters and its output reaches the devplane, in both contracts (in the
platform's, as an execution in the node's state: tests/e2e/test_platform_actions_lab.py has more); replays of the
same execution — live and after a restart — are refused (spec) or find it settled (platform); a hook edited after
its announcement is refused with an integrity report and never runs; a timeout kills the whole process group; the
concurrency limit holds; results made while the devplane is down arrive after it returns; `plexd actions run
--local` streams, checks its caller and works offline; SIGTERM drains a running hook and delivers its result."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from lab_daemon import PLEXD, Daemon, wait_until
from process_helpers import NOBODY, alive, run_as

pytestmark = pytest.mark.root


def write_hook(hooks: Path, name: str, body: str, sidecar: dict | None = None) -> str:
    hooks.mkdir(mode=0o755, parents=True, exist_ok=True)
    path = hooks / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    if sidecar is not None:
        (hooks / f"{name}.json").write_text(json.dumps(sidecar))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def workspace(lab, tmp_path: Path) -> tuple[Path, Path]:
    """A directory the hooks write into (what they did, for the test to see), and the first node's hooks.dir
    (as `Daemon` configures it)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return work, tmp_path / lab.nodes[0].name / "hooks"


def announced(dp, node_id: str) -> dict[str, str]:
    """The hooks the node last announced, name → hex SHA-256 (the platform's manifest has them in base64)."""
    if dp.dialect == "platform":
        manifests = dp.admin.capabilities(node_id)
        hooks = (manifests[-1].get("declared_hooks") or []) if manifests else []
        return {h["name"]: base64.b64decode(h["checksum"]).hex() for h in hooks}
    caps = dp.admin.node(node_id).get("capabilities") or {}
    return {h["name"]: h["checksum"] for h in caps.get("hooks") or []}


def execution(dp, node_id: str, execution_id: str) -> dict:
    return next((e for e in dp.admin.executions(node_id) if e["execution_id"] == execution_id), {})


def finished(dp, node_id: str, execution_id: str, daemons, timeout: float = 30) -> dict:
    wait_until(lambda: execution(dp, node_id, execution_id).get("result") is not None, timeout,
               f"the result of {execution_id}", daemons)
    return execution(dp, node_id, execution_id)


TERMINAL = ("succeeded", "failed", "cancelled", "timeout")


def settled(dp, node_id: str, execution_id: str, daemons) -> dict:
    """Platform: the execution once its terminal callback landed."""
    wait_until(lambda: dp.admin.execution(node_id, execution_id)["status"] in TERMINAL, 30,
               f"the result of {execution_id}", daemons)
    return dp.admin.execution(node_id, execution_id)


def outcome(dp, node_id: str, execution_id: str, daemons) -> dict:
    """Once reported, in either contract: the status (the spec's names), exit code and output (stdout, then
    stderr: the platform has one output)."""
    if dp.dialect == "platform":
        ex = settled(dp, node_id, execution_id, daemons)
        return {"status": {"succeeded": "success"}.get(ex["status"], ex["status"]), "exit_code": ex["exit_code"],
                "output": dp.admin.execution_output(node_id, execution_id).decode()}
    result = finished(dp, node_id, execution_id, daemons)["result"]
    return {"status": result["status"], "exit_code": result["exit_code"], "output": result["stdout"] + result["stderr"]}


def refusal(dp, node_id: str, execution_id: str, daemons) -> str:
    """Why the node refused it: the spec's rejected ack's reason, the platform's failed callback's error."""
    if dp.dialect == "platform":
        return settled(dp, node_id, execution_id, daemons)["error"]
    wait_until(lambda: execution(dp, node_id, execution_id).get("ack") is not None, 20, f"ack {execution_id}",
               daemons)
    return execution(dp, node_id, execution_id)["ack"]["reason"]


def start(lab, dp, daemons, tmp_path, extra: str = "", node_api: str = "") -> Daemon:
    shutdown = "" if "shutdown:" in extra else "shutdown: {deregister: false}\n"
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, "1h", node_api=node_api, extra_config=shutdown + extra)
    daemons.append(d)
    wait_until(lambda: d.node_id() is not None, 30, "registration", daemons)
    wait_until(d.api_listening, 30, "the node API socket", daemons)
    return d


@pytest.mark.parametrize("lab_dp", [{"nodes": 1, "dialect": "spec"}, {"nodes": 1, "dialect": "platform"}],
                         indirect=True, ids=["spec", "platform"])
def test_hook_runs_once_and_replays_are_refused_live_and_after_a_restart(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    spec = dp.dialect == "spec"
    work, hooks = workspace(lab, tmp_path)
    # $0 is the sealed copy's /proc/self/fd/N: a file beside the hook is found through PLEXD_HOOKS_DIR
    (hooks / "lib").mkdir(mode=0o755, parents=True)
    (hooks / "lib" / "common.sh").write_text('say() { echo "$@"; }\n')
    write_hook(hooks, "record.sh", f'echo "$PLEXD_EXECUTION_ID $PLEXD_PARAM_TARGET $PLEXD_PARAM_DRY_RUN" '
                                   f'>> {work}/runs\n. "$PLEXD_HOOKS_DIR/lib/common.sh"\n'
                                   'say "target=$PLEXD_PARAM_TARGET node=$PLEXD_NODE_ID"\n'
                                   '[ "$PLEXD_HOOK_PATH" = "$PLEXD_HOOKS_DIR/record.sh" ] || exit 9\n'
                                   'echo "to stderr" >&2\nexit 3\n',
               {"description": "records its runs", "timeout": "30s",
                "parameters": [{"name": "target", "required": True}, {"name": "dry-run"}]})
    d = start(lab, dp, daemons, tmp_path)
    node_id = d.node_id()
    wait_until(lambda: "record.sh" in announced(dp, node_id), 20, "the hook announced", daemons)
    if spec:  # the platform's manifest names hooks only
        caps = dp.admin.node(node_id)["capabilities"]
        assert {b["name"] for b in caps["builtin_actions"]} >= {
            "system.info", "health.check", "diagnostics.ping_peer", "diagnostics.collect", "mesh.reconnect",
            "config.dump", "service.reload_config"}

    eid = dp.admin.request_action(node_id, "record.sh", {"target": "/srv", "dry-run": True})
    got = outcome(dp, node_id, eid, daemons)
    assert (got["status"], got["exit_code"]) == ("failed", 3)
    assert got["output"] == f"target=/srv node={node_id}\nto stderr\n"
    assert (work / "runs").read_text() == f"{eid} /srv true\n"
    if spec:
        ex = execution(dp, node_id, eid)
        assert ex["ack"] == {"execution_id": eid, "status": "accepted", "reason": ""}
        result = ex["result"]
        assert result["stdout"] == f"target=/srv node={node_id}\n" and result["stderr"] == "to stderr\n"
        assert result["duration"].endswith("s") and result["finished_at"].endswith("Z")
        assert result["triggered_by"]["type"] == "control_plane"
    else:
        assert [(c["body"]["status"], c["http_status"]) for c in dp.admin.execution_callbacks(node_id, eid)] == [
            ("ack", 200), ("started", 200), ("failed", 200)]
        assert dp.admin.execution(node_id, eid)["error"] == "exit status 3"

    # the same request again, as a new event, live and after a restart: spec refuses it as a duplicate; the
    # platform's event is a pull, which no longer lists it
    def replayed(times: int) -> None:
        pulls = d.logged().count("policy_updated, pulling the state")  # what the platform's events become
        dp.admin.resend_action(node_id, eid)
        if spec:
            wait_until(lambda: len(execution(dp, node_id, eid).get("acks", [])) == times + 1, 20, "the replay's ack",
                       daemons)
            assert execution(dp, node_id, eid)["acks"][times] == {
                "execution_id": eid, "status": "rejected", "reason": "duplicate_execution_id"}
            assert len(execution(dp, node_id, eid)["results"]) == 1
        else:
            wait_until(lambda: d.logged().count("policy_updated, pulling the state") > pulls, 20,
                       "the replay's pull", daemons)
            assert len(dp.admin.execution_callbacks(node_id, eid)) == 3

    replayed(1)
    d.restart()
    wait_until(lambda: d.status().get("event_stream", {}).get("state") == "connected", 30, "the restarted stream",
               daemons)
    replayed(2)
    assert (work / "runs").read_text() == f"{eid} /srv true\n"
    if spec:
        assert "never run twice" in (d.dir / "plexd.log").read_text() + d.logged()

    # bad requests: each refused with its reason, the stream keeps flowing
    bad = {"object-param": ("record.sh", {"target": {"a": 1}}, "invalid_request"),
           "missing-param": ("record.sh", {}, "invalid_request"),
           "unknown": ("no-such-hook", {}, "unknown_action"),
           "traversal": ("../record.sh", {}, "invalid_request")}
    ids = {k: dp.admin.request_action(node_id, a, p) for k, (a, p, _) in bad.items()}
    for key, (_, _, reason) in bad.items():
        assert refusal(dp, node_id, ids[key], daemons) == reason, key
    dp.admin.publish_event(node_id, "action_request", {"action": "record.sh"})  # no execution id: no ack possible
    eid2 = dp.admin.request_action(node_id, "system.info")
    info = json.loads(outcome(dp, node_id, eid2, daemons)["output"])
    assert info["node_id"] == node_id and info["plexd_version"]
    assert (work / "runs").read_text().count("\n") == 1


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_integrity_timeouts_and_the_concurrency_limit(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    work, hooks = workspace(lab, tmp_path)
    old = write_hook(hooks, "tamper.sh", f"touch {work}/tampered-ran\n")
    write_hook(hooks, "forker.sh", f"sh -c 'trap \"\" TERM; echo $$ > {work}/child.pid; exec sleep 300' &\n"
                                   "sleep 300\n")
    write_hook(hooks, "slow.sh", "sleep 3\necho done\n")
    d = start(lab, dp, daemons, tmp_path, extra="actions: {max_concurrent: 5}\n")
    node_id = d.node_id()
    wait_until(lambda: len(announced(dp, node_id)) == 3, 20, "the hooks announced", daemons)

    # edited after the announcement: the watcher re-announces, but a request for what was announced is refused
    (hooks / "tamper.sh").write_text(f"#!/bin/sh\ntouch {work}/tampered-ran\necho evil\n")
    new = hashlib.sha256((hooks / "tamper.sh").read_bytes()).hexdigest()
    wait_until(lambda: announced(dp, node_id).get("tamper.sh") == new, 20, "the re-announcement", daemons)
    eid = dp.admin.request_action(node_id, "tamper.sh", checksum=old)
    wait_until(lambda: execution(dp, node_id, eid).get("ack") is not None, 20, "the ack", daemons)
    assert execution(dp, node_id, eid)["ack"] == {"execution_id": eid, "status": "rejected",
                                                  "reason": "integrity_violation"}
    wait_until(lambda: dp.admin.integrity(node_id), 20, "the integrity violation", daemons)
    [violation] = dp.admin.integrity(node_id)
    assert violation["type"] == "hook" and violation["path"] == str(hooks / "tamper.sh")
    assert violation["expected_checksum"] == old and violation["actual_checksum"] == new
    assert "checksum mismatch" in violation["detail"]
    assert not (work / "tampered-ran").exists()

    # a timeout kills the whole group, the child that ignores SIGTERM included
    eid = dp.admin.request_action(node_id, "forker.sh", timeout="2s")
    # the shell creates the file before echo writes into it
    wait_until(lambda: (work / "child.pid").exists() and (work / "child.pid").read_text().endswith("\n"), 10,
               "the child started", daemons)
    child = int((work / "child.pid").read_text())
    result = finished(dp, node_id, eid, daemons)["result"]
    assert result["status"] == "timeout" and result["exit_code"] == -1
    wait_until(lambda: not alive(child), 5, "the SIGTERM-ignoring child killed", daemons)

    # six at once with a limit of five: exactly one refused
    ids = [dp.admin.request_action(node_id, "slow.sh") for _ in range(6)]
    for e in ids:
        wait_until(lambda e=e: execution(dp, node_id, e).get("ack") is not None, 20, "all acks", daemons)
    reasons = sorted(execution(dp, node_id, e)["ack"]["reason"] for e in ids)
    assert reasons == ["", "", "", "", "", "max_concurrent_reached"]
    for e in ids:
        if execution(dp, node_id, e)["ack"]["status"] == "accepted":
            assert finished(dp, node_id, e, daemons)["result"]["stdout"] == "done\n"


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_local_runs_stream_check_their_caller_and_work_offline_and_sigterm_drains(lab_dp, api_dir, system_groups):
    lab, dp, daemons, tmp_path = lab_dp
    [(group, gid)] = system_groups(1)
    work, hooks = workspace(lab, tmp_path)
    write_hook(hooks, "ticker.sh", f"echo first\nwhile [ ! -e {work}/go ]; do sleep 0.1; done\necho second\n"
                                   "exit 7\n")
    write_hook(hooks, "drained.sh", f"touch {work}/drain-started\nsleep 2\necho finished in time\n")
    sock = api_dir / "api.sock"
    d = start(lab, dp, daemons, tmp_path, node_api=f"socket_path: {sock}, socket_group: {group}",
              extra="sse: {backoff_max: 2s}\n")
    node_id = d.node_id()
    wait_until(lambda: len(announced(dp, node_id)) == 2, 20, "the hooks announced", daemons)

    listed = json.loads(d.cli("actions", "list", "--json").stdout)
    assert [h["name"] for h in listed["hooks"]] == ["drained.sh", "ticker.sh"] and len(listed["builtin_actions"]) == 8
    hooks_doc = json.loads(d.cli("hooks", "list", "--json").stdout)
    assert all(h["announced_checksum"] == h["checksum"] for h in hooks_doc["hooks"])
    assert json.loads(d.cli("hooks", "verify", "--json").stdout)["ok"] is True
    text = d.cli("actions", "list").stdout
    assert "diagnostics.ping_peer" in text and "[peer_id, count?]" in text and "ticker.sh" in text
    assert "hooks verified: all ok" in d.cli("hooks", "verify").stdout

    # streamed: "first" is on our stdout while the hook still waits for the go file
    env = {**os.environ, "PLEXD_CONFIG": str(d.config)}
    proc = subprocess.Popen([PLEXD, "actions", "run", "ticker.sh", "--local"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "first\n"
    assert proc.poll() is None
    (work / "go").touch()
    out, err = proc.communicate(timeout=30)
    assert out == "second\n" and proc.returncode == 7, err

    # an unprivileged caller that can reach the socket is refused by SO_PEERCRED
    from plexd.node import control_client

    def as_nobody() -> int:
        try:
            control_client.call(str(sock), "POST", "/v1/daemon/actions/run", {"action": "ticker.sh"})
        except Exception as exc:
            print(exc)
            return 1
        return 0

    rc, printed = run_as(as_nobody, NOBODY, NOBODY, (gid,))
    assert rc == 1 and "local actions need root" in printed and "HTTP 403" in printed

    # with the devplane down: runs, and its result arrives once the devplane is back
    dp.stop()
    res = d.cli("actions", "run", "system.info", "--local", "--json")
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert lines[0]["type"] == "accepted" and lines[-1]["type"] == "result"
    local_id = lines[-1]["execution_id"]
    assert local_id.startswith("local-") and lines[-1]["triggered_by"] == {
        "type": "local", "session_id": "", "user_id": "uid:0", "email": ""}
    assert d.status()["actions"]["outbox"]["pending"] >= 1
    assert "message(s) to deliver" in d.cli("status").stdout
    dp.start()
    result = finished(dp, node_id, local_id, daemons, timeout=60)["result"]
    assert result["status"] == "success" and json.loads(result["stdout"])["node_id"] == node_id
    audit = [json.loads(x) for x in (d.dir / "data/actions/local-audit.log").read_text().splitlines()]
    assert {(a["event"], a["uid"]) for a in audit if a["execution_id"] == local_id} == {("started", 0),
                                                                                          ("finished", 0)}
    assert any(a["event"] == "refused" and a["uid"] == NOBODY for a in audit)

    # SIGTERM while a hook runs: it finishes within the drain window and its result is delivered
    eid = dp.admin.request_action(node_id, "drained.sh")
    wait_until(lambda: (work / "drain-started").exists(), 20, "the hook started", daemons)
    d.stop()
    result = execution(dp, node_id, eid)["result"]
    assert result is not None and result["status"] == "success" and result["stdout"] == "finished in time\n"


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_sigterm_cancels_a_hook_that_outlives_the_drain_and_reports_it(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    _, hooks = workspace(lab, tmp_path)
    write_hook(hooks, "stuck.sh", "trap '' TERM\nsleep 300\n")
    d = start(lab, dp, daemons, tmp_path, extra="shutdown: {deregister: false, drain: 1s}\n")
    node_id = d.node_id()
    wait_until(lambda: "stuck.sh" in announced(dp, node_id), 20, "the hook announced", daemons)
    eid = dp.admin.request_action(node_id, "stuck.sh")
    wait_until(lambda: d.status()["actions"]["running"], 20, "the hook running", daemons)
    took = d.stop()
    assert took < 15
    result = execution(dp, node_id, eid)["result"]
    assert result is not None and result["status"] == "cancelled"
    assert "cancelling 1 action(s)" in d.logged()


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_builtin_actions_on_a_two_node_mesh(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    from lab_daemon import pinging_pair

    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h", a_config="shutdown: {deregister: false}\n")
    a_id, b_id = a.node_id(), b.node_id()

    def local(d: Daemon, name: str, *params: str, check: bool = True) -> tuple[int, dict]:
        res = d.cli("actions", "run", name, "--local", *[f"--param={p}" for p in params], "--json", check=check)
        return res.returncode, [json.loads(x) for x in res.stdout.splitlines()][-1]

    rc, result = local(a, "diagnostics.ping_peer", f"peer_id={b_id}", "count=2")
    ping = json.loads(result["stdout"])
    assert rc == 0 and ping["mesh_ip"] == b.mesh_ip() and ping["received"] == 2 and ping["rtt_ms"]["avg"] > 0
    rc, result = local(a, "diagnostics.ping_peer", "peer_id=n_nope", check=False)
    assert rc == 1 and "unknown peer" in result["stderr"]

    rc, result = local(a, "health.check")
    assert rc == 0 and json.loads(result["stdout"])["health"]["status"] == "healthy"

    # diagnostics.collect and config.dump: everything an operator asks for first, and no secret
    secret = (a.dir / "data" / "node_secret_key").read_text().strip()
    private = (a.dir / "data" / "private_key").read_text().strip()
    rc, result = local(a, "diagnostics.collect")
    collected = json.loads(result["stdout"])
    assert rc == 0 and {"status", "recent_logs", "device", "firewall", "config"} <= set(collected)
    assert [p["public_key"] for p in collected["device"]] and collected["recent_logs"]
    rc, result = local(a, "config.dump")
    assert json.loads(result["stdout"])["api.url"]["value"] == dp.url
    for text in (json.dumps(collected), result["stdout"]):
        assert secret not in text and private not in text

    # mesh.reconnect: a new stream connection, then a reconcile
    connects = a.status()["event_stream"]["connects"]
    rc, result = local(a, "mesh.reconnect")
    assert rc == 0 and json.loads(result["stdout"])["ok"] is True
    wait_until(lambda: a.status()["event_stream"]["connects"] > connects, 10, "the reconnect", daemons)

    # service.reload_config: what can change live is applied, the rest is listed
    text = a.config.read_text().replace("mesh: {interface: plexd0,", "mesh: {interface: plexd0, listen_port: 51999,")
    a.config.write_text(text + "actions: {max_concurrent: 2}\n")
    rc, result = local(a, "service.reload_config")
    reloaded = json.loads(result["stdout"])
    assert rc == 0 and reloaded["applied"] == ["actions.max_concurrent"]
    assert reloaded["restart_needed"] == ["mesh.listen_port"]
    assert a.status()["actions"]["max_concurrent"] == 2

    # every one of them reached the control plane as a result
    wait_until(lambda: len([e for e in dp.admin.executions(a_id) if e["execution_id"].startswith("local-")
                            and e["result"]]) == 7, 20, "seven local results upstream", daemons)
