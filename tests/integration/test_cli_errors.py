"""Bad input through the real ``plexd`` executable: one clear line on stderr, non-zero exit, no traceback, and
nothing half-written left behind. The control plane is a scripted recording server on loopback."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from pathlib import Path

import pytest
from agentcore_recorder import Recorder, Reply

PLEXD = str(Path(sys.executable).with_name("plexd"))
SIGNING = base64.b64encode(b"\x05" * 32).decode()
OK = json.dumps({"node_id": "n_1", "mesh_ip": "10.100.0.2", "signing_public_key": SIGNING,
                 "node_secret_key": "S" * 32, "peers": []})


class Env:
    def __init__(self, tmp_path: Path, api: str = "http://127.0.0.1:9") -> None:
        self.tmp = tmp_path
        self.data = tmp_path / "data"
        self.token = tmp_path / "bootstrap-token"
        self.config = tmp_path / "config.yaml"
        self.api = api
        self.write_config()

    def write_config(self, extra: str = "") -> None:
        self.config.write_text(
            f"api: {{url: {self.api}, allow_insecure: true}}\ndata_dir: {self.data}\ntoken: {{file: {self.token}}}\n"
            f"hooks: {{dir: {self.tmp / 'hooks'}}}\nregistration: {{hostname: node-a, max_wait: 2s}}\n"
            f"node_api: {{socket_path: {self.tmp / 'api.sock'}}}\n{extra}")

    async def run(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        full_env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(self.config)}
        full_env.update(env or {})
        proc = await asyncio.create_subprocess_exec(
            PLEXD, *args, env=full_env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode(), err.decode()

    def data_files(self) -> list[str]:
        return sorted(p.name for p in self.data.iterdir()) if self.data.exists() else []


def assert_one_line_error(rc: int, err: str, *fragments: str) -> None:
    assert rc != 0, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("plexd: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
async def rec():
    async with Recorder() as server:
        yield server


async def test_unknown_config_key(tmp_path):
    env = Env(tmp_path)
    env.write_config("mesh: {listen_prot: 5}\n")
    rc, _, err = await env.run("join")
    assert_one_line_error(rc, err, "unknown config key 'mesh.listen_prot'", "did you mean 'mesh.listen_port'?",
                          str(env.config))


async def test_wrong_type_and_bad_duration(tmp_path):
    env = Env(tmp_path)
    env.write_config("mesh: {mtu: big}\n")
    rc, _, err = await env.run("status")
    assert_one_line_error(rc, err, "mesh.mtu: 'big'", "not a whole number")
    env.write_config("heartbeat: {interval: 30 seconds}\n")
    rc, _, err = await env.run("up")
    assert_one_line_error(rc, err, "heartbeat.interval: '30 seconds'", "not a valid duration")
    env.write_config()
    rc, _, err = await env.run("status", env={"PLEXD_SSE_IDLE_TIMEOUT": "1x"})
    assert_one_line_error(rc, err, "env PLEXD_SSE_IDLE_TIMEOUT")


async def test_unreadable_token_file(tmp_path, rec):
    env = Env(tmp_path, rec.url)
    (tmp_path / "tokdir").mkdir()
    rc, _, err = await env.run("join", "--token-file", str(tmp_path / "tokdir"))
    assert_one_line_error(rc, err, f"cannot read bootstrap token file {tmp_path / 'tokdir'}", "errno 21")
    assert rec.requests == [] and env.data_files() == []


@pytest.mark.parametrize("content,fragment", [
    (b"plx_\x01token", "non-printable"),
    (b"a" * 600, "600 bytes long; the limit is 512"),
])
async def test_bad_token_content(tmp_path, rec, content, fragment):
    env = Env(tmp_path, rec.url)
    env.token.write_bytes(content)
    rc, _, err = await env.run("join")
    assert_one_line_error(rc, err, fragment, str(env.token))
    assert rec.requests == [] and env.token.exists() and env.data_files() == []


async def test_bad_token_from_env(tmp_path, rec):
    env = Env(tmp_path, rec.url)
    rc, _, err = await env.run("join", "--token-env", "MY_TOKEN", env={"MY_TOKEN": "bad\ttoken"})
    assert_one_line_error(rc, err, "environment variable MY_TOKEN", "non-printable")


async def test_control_plane_unreachable(tmp_path):
    env = Env(tmp_path, "http://127.0.0.1:9")
    env.token.write_text("tok")
    rc, _, err = await env.run("join")
    # join says at once that it cannot get through and when it tries again (one line per attempt, not a TTY),
    # then gives up with one line
    *progress, last = err.splitlines()
    assert progress and all(line.startswith("cannot reach the control plane at http://127.0.0.1:9 (attempt ")
                            and "retrying in 1s" in line for line in progress), err
    assert_one_line_error(rc, last, "http://127.0.0.1:9", "POST /v1/register", "cannot connect", "within 2s")
    assert env.token.read_text() == "tok" and "identity.json" not in env.data_files()


@pytest.mark.parametrize("status,fragment", [
    (400, "rejected the registration request as malformed (HTTP 400)"),
    (401, "bootstrap token refused (HTTP 401)"),
    (403, "registration forbidden (HTTP 403)"),
    (404, "/v1/register does not exist (HTTP 404)"),
    (409, "a node named 'node-a' is already registered (HTTP 409)"),
])
async def test_registration_refusals(tmp_path, rec, status, fragment):
    rec.route("POST", "/v1/register", Reply(status, '{"error":"why not"}'))
    env = Env(tmp_path, rec.url)
    env.token.write_text("tok")
    rc, _, err = await env.run("join")
    assert_one_line_error(rc, err, fragment, "why not")
    assert len(rec.requests) == 1
    assert env.token.exists() and env.data_files() == []


async def test_corrupt_identity_without_token(tmp_path, rec):
    env = Env(tmp_path, rec.url)
    env.data.mkdir(mode=0o700)
    (env.data / "identity.json").write_text('{"node_id": "n_1", "mesh_')
    rc, out, _ = await env.run("status")
    assert rc == 0 and "stored identity unusable: identity.json: not valid JSON" in out
    rc, _, err = await env.run("join")
    assert_one_line_error(rc, err, "unusable (identity.json: not valid JSON", "no bootstrap token")
    assert rec.requests == []


async def test_corrupt_identity_with_token_registers_afresh(tmp_path, rec):
    rec.route("POST", "/v1/register", Reply(201, OK))
    env = Env(tmp_path, rec.url)
    env.data.mkdir(mode=0o700)
    (env.data / "identity.json").write_text("{}")
    env.token.write_text("tok")
    rc, out, err = await env.run("join")
    assert rc == 0, err
    assert "stored identity was unusable (identity.json: node_id is missing or empty); registered afresh" in out
    assert "registered as node n_1" in out


async def test_data_dir_not_writable(tmp_path, rec):
    env = Env(tmp_path, rec.url)
    (tmp_path / "file").write_text("")
    env.data = tmp_path / "file" / "data"
    env.write_config()
    env.token.write_text("tok")
    rc, _, err = await env.run("join")
    assert_one_line_error(rc, err, f"data_dir {env.data} is not writable", "errno 20")
    assert rec.requests == [] and env.token.exists()  # the single-use token was not spent
    rc, _, err = await env.run("up")
    assert_one_line_error(rc, err, "is not writable")


async def test_read_only_data_dir_mount(tmp_path, rec):
    """A read-only filesystem (EROFS) is refused even for root, who ignores permission bits."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = await asyncio.create_subprocess_exec("mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro),
                                                 stderr=asyncio.subprocess.PIPE)
    _, merr = await mount.communicate()
    if mount.returncode != 0:
        pytest.fail(f"cannot mount a read-only tmpfs here: {merr.decode().strip()}")
    try:
        env = Env(tmp_path, rec.url)
        env.data = ro
        env.write_config()
        env.token.write_text("tok")
        rc, _, err = await env.run("join")
        assert_one_line_error(rc, err, f"data_dir {ro} is not writable", "Read-only file system")
        assert rec.requests == []
    finally:
        umount = await asyncio.create_subprocess_exec("umount", str(ro))
        await umount.wait()


