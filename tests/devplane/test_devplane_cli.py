"""`plexd-devplane serve` start-up errors and the `admin` CLI, as a user runs them (real processes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from devplane_helpers import register

CLI = [sys.executable, "-m", "plexd.devplane.devplane_cli"]


def run(*args: str, stdin: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1", "127.0.0.1:99999", ":80", "example.com:80",
                                    "127.0.0.1:port"])
def test_bad_listen_is_one_line(tmp_path, listen):
    line = one_line_error(run("serve", "--listen", listen, "--db", str(tmp_path / "x.db")))
    assert line.startswith("plexd-devplane: --listen") and listen in line


def test_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line_error(run("serve", "--listen", f"127.0.0.1:{port}", "--db", str(tmp_path / "x.db")))
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line


def test_unusable_db_is_one_line(tmp_path):
    line = one_line_error(run("serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "missing" / "x.db")))
    assert "does not exist" in line
    (tmp_path / "afile").write_text("")
    line = one_line_error(run("serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "afile" / "x.db")))
    assert "afile" in line
    line = one_line_error(run("serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path)))
    assert "is a directory" in line
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a sqlite database" * 100)
    line = one_line_error(run("serve", "--listen", "127.0.0.1:0", "--db", str(garbage)))
    assert "garbage.db" in line
    line = one_line_error(run("serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "y.db"),
                              "--admin-token-file", str(tmp_path / "nope")))
    assert "--admin-token-file" in line and "No such file" in line


def test_bad_duration_flag_is_rejected(tmp_path):
    proc = run("serve", "--heartbeat-interval", "soon", "--db", str(tmp_path / "x.db"))
    assert proc.returncode == 2 and "--heartbeat-interval" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture
def admin(dp):
    token_file = dp.db_path.with_name(dp.db_path.name + ".admin-token")

    def call(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return run("admin", "--url", dp.url, "--token-file", str(token_file), *args, stdin=stdin)

    return call


def test_admin_cli_tables_and_json(dp, admin, tmp_path):
    token = admin("token", "create")
    assert token.returncode == 0 and token.stdout.strip().startswith("plx_enroll_")
    node = register(dp, hostname="cli-node")
    table = admin("nodes")
    assert table.returncode == 0
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["NODE", "HOSTNAME", "MESH", "IP"]
    assert any(node.id in r and "cli-node" in r and "online" in r for r in rows)
    as_json = json.loads(admin("--json", "nodes").stdout)
    assert any(n["id"] == node.id for n in as_json)
    assert json.loads(admin("node", "show", node.id, "--json").stdout)["hostname"] == "cli-node"
    assert "hostname: cli-node" in admin("node", "show", node.id).stdout

    policies = [{"id": "pol_all", "rules": [{"src": "*", "dst": "*", "port": 0, "protocol": "", "action": "allow"}]}]
    pfile = tmp_path / "policies.json"
    pfile.write_text(json.dumps(policies))
    assert admin("policies", "set", str(pfile)).stdout.strip() == "1 policies set"
    assert admin("policies", "set", stdin=json.dumps(policies)).returncode == 0
    assert "pol_all" in admin("policies", "show").stdout
    bad = admin("policies", "set", stdin="[{")
    assert "not valid JSON" in one_line_error(bad)
    bad = admin("policies", "set", stdin='[{"id": "p", "rules": [{"src": "*", "dst": "*", "action": "maybe"}]}]')
    assert "action" in one_line_error(bad) and "400" in bad.stderr

    assert admin("metadata", "set", node.id, "env=prod", "tier=web").returncode == 0
    assert admin("data", "set", node.id, "cfg", "--payload", '{"a": 1}').stdout.strip().endswith("version 1")
    assert admin("secret", "set", node.id, "pw", "--value", "x").stdout.strip().endswith("version 1")
    assert admin("endpoint", "set", node.id, "192.0.2.1:51820").returncode == 0
    block = {"user_access": {"enabled": True, "peers": [{"public_key": "A" * 43 + "=", "psk": "B" * 43 + "=",
                                                         "allowed_ips": ["10.100.250.5/32"]}]}}
    assert admin("bridge", "set", node.id, stdin=json.dumps(block)).stdout.strip().endswith("set (user_access)")
    shown = json.loads(admin("--json", "bridge", "show", node.id).stdout)
    assert shown["bridge"]["user_access"]["peers"][0]["psk"] == "(set)"  # never printed
    assert shown["bridge"]["user_access"]["peers"][0]["allowed_ips"] == ["10.100.250.5/32"]
    assert admin("bridge", "set", node.id, stdin="null").stdout.strip().endswith("set (none)")
    assert admin("flags", "set", node.id, "--reconcile").returncode == 0
    assert node.post("heartbeat", {}).json()["reconcile"] is True
    eid = admin("action", "request", node.id, "backup", "--param", "target=/srv", "--timeout", "30s").stdout.strip()
    assert eid.startswith("exec_")
    executions = admin("executions", "show", node.id)
    assert eid in executions.stdout and "backup" in executions.stdout
    assert admin("event", "publish", node.id, "custom", "--payload", '{"b": 1, "a": 2}').stdout.startswith("evt_")
    rotated = json.loads(admin("--json", "signing-key", "rotate", "--transition", "1h").stdout)
    assert set(rotated) == {"current", "previous", "transition_expires"}
    assert admin("faults", "set", "events_status=503", "retry_after=3").returncode == 0
    assert json.loads(admin("status", "--json").stdout)["faults"] == {"events_status": 503, "retry_after": "3"}
    assert admin("faults", "clear").returncode == 0
    node.post("drift", {"timestamp": "2025-01-15T10:31:00Z",
                        "corrections": [{"type": "peer_added", "detail": "peer n_x"}]})
    assert "peer_added: peer n_x" in admin("drift", "show", node.id).stdout
    assert admin("metrics", "show", node.id).stdout.strip() == "(none)"
    assert admin("node", "forget", node.id).returncode == 0
    assert node.id not in admin("nodes").stdout


def test_admin_cli_errors_are_one_line(dp, tmp_path):
    line = one_line_error(run("admin", "--url", dp.url, "--token-file", str(tmp_path / "none"), "nodes"))
    assert "--token-file" in line
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    line = one_line_error(run("admin", "--url", dp.url, "--token-file", str(wrong), "nodes"))
    assert "401" in line
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = one_line_error(run("admin", "--url", f"http://127.0.0.1:{port}", "--token-file", str(wrong), "nodes"))
    assert "unreachable" in line
    # ordinary mistakes that ended in tracebacks: a binary file as the token, a token that is not one ASCII line
    # (the whole file was printed into the error), a URL that is no URL, a binary policies file
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00secret-ish")
    assert "not text" in one_line_error(run("admin", "--url", dp.url, "--token-file", str(binary), "nodes"))
    lines = tmp_path / "lines"
    lines.write_text("line one\nline two tökén\n")
    line = one_line_error(run("admin", "--url", dp.url, "--token-file", str(lines), "nodes"))
    assert "printable ASCII" in line and "line two" not in line
    assert "--url" in one_line_error(run("admin", "--url", "http://[::1", "--token-file", str(wrong), "nodes"))
    assert "not UTF-8" in one_line_error(run("admin", "--url", dp.url, "--token-file", str(wrong), "policies",
                                             "set", str(binary)))


def test_serve_defaults_and_private_files(dp):
    """The documented defaults (keepalive 15 s, heartbeat 30 s), and the files holding secrets are 0600, the
    database in WAL mode."""
    import sqlite3
    import stat

    from plexd.devplane.devplane_cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.keepalive, args.heartbeat_interval, args.listen) == (15.0, 30.0, "127.0.0.1:8080")
    token_file = dp.db_path.with_name(dp.db_path.name + ".admin-token")
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.read_text().strip() == dp.admin_token
    assert stat.S_IMODE(dp.db_path.stat().st_mode) == 0o600  # node secrets and the signing key live here
    db = sqlite3.connect(f"file:{dp.db_path}?mode=ro", uri=True)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()


def test_serve_without_the_devplane_extra_names_the_extra_in_one_line(tmp_path):
    # The interpreter is made to lack the extra's modules (a finder that refuses them), as on a machine where
    # only `pip install plexd` ran: the same process otherwise, the same CLI entry point.
    blocker = (
        "import sys, importlib.abc\n"
        "class NoExtra(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('starlette', 'sse_starlette', 'uvicorn'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoExtra())\n"
        "from plexd.devplane.devplane_cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", blocker, "serve", "--listen", "127.0.0.1:0", "--db",
                           str(tmp_path / "x.db")], capture_output=True, text=True, timeout=30)
    line = one_line_error(proc)
    assert "'devplane' extra" in line and "pip install 'plexd[devplane]'" in line
