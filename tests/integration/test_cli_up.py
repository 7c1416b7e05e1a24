"""``plexd up`` as a real process (scripted control plane on loopback) and the Agent extension API in-process:
identity reuse, capabilities announcement, READY=1 to systemd, clean exit on SIGTERM/SIGINT, deregistration,
401 → re-registration, services and shutdown steps, and the systemd unit file."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from agentcore_recorder import Recorder, Reply
from waiting import scaled, wait_for

from plexd.base.clock import FakeClock
from plexd.base.wgkeys import generate_private_key
from plexd.config.settings import load as load_config
from plexd.identity.identity_store import Identity, IdentityStore
from plexd.node import agent as agent_mod
from plexd.node import assembly
from plexd.node.supervisor import FatalError

PLEXD = str(Path(sys.executable).with_name("plexd"))
SIGNING = base64.b64encode(b"\x05" * 32).decode()
NODE = "n_up1"


def save_identity(data: Path, secret: str = "S" * 32) -> Identity:
    ident = Identity(NODE, "10.100.0.9", SIGNING, secret, generate_private_key())
    IdentityStore(data).save(ident)
    return ident


def write_config(tmp_path: Path, api: str, extra: str = "") -> Path:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"api: {{url: {api}, allow_insecure: true}}\n"  # the test servers speak plain HTTP
                   f"data_dir: {tmp_path / 'data'}\ntoken: {{file: {tmp_path / 'token'}}}\n"
                   f"hooks: {{dir: {tmp_path / 'hooks'}}}\nsse: {{backoff_base: 50ms, backoff_max: 200ms}}\n"
                   f"mesh: {{backend: userspace, userspace_implementation: {NO_WG}}}\n"
                   f"node_api: {{socket_path: {tmp_path / 'api.sock'}}}\n{extra}")
    return cfg


# These tests look at the lifecycle alone: the mesh device is kept out (its converge fails, logged, and the daemon
# keeps running) and the connected-stage requests (state, events, heartbeat) are filtered out.
NO_WG = "/nonexistent/px-no-wireguard-go"
LIFECYCLE = ("/capabilities", "/deregister", "/register")


def lifecycle(rec) -> list:
    return [r for r in rec.requests if r.path.endswith(LIFECYCLE)]


@pytest.fixture
async def rec():
    async with Recorder() as server:
        yield server


@pytest.fixture
def notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    yield path, sock
    sock.close()


async def start_up(cfg: Path, notify: str | None = None, **extra: str) -> asyncio.subprocess.Process:
    env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(cfg), **extra}
    if notify:
        env["NOTIFY_SOCKET"] = notify
    return await asyncio.create_subprocess_exec(PLEXD, "up", env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def stop(proc: asyncio.subprocess.Process, sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, err.decode()


async def test_up_reuses_identity_announces_capabilities_notifies_and_stops_cleanly(tmp_path, rec, notify_socket):
    save_identity(tmp_path / "data")
    cfg = write_config(tmp_path, rec.url)
    path, sock = notify_socket
    proc = await start_up(cfg, path)
    try:
        messages: list[bytes] = []
        while b"READY=1" not in messages:
            msg = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 4096), 20)
            messages += msg.split(b"\n")
        assert messages[0] == b"STATUS=starting" and b"STATUS=registering" in messages
        # right after READY=1 the status says what the node is doing (the recorder serves no event stream)
        after = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 4096), 20)
        assert after.startswith(b"STATUS=control plane unreachable since ") and b"running from data_dir" in after
        await wait_for(lambda: any(r.method == "PUT" for r in rec.requests))
    finally:
        rc, err = await stop(proc, signal.SIGTERM)
    assert rc == 0, err
    sock.setblocking(False)
    stopping = []
    with contextlib.suppress(BlockingIOError):
        while True:
            stopping += sock.recv(4096).split(b"\n")
    assert b"STOPPING=1" in stopping and b"STATUS=stopping: deregistering" in stopping
    assert "Traceback" not in err
    methods = [(r.method, r.path) for r in lifecycle(rec)]
    assert ("POST", "/v1/register") not in methods  # the stored identity was reused
    assert methods == [("PUT", f"/v1/nodes/{NODE}/capabilities"), ("POST", f"/v1/nodes/{NODE}/deregister")]
    put = lifecycle(rec)[0]
    assert put.headers["authorization"] == "Bearer " + "S" * 32
    caps = put.json
    assert caps["binary"]["version"] and len(caps["binary"]["checksum"]) == 64
    logs = [json.loads(line) for line in err.splitlines()]  # JSON lines: stderr is not a TTY
    assert any(entry["msg"] == "received SIGTERM, shutting down" for entry in logs)


async def test_sigint_with_deregister_disabled_keeps_the_node(tmp_path, rec):
    save_identity(tmp_path / "data")
    cfg = write_config(tmp_path, rec.url, "shutdown: {deregister: false}\n")
    proc = await start_up(cfg)
    try:
        await wait_for(lambda: len(lifecycle(rec)) >= 1)
    finally:
        rc, err = await stop(proc, signal.SIGINT)
    assert rc == 0, err
    assert [r.method for r in lifecycle(rec)] == ["PUT"]


def announcements(cfg: Path) -> int:
    """Capability announcements the daemon has had answered, from `plexd status --json` (0 while it can't say)."""
    res = subprocess.run([PLEXD, "status", "--json"], env={"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(cfg)},
                         capture_output=True, text=True)
    try:
        return json.loads(res.stdout)["actions"]["hooks"]["announcements"]
    except (ValueError, KeyError, TypeError):
        return 0


async def test_up_keeps_running_while_the_control_plane_is_down(tmp_path, rec):
    """Offline start: with a stored identity, up runs and keeps retrying the announcement in the background."""
    save_identity(tmp_path / "data")
    rec.route("PUT", f"/v1/nodes/{NODE}/capabilities", Reply(503), Reply(503), Reply(200, "{}"))
    cfg = write_config(tmp_path, rec.url, "shutdown: {deregister: false}\n")
    proc = await start_up(cfg)
    try:
        await wait_for(lambda: len(lifecycle(rec)) >= 3)
        assert proc.returncode is None
        # the third PUT is recorded before it is answered: wait until the daemon read the answer
        await wait_for(lambda: announcements(cfg) >= 1, what="the announcement's answer read")
    finally:
        rc, err = await stop(proc, signal.SIGTERM)
    assert rc == 0 and "capabilities announced" in err


async def test_401_re_registers_with_the_node_secret(tmp_path, rec):
    ident = save_identity(tmp_path / "data")
    new = json.dumps({"node_id": NODE, "mesh_ip": "10.100.0.9", "signing_public_key": SIGNING,
                      "node_secret_key": "N" * 32, "peers": []})
    rec.route("PUT", f"/v1/nodes/{NODE}/capabilities", Reply(401, '{"error":"unknown node"}'), Reply(200, "{}"))
    rec.route("POST", "/v1/register", Reply(200, new))
    cfg = write_config(tmp_path, rec.url, "shutdown: {deregister: false}\n")
    proc = await start_up(cfg)
    try:
        await wait_for(lambda: len(lifecycle(rec)) >= 3)
    finally:
        rc, err = await stop(proc, signal.SIGTERM)
    assert rc == 0, err
    _, register, put2 = lifecycle(rec)[:3]
    assert (register.method, register.path) == ("POST", "/v1/register")
    assert register.headers["authorization"] == "Bearer " + "S" * 32
    assert register.json["token"] == "" and register.json["public_key"] == ident.public_key
    assert put2.headers["authorization"] == "Bearer " + "N" * 32
    assert IdentityStore(tmp_path / "data").load().identity.node_secret_key == "N" * 32


async def test_up_without_identity_or_token_fails_in_one_line(tmp_path, rec):
    cfg = write_config(tmp_path, rec.url)
    env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(cfg)}
    proc = await asyncio.create_subprocess_exec(PLEXD, "up", env=env, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    last = err.decode().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("plexd: no bootstrap token") and "Traceback" not in err.decode()


# -- the Agent extension API, in-process ----------------------------------------------------------------------------


def agent_config(tmp_path, api, **env):
    base = {"PLEXD_CONFIG": "", "PLEXD_API": api, "PLEXD_API_ALLOW_INSECURE": "true",
            "PLEXD_DATA_DIR": str(tmp_path / "data"),
            "PLEXD_HOOKS_DIR": str(tmp_path / "hooks"), "PLEXD_TOKEN_FILE": str(tmp_path / "token"),
            "PLEXD_MESH_BACKEND": "userspace", "PLEXD_MESH_USERSPACE_IMPLEMENTATION": NO_WG,
            "PLEXD_NODE_API_SOCKET_PATH": str(tmp_path / "api.sock")}
    base.update(env)
    return load_config(env=base)


async def test_services_and_shutdown_steps_run_in_lifecycle_order(tmp_path, rec, monkeypatch):
    save_identity(tmp_path / "data")
    events: list[str] = []
    stop_event = asyncio.Event()

    async def ticker(agent):
        events.append(f"ticker start {agent.identity.node_id}")
        while not await agent.sleep(1):
            events.append("tick")
            if events.count("tick") == 2:
                stop_event.set()

    def install(agent):
        node = assembly.assemble(agent)
        agent.add_service("ticker", ticker)
        agent.on_shutdown("drain", _noop_factory(events, "drain"), phase="drain")
        agent.on_shutdown("first", _noop_factory(events, "teardown first"))
        agent.on_shutdown("second", _noop_factory(events, "teardown second"))
        return node

    clock = FakeClock()

    async def tick_clock():
        while not stop_event.is_set():
            await asyncio.sleep(0.01)
            clock.advance(1)

    ticking = asyncio.create_task(tick_clock())
    rc = await asyncio.wait_for(assembly.run(agent_config(tmp_path, rec.url), clock=clock, stop_event=stop_event,
                                             assemble=install), 20)
    await ticking
    assert rc == 0
    assert events[0] == f"ticker start {NODE}" and events.count("tick") == 2
    assert events[-3:] == ["drain", "teardown second", "teardown first"]
    assert [r.method for r in lifecycle(rec)][-1] == "POST"  # deregister after drain, before teardown
    assert lifecycle(rec)[-1].path == f"/v1/nodes/{NODE}/deregister"


def _noop_factory(events, name):
    async def run(agent):
        events.append(name)
    return run


async def test_a_crashing_service_is_restarted_and_the_agent_keeps_running(tmp_path, rec, caplog):
    """Supervision (it used to stop the agent): the crash is logged once with its traceback, the service comes
    back after a backoff, the restart is counted, and the other services never stopped."""
    save_identity(tmp_path / "data")
    runs = []
    stop_event = asyncio.Event()

    async def broken(agent):
        runs.append(agent.clock.monotonic())
        if len(runs) == 1:
            raise RuntimeError("bug in a service")
        stop_event.set()

    def install(agent):
        node = assembly.assemble(agent)
        agent.add_service("broken", broken)
        return node

    config = agent_config(tmp_path, rec.url)
    task = asyncio.create_task(assembly.run(config, stop_event=stop_event, assemble=install))
    rc = await asyncio.wait_for(task, 20)
    assert rc == 0 and len(runs) == 2
    # A backoff (1 s ±25 %) before the restart: at least its shortest; no upper bound, which a loaded machine
    # would break (a run under stress-ng restarted it 1.52 s after the crash)
    assert runs[1] - runs[0] >= 0.7  # (asyncio may wake a timer a hair early)
    crashes = [r for r in caplog.records if "service broken crashed" in r.getMessage()]
    assert len(crashes) == 1 and crashes[0].exc_info is not None  # once, with its traceback
    assert "RuntimeError: bug in a service" in caplog.text


async def test_a_fatal_error_stops_the_agent_with_status_1_and_one_line(tmp_path, rec, caplog):
    save_identity(tmp_path / "data")

    async def hopeless(agent):
        raise FatalError("identity refused and no bootstrap token to register afresh")

    def install(agent):
        node = assembly.assemble(agent)
        agent.add_service("hopeless", hopeless)
        return node

    rc = await asyncio.wait_for(assembly.run(agent_config(tmp_path, rec.url), assemble=install), 20)
    assert rc == 1 and "identity refused and no bootstrap token" in caplog.text
    assert "Traceback" not in caplog.text
    assert all(r.path != f"/v1/nodes/{NODE}/deregister" for r in rec.requests)


async def test_stop_during_registration_exits_quietly(tmp_path):
    (tmp_path / "token").write_text("tok")
    stop_event = asyncio.Event()
    config = agent_config(tmp_path, "http://127.0.0.1:9")
    task = asyncio.create_task(assembly.run(config, stop_event=stop_event))
    await asyncio.sleep(0.3)  # registration is retrying against a closed port
    stop_event.set()
    assert await asyncio.wait_for(task, 10) == 0
    assert (tmp_path / "token").exists()


async def test_authed_shares_one_reauthentication(tmp_path, rec):
    ident = save_identity(tmp_path / "data")
    new = json.dumps({"node_id": NODE, "mesh_ip": "10.100.0.9", "signing_public_key": SIGNING,
                      "node_secret_key": "R" * 32, "peers": []})
    rec.route("POST", "/v1/register", Reply(200, new))

    def handler(req):
        ok = req.headers.get("authorization") == "Bearer " + "R" * 32
        return Reply(200 if ok else 401, "{}")

    rec.handler = handler
    config = agent_config(tmp_path, rec.url)
    async with agent_mod.Agent(config) as agent:
        agent.identity = ident
        agent.client.set_token(ident.node_secret_key)
        await asyncio.gather(*(agent.authed(agent.client.ping) for _ in range(5)))
    registrations = [r for r in rec.requests if r.path == "/v1/register"]
    assert len(registrations) == 1 and agent.identity.node_secret_key == "R" * 32


async def test_watchdog_pings_stop_when_the_event_loop_is_wedged(tmp_path, rec, notify_socket):
    """WatchdogSec=300ms: WATCHDOG=1 every 100 ms while the loop turns. The test fault wedges the loop from inside
    the heartbeat service (a bug that never yields); the pings stop, so systemd would restart plexd."""
    save_identity(tmp_path / "data")
    # killed at the end, so no teardown runs: no firewall table may be made in the root namespace
    cfg = write_config(tmp_path, rec.url, "policy: {enabled: false}\n")
    path, sock = notify_socket
    proc = await start_up(cfg, path, WATCHDOG_USEC="300000", PLEXD_TEST_FAULTS="wedge:heartbeat",
                          PLEXD_TEST_FAULT_AFTER="3")
    loop = asyncio.get_running_loop()
    pings: list[float] = []
    deadline = loop.time() + scaled(30)  # start-up on a loaded machine, then 3 s of pings, then the wedge
    silence = 2.0  # twenty ping intervals without one: the pings stopped
    stopped = False
    try:
        while loop.time() < deadline:
            wait = min(silence if pings else deadline - loop.time(), deadline - loop.time())
            try:
                msg = await asyncio.wait_for(loop.sock_recv(sock, 4096), wait)
            except TimeoutError:
                stopped = bool(pings)
                if stopped:
                    break
                continue
            if b"WATCHDOG=1" in msg.split(b"\n"):
                pings.append(loop.time())
    finally:
        proc.kill()
        _, err = await proc.communicate()
    assert len(pings) >= 10, pings  # about 3 s of pings before the wedge
    assert stopped, "WATCHDOG=1 went on while the event loop was wedged"
    assert "test fault: service heartbeat wedges the event loop" in err.decode()


async def test_watchdog_pings_while_registration_waits_for_the_control_plane(tmp_path, notify_socket):
    """systemd arms WatchdogSec at the start, not at READY=1: a first registration that waits for an unreachable
    control plane must ping, or systemd kills plexd over and over (the systemd tier saw a slow start killed)."""
    (tmp_path / "token").write_text("tok")
    cfg = write_config(tmp_path, "http://127.0.0.1:9")  # nothing listens: registration retries
    path, sock = notify_socket
    proc = await start_up(cfg, path, WATCHDOG_USEC="300000")
    loop = asyncio.get_running_loop()
    pings, ready = 0, False
    deadline = loop.time() + scaled(20)
    try:
        while pings < 10 and loop.time() < deadline:
            try:
                msg = await asyncio.wait_for(loop.sock_recv(sock, 4096), deadline - loop.time())
            except TimeoutError:
                break
            lines = msg.split(b"\n")
            pings += b"WATCHDOG=1" in lines
            ready |= b"READY=1" in lines
    finally:
        rc, err = await stop(proc, signal.SIGTERM)
    assert pings >= 10 and not ready, (pings, ready, err[-2000:])
    assert rc == 0 and (tmp_path / "token").exists()  # still unregistered, its token kept


async def test_sighup_applies_what_can_change_live_and_names_what_needs_a_restart(tmp_path, rec):
    save_identity(tmp_path / "data")
    cfg = write_config(tmp_path, rec.url, "shutdown: {deregister: false}\n")
    proc = await start_up(cfg)
    try:
        await wait_for(lambda: any(r.method == "PUT" for r in rec.requests))
        cfg.write_text(cfg.read_text().replace("shutdown: {deregister: false}\n",
                                               "shutdown: {deregister: true}\nheartbeat: {interval: 7s}\n"))
        proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(1)
    finally:
        rc, err = await stop(proc, signal.SIGTERM)
    assert rc == 0, err
    reloaded = [json.loads(line) for line in err.splitlines() if '"config reloaded' in line]
    assert len(reloaded) == 1, err
    assert reloaded[0]["applied"] == ["shutdown.deregister"]
    assert reloaded[0]["restart_needed"] == ["heartbeat.interval"]
    # shutdown.deregister changed live: this stop deregisters
    assert [r.path for r in lifecycle(rec)][-1] == f"/v1/nodes/{NODE}/deregister"


async def test_the_stop_ends_within_its_budget_with_a_stuck_hook_and_a_silent_control_plane(tmp_path):
    """The worst stop: a hook that ignores SIGTERM and runs for minutes, and a control plane that takes the
    deregistration and never answers. The stop budget (34 s; systemd's TimeoutStopSec is 40 s) shares itself out:
    the drain is cut short, the hook is cancelled (its group killed), the POST is abandoned, the interface goes."""

    async def silent_on_deregister(req):
        if req.path.endswith("/deregister"):
            await asyncio.sleep(3600)
        return Reply()

    async with Recorder(silent_on_deregister) as rec:
        save_identity(tmp_path / "data")
        hooks = tmp_path / "hooks"
        hooks.mkdir()
        hook = hooks / "stuck"
        hook.write_text("#!/bin/sh\ntrap '' TERM\nsleep 297\n")
        hook.chmod(0o755)
        cfg = write_config(tmp_path, rec.url)  # shutdown: deregister true, drain 30s (the defaults)
        proc = await start_up(cfg)
        env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(cfg)}
        run = None
        try:
            await wait_for(lambda: (tmp_path / "api.sock").exists())
            run = await asyncio.create_subprocess_exec(PLEXD, "actions", "run", "stuck", "--local", env=env,
                                                       stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE)
            await wait_for(lambda: subprocess.run(["pgrep", "-f", "sleep 297"], capture_output=True).returncode == 0)
            loop = asyncio.get_running_loop()
            started = loop.time()
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 38)
            took = loop.time() - started
            hook_gone = subprocess.run(["pgrep", "-f", "sleep 297"], capture_output=True).returncode == 1
            out, _ = await asyncio.wait_for(run.communicate(), 10)
        finally:
            for p in (proc, run):  # whatever failed, nothing outlives the test
                if p is not None and p.returncode is None:
                    p.kill()
                    await p.wait()
            subprocess.run(["pkill", "-f", "sleep 297"], check=False)
        print(f"stop took {took:.1f}s")
        assert proc.returncode == 0, err.decode()[-3000:]
        log = err.decode()
        assert "could not deregister" in log and "no answer within" in log, \
            [line for line in log.splitlines() if "stop" in line or "deregist" in line or "cancel" in line]
        assert run.returncode == 125, out  # cancelled
        assert hook_gone  # the hook's process group was killed before plexd exited