@pytest.fixture
async def read_only_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = await asyncio.create_subprocess_exec("mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0700", "tmpfs",
                                                 str(ro), stderr=asyncio.subprocess.PIPE)
    _, merr = await mount.communicate()
    if mount.returncode != 0:
        pytest.fail(f"cannot mount a read-only tmpfs here: {merr.decode().strip()}")
    try:
        yield ro
    finally:
        umount = await asyncio.create_subprocess_exec("umount", "-l", str(ro))
        await umount.wait()


@pytest.fixture
async def up_on_read_only(tmp_path, rec, read_only_dir):
    """`plexd up` started with its data_dir on the read-only mount (and a bootstrap token); killed at the end."""
    env = Env(tmp_path, rec.url)
    env.data = read_only_dir
    env.write_config()
    env.token.write_text("tok")
    proc = await asyncio.create_subprocess_exec(
        PLEXD, "up", env={"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(env.config)},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        yield env, proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def until_line(proc: asyncio.subprocess.Process, fragment: str, seconds: float = 30) -> str:
    async with asyncio.timeout(seconds):
        while line := (await proc.stderr.readline()).decode():
            if fragment in line:
                return line
    raise AssertionError(f"plexd up ended without logging {fragment!r}")


async def test_up_waits_out_a_read_only_data_dir_and_goes_on_once_it_is_writable(rec, read_only_dir,
                                                                                  up_on_read_only):
    """A file system remounted read-only (or full) heals without anyone touching plexd: `plexd up` waits for it
    instead of exiting into systemd's restart loop, whose start limit would leave it down for good. Once the mount
    is writable it goes on: here to register, which the control plane refuses, so no interface is made."""
    rec.route("POST", "/v1/register", Reply(401, '{"error": "token refused"}'))
    env, proc = up_on_read_only
    line = await until_line(proc, "is not writable")
    assert "Read-only file system, errno 30): waiting for it" in line
    await asyncio.sleep(2.5)  # a few tries of data_dir go by: still waiting, nothing sent, the token kept
    assert proc.returncode is None and rec.requests == [] and env.token.exists()
    remount = await asyncio.create_subprocess_exec("mount", "-o", "remount,rw", str(read_only_dir))
    assert await remount.wait() == 0
    assert "is writable again" in await until_line(proc, "writable again")
    async with asyncio.timeout(30):
        rc = await proc.wait()
    assert rc != 0 and [r.path for r in rec.requests] == ["/v1/register"]


async def test_up_stopped_while_it_waits_for_data_dir_exits_cleanly(rec, up_on_read_only):
    env, proc = up_on_read_only
    await until_line(proc, "is not writable")
    proc.terminate()
    async with asyncio.timeout(10):
        assert await proc.wait() == 0
    assert rec.requests == [] and env.token.exists()


async def test_no_api_configured(tmp_path):
    env = Env(tmp_path)
    env.config.write_text(f"data_dir: {env.data}\n")
    rc, _, err = await env.run("join")
    assert_one_line_error(rc, err, "no control plane configured", "--api")


async def test_missing_config_file_named_by_env(tmp_path):
    env = Env(tmp_path)
    rc, _, err = await env.run("status", env={"PLEXD_CONFIG": str(tmp_path / "nope.yaml")})
    assert_one_line_error(rc, err, "nope.yaml does not exist")


async def test_usage_error_exit_code(tmp_path):
    env = Env(tmp_path)
    rc, _, err = await env.run("join", "--token-file", "a", "--token-env", "B")
    assert rc == 2 and "not allowed with argument" in err and "Traceback" not in err


@pytest.mark.parametrize(("args", "ending"), [
    (("policies",), "policies are applied by the daemon ('plexd up')"),
    (("reconcile", "hold", "--for", "1m"), "there is nothing to hold or release"),
    (("reconcile", "release"), "there is nothing to hold or release"),
])
async def test_commands_that_need_the_daemon_say_none_is_running(tmp_path, args, ending):
    env = Env(tmp_path)
    rc, out, err = await env.run(*args)
    sock = tmp_path / "api.sock"
    assert rc != 0 and out == "" and "Traceback" not in err
    assert err.strip() == f"plexd: no plexd daemon is running (nothing listens on {sock}): {ending}"


@pytest.mark.root  # hooks must be root-owned
async def test_actions_and_hooks_without_a_daemon(tmp_path):
    env = Env(tmp_path)
    rc, out, err = await env.run("actions", "run", "system.info", "--local")
    assert_one_line_error(rc, err, "no plexd daemon is running", "local actions run in the daemon")
    rc, out, err = await env.run("actions", "run", "system.info", "--local", "--param", "novalue")
    assert_one_line_error(rc, err, "--param 'novalue': expected NAME=VALUE")
    rc, out, err = await env.run("actions", "run", "system.info")
    assert rc == 2 and "--local" in err  # the only way to run from here, said by argparse
    rc, out, err = await env.run("hooks", "verify")
    assert_one_line_error(rc, err, "hooks are watched by the daemon")

    # hooks list scans the directory itself, refusals and their reasons included
    hooks = tmp_path / "hooks"
    hooks.mkdir(mode=0o755)
    for name, mode in (("good.sh", 0o755), ("loose.sh", 0o777)):
        (hooks / name).write_text("#!/bin/sh\n")
        (hooks / name).chmod(mode)
    rc, out, err = await env.run("hooks", "list", "--json")
    doc = json.loads(out)
    assert rc == 0 and [h["name"] for h in doc["hooks"]] == ["good.sh"]
    assert doc["refused"][0]["name"] == "loose.sh" and "writable by group or other" in doc["refused"][0]["reason"]
    rc, out, err = await env.run("hooks", "list")
    assert "loose.sh" in out and "REFUSED" in out
