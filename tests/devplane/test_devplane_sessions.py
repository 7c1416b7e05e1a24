"""Access sessions in the devplane (docs/protocol.md §A1): minted by the admin API and CLI, listed in the
node's state as the `sessions` block until revoked or expired, announced by `session_setup` / `session_revoked`
events, and their activity recorded. The token verifies with the node's own checks (plexd.access.token) against
the deployment's signing key. Real devplane process, real HTTP, the real admin CLI."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time

import pytest
from devplane_helpers import register
from nacl.signing import VerifyKey

from plexd.access.token import TokenRefused, verify_session_token
from plexd.devplane.harness import AdminError

CLI = [sys.executable, "-m", "plexd.devplane.devplane_cli"]


def verify(token: str, dp, session: dict, user: str | None = None):
    key = VerifyKey(base64.b64decode(dp.admin.status()["signing_keys"]["current"]))
    kind = session["kind"]
    return verify_session_token(token, keys=[key], session_id=session["session_id"], kind=kind,
                                target=session["target"][kind], now=time.time(), user=user)


def test_a_session_is_minted_listed_in_the_state_and_revoked(dp, readers):
    node = register(dp)
    stream = readers(node)
    created = dp.admin.create_session(node.id, "ssh", 600, user="deploy", allowed_commands=["id -un"],
                                      idle_timeout_seconds=60)
    session, token = created["session"], created["token"]
    sid = session["session_id"]
    assert session["jti"] == sid and session["target"] == {"ssh": {"user": "deploy", "allowed_commands": ["id -un"]}}
    claims = verify(token, dp, session, user="deploy")
    assert claims.jti == sid and claims.kind == "ssh"
    with pytest.raises(TokenRefused, match="another user"):
        verify(token, dp, session, user="root")

    block = node.get("state").json()["sessions"]
    assert block == [{"session_id": sid, "jti": sid, "kind": "ssh", "target": session["target"],
                      "expires_at": session["expires_at"], "idle_timeout_seconds": 60}]
    events = [stream.events.get(timeout=10) for _ in range(1)]
    assert events[0].event == "session_setup" and json.loads(events[0].data)["payload"]["session_id"] == sid

    # the node reports its listener and what ran; the admin list shows where to connect
    assert node.post(f"sessions/{sid}", {"tcp": {"phase": "session_started", "target_host": "127.0.0.1",
                                                 "target_port": 22, "listener_endpoint": "10.100.0.9:40511"}}
                     ).status_code == 200
    assert node.post(f"sessions/{sid}", {"ssh": {"command": "id -un", "exit_code": 0,
                                                 "started_at": "2026-11-25T10:00:00Z",
                                                 "completed_at": "2026-11-25T10:00:01Z"}}).status_code == 200
    listed = dp.admin.sessions(node.id)
    assert [s["listener_endpoint"] for s in listed] == ["10.100.0.9:40511"] and listed[0]["live"]
    assert [a.get("ssh", {}).get("command") for a in dp.admin.session_activity(node.id)] == [None, "id -un"]

    dp.admin.revoke_session(node.id, sid)
    assert node.get("state").json()["sessions"] == []  # an empty block: the node closes everything
    revoked = stream.events.get(timeout=10)
    assert revoked.event == "session_revoked" and json.loads(revoked.data)["payload"]["session_id"] == sid
    # Still known for the node's last word on it (how it ended), no longer live, not revocable twice.
    ended = {"ssh": {"phase": "session_ended", "terminated_by": "operator_revoke"}}
    assert node.post(f"sessions/{sid}", ended).status_code == 200
    assert [s["live"] for s in dp.admin.sessions(node.id)] == [False]
    with pytest.raises(AdminError, match="to revoke"):
        dp.admin.revoke_session(node.id, sid)
    assert node.post("sessions/ses_never", {"ssh": {"command": "late"}}).status_code == 404


def test_an_expired_session_leaves_the_block(dp):
    node = register(dp)
    session = dp.admin.create_session(node.id, "tcp", 1, host="127.0.0.1", port=5432)["session"]
    assert [s["session_id"] for s in node.get("state").json()["sessions"]] == [session["session_id"]]
    deadline = time.monotonic() + 5
    while node.get("state").json()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert node.get("state").json()["sessions"] == []
    assert [s["live"] for s in dp.admin.sessions(node.id)] == [False]


@pytest.mark.parametrize(("body", "message"), [
    ({"kind": "rdp", "ttl_seconds": 60}, "kind: must be one of ssh, tcp, k8s"),
    ({"kind": "ssh", "ttl_seconds": 60, "user": "../root"}, "user: must be a user name"),
    ({"kind": "ssh", "ttl_seconds": 60, "user": "a\u0000b"}, "user: must be a user name"),
    ({"kind": "ssh", "ttl_seconds": -5, "user": "deploy"}, "ttl_seconds: must be a number"),
    ({"kind": "ssh", "ttl_seconds": 60, "user": "deploy", "allowed_commands": "ls"}, "allowed_commands: must be"),
    ({"kind": "tcp", "ttl_seconds": 60, "port": 70000}, "port: must be an integer 1-65535"),
    ({"kind": "tcp", "ttl_seconds": 60, "host": "db\r\nx", "port": 5432},
     "host: 'db\\r\\nx' is not an IP address or host name"),
    ({"kind": "k8s", "ttl_seconds": 60, "user": "alice\r\nImpersonate-Group: system:masters"},
     "user: impersonation user 'alice\\r\\nImpersonate-Group: system:masters' has a control character"),
    ({"kind": "k8s", "ttl_seconds": 60, "user": "alice", "groups": ["dev", "x\r\ny"]},
     "groups: impersonation group 'x\\r\\ny' has a control character"),
])
def test_bad_session_requests_name_what_is_wrong(dp, body, message):
    node = register(dp)
    with pytest.raises(AdminError, match=re.escape(message)):
        dp.admin._call("POST", f"/nodes/{node.id}/sessions", body)


def test_bad_activity_reports_are_refused_with_the_reason(dp):
    node = register(dp)
    sid = dp.admin.create_session(node.id, "ssh", 60, user="deploy")["session"]["session_id"]
    for body, message in [({"ssh": {}, "tcp": {}}, "exactly one of"), ({"rdp": {}}, "exactly one of"),
                          ({"ssh": {"command": "x" * 2000}}, "at most 1024 bytes"),
                          ({"tcp": {"terminated_by": "boredom"}}, "terminated_by: must be one of"),
                          ({"tcp": {"listener_endpoint": "nowhere"}}, "must be HOST:PORT")]:
        answer = node.post(f"sessions/{sid}", body)
        assert answer.status_code == 400 and message in answer.json()["error"], (body, answer.text)


def test_the_admin_cli_mints_lists_and_revokes(dp):
    node = register(dp)
    env = {**os.environ, "PLEXD_DEVPLANE_URL": dp.url, "PLEXD_DEVPLANE_ADMIN_TOKEN": dp.admin_token}

    def admin(*args: str) -> str:
        done = subprocess.run([*CLI, "admin", *args], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = admin("session", "create", "--node", node.id, "--kind", "ssh", "--user", "deploy", "--ttl", "2s",
                "--wait", "0")
    sid = out.split()[1]
    assert sid.startswith("ses_") and "token: " in out and "has not reported the session's listener" in out
    # waiting for the node: the exact ssh command once the node reports the session's listener
    waiting = subprocess.Popen([*CLI, "admin", "session", "create", "--node", node.id, "--kind", "ssh", "--user",
                                "deploy", "--wait", "20"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(dp.admin.sessions(node.id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        second = next(s["session_id"] for s in dp.admin.sessions(node.id) if s["session_id"] != sid)
        node.post(f"sessions/{second}", {"tcp": {"phase": "session_started",
                                                 "listener_endpoint": "10.100.0.9:40511"}})
        out, _ = waiting.communicate(timeout=30)
    finally:
        waiting.kill()
    assert waiting.returncode == 0 and "ssh -p 40511 deploy@10.100.0.9" in out, out
    listing = admin("session", "list", "--node", node.id)
    assert sid in listing and second in listing and "10.100.0.9:40511" in listing
    assert f"session {sid} revoked" in admin("session", "revoke", "--node", node.id, sid)
    ended = next(line for line in admin("session", "list", "--node", node.id).splitlines() if sid in line)
    assert "revoked" in ended.split() or "expired" in ended.split(), ended  # the 2 s may be over already
    # a session id names one session: --node is looked up when not given
    assert f"session {second} revoked (node {node.id})" in admin("session", "revoke", second)
    unknown = subprocess.run([*CLI, "admin", "session", "revoke", "ses_nope"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert unknown.returncode == 1 and "no session 'ses_nope'" in unknown.stderr and "Traceback" not in unknown.stderr


def test_no_printed_command_carries_the_token_in_its_arguments():
    # `ps` shows every process's arguments to every local user: `sshpass -p TOKEN` hands the token to all of them.
    from pathlib import Path

    from plexd.devplane.admin_cli import _how_to_connect

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "sshpass -p" not in readme and 'SSHPASS="$TOKEN" sshpass -e ssh' in readme
    for kind, target in [("ssh", {"user": "deploy"}), ("k8s", {"user": "alice"})]:
        hint = _how_to_connect({"listener_endpoint": "10.100.0.9:40511", "kind": kind, "node_id": "n",
                                "target": {kind: target}})
        assert "sshpass -p" not in hint and "--token <" not in hint, hint


def test_the_demo_gives_sshpass_the_token_in_its_environment(monkeypatch, capsys):
    import secrets
    import types

    from plexd.devplane import demo

    token, calls = "tok.SECRET.sig", []

    def run(argv, **kwargs):
        calls.append((list(argv), kwargs.get("env") or {}))
        return subprocess.CompletedProcess(argv, 0, stdout="pxdemo\n" if "sshpass" in argv else "", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(secrets, "token_hex", lambda n: "")  # the demo's throw-away account: pxdemo
    node = types.SimpleNamespace(wrap=lambda cmd: ["ip", "netns", "exec", "ns", *cmd], name="n")
    lab = types.SimpleNamespace(exec=lambda n, cmd, check=True: run(n.wrap(cmd)))
    admin = types.SimpleNamespace(
        create_session=lambda *a, **k: {"session": {"session_id": "ses_1"}, "token": token},
        sessions=lambda node_id: [{"session_id": "ses_1", "listener_endpoint": "10.100.0.2:40511"}],
        revoke_session=lambda *a: None)
    a, b = (types.SimpleNamespace(node=node, node_id=f"n{i}") for i in (1, 2))
    mesh = types.SimpleNamespace(daemons=[a, b], admin=admin,
                                 run_plexd=lambda *a, **k: types.SimpleNamespace(stdout=""))
    assert demo._session_demo(lab, mesh)
    assert not [argv for argv, _ in calls if any(token in arg for arg in argv)]
    assert [env.get("SSHPASS") for argv, env in calls if "sshpass" in argv] == [token]
    assert "sshpass -p" not in capsys.readouterr().out
