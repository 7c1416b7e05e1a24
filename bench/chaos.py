"""Chaos: one connected node under a running workload, one fault per trial at a random moment, promises checked.

Run as root: `.venv/bin/python -m bench chaos --trials 200 [--faults plexd_kill,cp_500,...] [--seed N]`.

The node is a real `plexd up` in a lab namespace (real wireguard-go, nftables) against the real devplane, with its
data_dir on a small tmpfs of its own. The workload runs all along: a simulated peer registers (and the oldest is
forgotten) every second, the policy changes every 10 s, an action (a hook that records its runs) is requested
every 2 s and a node-API report is written every second. Each trial waits a random 0.5-3 s, injects one fault,
holds it, heals it, pauses the workload and then checks:

  * converged: within `--recover` seconds of the heal (default 10) the daemon answers, its event stream is
    connected, a reconcile that ended after the heal succeeded, the device holds exactly the control plane's peers
    and the firewall is enforced (recovery time = the first moment all of that held);
  * actions: no hook ran twice, and every action the node accepted has exactly one result at the control plane;
  * drift and reports: no drift record arrived twice, and the last report written per key is the one the control
    plane holds;
  * identity: the node id did not change (nothing re-registered), identity.json parses, and no file in data_dir
    had to be moved aside as unreadable (the journals, the outbox, the event ledger open without repair);
  * secrets: neither the node secret, the private key, the bootstrap token nor a secret value is in any log.

The clock faults (clock_ahead, clock_behind) step plexd's own wall clock by an hour with libfaketime, preloaded into
plexd alone (its monotonic clock is left alone, as NTP's step leaves it; its children inherit the offset); without
libfaketime they are left out. plexd_kill_at kills plexd at a named point rather than a random moment: it starts
plexd again with the next of KILL_POINTS armed (plexd/base/failpoint.py) and lets it reach it.

It prints one line per trial and a table per fault: trials, failures, recovery p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plexd.base.errors import PlexdError
from plexd.base.failpoint import ENV as FAILPOINTS_ENV
from plexd.base.procstat import process_stat
from plexd.devplane.harness import Devplane
from plexd.devplane.lab import Lab, LabNode
from plexd.identity import node_secret
from plexd.node.control import STATUS_PATH
from plexd.node.control_client import DaemonNotRunning, call

PLEXD = str(Path(sys.executable).with_name("plexd"))
RESTART_SEC = 5.0  # the unit's RestartSec
SETTLE = 20.0  # seconds after convergence for late reports and results to arrive before a trial counts them missing
SECRET_VALUE = "chaos-secret-value-7f3a9c"  # set as a node secret: must never appear in a log
# libfaketime (Debian's libfaketime), preloaded into plexd alone so the clock faults can step its wall clock
FAKETIME = next(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"), None)
POLICIES = [
    [{"id": "allow-all", "rules": [{"src": "*", "dst": "*", "ports": [], "protocol": "", "action": "allow"}]}],
    [{"id": "allow-ssh", "rules": [{"src": "*", "dst": "*", "ports": [22], "protocol": "tcp", "action": "allow"},
                                   {"src": "*", "dst": "*", "ports": [], "protocol": "icmp", "action": "allow"}]}],
]


def load_factor() -> float:
    return max(1.0, float(os.environ.get("PLEXD_TEST_LOAD_FACTOR", "1")))


# -- the node under test ----------------------------------------------------------------------------------------


# A bench's knobs for plexd: tracemalloc snapshots, Python's and glibc's allocators, the collector's full-collection
# period
PASSED_ON = ("PLEXD_BENCH_TRACEMALLOC", "PYTHONMALLOC", "PLEXD_TEST_GC_", "MALLOC_ARENA_MAX")


@dataclass
class Rig:
    lab: Lab
    node: LabNode
    dp: Devplane
    workdir: Path
    proc: subprocess.Popen | None = None
    node_id: str = ""
    token: str = ""  # the bootstrap token (plexd removes its file once registered)
    signalled: int | None = None  # the wireguard-go a fault signalled last
    # What a by-hand fault's own command saw right after it (plexd may repair it before anyone else looks)
    gone_right_after: bool = False
    logs: list[Path] = field(default_factory=list)
    kills_at: int = 0  # plexd_kill_at faults so far: each takes the next of KILL_POINTS
    killed_at: Path | None = None  # the log of the run plexd_kill_at armed last
    steppable_clock: bool = True  # plexd runs under libfaketime (the clock faults); the soak's does not

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def api_socket(self) -> str:
        return str(self.workdir / "api.sock")

    @property
    def runs_file(self) -> Path:
        return self.workdir / "runs"

    @property
    def clock_file(self) -> Path:
        """plexd's wall-clock offset, as libfaketime reads it ("+0", "+1h", "-1h"): the clock faults write it."""
        return self.workdir / "clock-offset"

    def start_daemon(self, failpoint: str = "") -> None:
        """plexd up; `failpoint`: armed in this run alone (plexd/base/failpoint.py)."""
        log = self.workdir / f"plexd-{len(self.logs) + 1}.log"
        self.logs.append(log)
        env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(self.workdir / "config.yaml"),
               "PLEXD_TEST_NO_SYSTEMD": "1", "PYTHONFAULTHANDLER": "1",
               **{k: v for k, v in os.environ.items() if k.startswith(PASSED_ON)}}
        if failpoint:
            env[FAILPOINTS_ENV] = failpoint
        if FAKETIME is not None and self.steppable_clock:  # plexd's own wall clock (monotonic time is left alone)
            if not self.clock_file.exists():
                self.clock_file.write_text("+0\n")
            env.update(LD_PRELOAD=str(FAKETIME), FAKETIME_TIMESTAMP_FILE=str(self.clock_file),
                       FAKETIME_DONT_FAKE_MONOTONIC="1", FAKETIME_CACHE_DURATION="1")
        # PLEXD_BENCH_TRACEMALLOC=/path/out.snap: plexd under tracemalloc (bench/_traced_daemon.py; SIGUSR1 snapshots)
        daemon = ([sys.executable, str(Path(__file__).with_name("_traced_daemon.py"))]
                  if env.get("PLEXD_BENCH_TRACEMALLOC") else [PLEXD, "up"])
        with open(log, "w") as out:
            self.proc = self.lab.spawn(self.node.wrap(daemon), env=env, stdout=out, stderr=subprocess.STDOUT)

    def kill_daemon(self) -> None:
        """SIGKILL of plexd alone (its wireguard-go lives on, as under systemd's KillMode=mixed)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop_daemon(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def status(self) -> dict | None:
        try:
            return call(self.api_socket, "GET", STATUS_PATH, timeout=5)
        except (DaemonNotRunning, OSError, PlexdError):
            return None

    def wireguard_go(self) -> int | None:
        """The node's wireguard-go, found by its network namespace."""
        want = os.stat(f"/run/netns/{self.node.netns}").st_ino
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if b"wireguard-go" in (entry / "cmdline").read_bytes() and os.stat(entry / "ns/net").st_ino == want:
                    return int(entry.name)
            except OSError:
                continue
        return None

    def secrets(self) -> list[str]:
        """What must never be in a log: the secret value, the bootstrap token, the node secret and the bearer
        derived from it, the private key."""
        def read(name: str) -> str:
            try:
                return (self.data_dir / name).read_text().strip()
            except OSError:
                return ""

        secret = read("node_secret_key")
        found = [SECRET_VALUE, self.token, secret, read("private_key")]
        if secret:
            found.append(node_secret.bearer(secret, read("node_secret_kdf")))
        return [s for s in found if len(s) >= 16]


@contextlib.contextmanager
def rig(reconcile: str = "5s", heartbeat: str = "5s", data_size: str = "32m",
        steppable_clock: bool = True) -> Iterator[Rig]:
    """The node under test, registered. `data_size`: its data_dir's tmpfs."""
    lab = Lab().up(1)
    workdir = Path(tempfile.mkdtemp(prefix="plexd-chaos-"))
    dp = None
    r = None
    mounted = False
    try:
        (workdir / "data").mkdir()
        # a data_dir of its own, small, so that "disk full" and "read-only" hit the node's files alone
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={data_size},mode=0700", "tmpfs", str(workdir / "data")],
                       check=True)
        mounted = True
        dp = Devplane(workdir / "dp", listen=f"{lab.bridge_address}:0", heartbeat_interval="1h")
        dp.start()
        (workdir / "token").write_text(dp.admin.create_token())
        hooks = workdir / "hooks"
        hooks.mkdir()
        (hooks / "chaos.sh").write_text(f'#!/bin/sh\necho "$PLEXD_EXECUTION_ID" >> {workdir / "runs"}\nsleep 1\n')
        (hooks / "chaos.sh").chmod(0o755)
        (hooks / "chaos.sh.json").write_text(json.dumps({"description": "records its runs", "timeout": "30s"}))
        (workdir / "config.yaml").write_text(
            f"api: {{url: {dp.url}, allow_insecure: true}}\n"
            f"data_dir: {workdir / 'data'}\ntoken: {{file: {workdir / 'token'}}}\n"
            f"hooks: {{dir: {hooks}}}\nmesh: {{interface: plexd0, backend: userspace}}\n"
            f"reconcile: {{interval: {reconcile}}}\nheartbeat: {{interval: {heartbeat}}}\n"
            "shutdown: {deregister: false}\n"
            f"node_api: {{socket_path: {workdir / 'api.sock'}}}\nlog_level: info\n")
        r = Rig(lab, lab.nodes[0], dp, workdir, token=(workdir / "token").read_text().strip(),
                steppable_clock=steppable_clock)
        r.start_daemon()
        deadline = time.monotonic() + 60 * load_factor()
        while not (workdir / "data" / "identity.json").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"plexd did not register; see {r.logs[-1]}")
            time.sleep(0.2)
        time.sleep(0.5)
        r.node_id = json.loads((workdir / "data" / "identity.json").read_text())["node_id"]
        dp.admin.set_secret(r.node_id, "chaos", SECRET_VALUE)
        yield r
    finally:
        if r is not None:
            r.stop_daemon()
        if dp is not None:
            dp.kill()
        lab.down()
        if mounted:
            subprocess.run(["umount", "-l", str(workdir / "data")], check=False)
        if os.environ.get("PLEXD_BENCH_KEEP"):
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# -- the workload ------------------------------------------------------------------------------------------------


class Workload:
    """What runs while faults arrive. `requested`: execution ids asked for; `reports`: the last payload written per
    key that the node accepted."""

    def __init__(self, r: Rig) -> None:
        self.r = r
        self.running = asyncio.Event()
        self.requested: list[str] = []
        self.reports: dict[str, dict] = {}
        self.attempted: dict[str, dict] = {}
        self.peers: list[str] = []
        self.tick = 0
        self.done: Counter[str] = Counter()  # steps that went through, and those a fault (or a bug) stopped
        self.failed: Counter[str] = Counter()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.r.dp.url, timeout=10) as client:
            while True:
                await self.running.wait()
                self.tick += 1
                for step in (self._peer, self._report, self._action, self._policy):
                    try:
                        if await step(client):
                            self.done[step.__name__.lstrip("_")] += 1
                    except Exception as e:  # a fault in progress (DaemonNotRunning, a refused admin call, ...)
                        self.failed[f"{step.__name__}: {type(e).__name__}: {str(e)[:100]}"] += 1
                await asyncio.sleep(1)

    async def _peer(self, client: httpx.AsyncClient) -> bool:
        admin = self.r.dp.admin
        token = await asyncio.to_thread(admin.create_token)
        body = {"token": token, "public_key": base64.b64encode(os.urandom(32)).decode(),
                "hostname": f"sim-{self.tick}"}
        resp = await client.post("/v1/register", json=body, headers={"Authorization": f"Bearer {token}"})
        resp.raise_for_status()
        self.peers.append(resp.json()["node_id"])
        while len(self.peers) > 10:
            await asyncio.to_thread(admin.forget_node, self.peers.pop(0))
        return True

    async def _report(self, client: httpx.AsyncClient) -> bool:
        key = f"k{self.tick % 3}"
        payload = {"tick": self.tick}
        self.attempted[key] = payload  # the node may take a write whose answer a fault then lost
        await asyncio.to_thread(call, self.r.api_socket, "PUT", f"/v1/state/report/{key}",
                                {"content_type": "application/json", "payload": payload}, timeout=5)
        self.reports[key] = payload
        return True

    async def _action(self, client: httpx.AsyncClient) -> bool:
        if self.tick % 2:
            return False
        self.requested.append(await asyncio.to_thread(self.r.dp.admin.request_action, self.r.node_id, "chaos.sh"))
        return True

    async def _policy(self, client: httpx.AsyncClient) -> bool:
        if self.tick % 10:
            return False
        await asyncio.to_thread(self.r.dp.admin.set_policies, POLICIES[self.tick // 10 % 2])
        return True


# -- faults ---------------------------------------------------------------------------------------------------------


@dataclass
class Fault:
    inject: Callable[[Rig], Awaitable[None]]
    heal: Callable[[Rig], Awaitable[None]]
    hold: float  # seconds between inject and heal (--outage for the control-plane outages)
    # Read right after the injection: whether the fault is really there (a trial whose fault missed proves nothing)
    present: Callable[[Rig], bool]


async def _nothing(r: Rig) -> None:
    return None


async def _plexd_kill(r: Rig) -> None:
    r.kill_daemon()  # `supervise` starts it again, as systemd would


# The failpoints this workload reaches within seconds of a start. The registration's, the rotation's and the
# upgrade's need flows it does not run: tests/e2e/test_failpoints_lab.py kills plexd at those.
KILL_POINTS = ("converge.between_domains", "mirror.commit", "report.queued", "action.finished")


async def _plexd_kill_at(r: Rig) -> None:
    """SIGKILL at a named point, not at a random moment: plexd is started again with the next of KILL_POINTS
    armed, and left to reach it (`supervise` then starts it as after any kill)."""
    point = KILL_POINTS[r.kills_at % len(KILL_POINTS)]
    r.kills_at += 1
    r.kill_daemon()
    r.start_daemon(failpoint=point)
    armed, log = r.proc, r.logs[-1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and armed is not None and armed.poll() is None:
        await asyncio.sleep(0.1)
    r.killed_at = log


def _died_at_point(r: Rig) -> bool:
    return r.killed_at is not None and "plexd: failpoint " in r.killed_at.read_text(errors="replace")


async def _wg_signal(r: Rig, sig: signal.Signals) -> None:
    pid = r.signalled = r.wireguard_go()  # the one signalled: plexd may start another before the check looks
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def _faults(r: Rig, **faults: object) -> None:
    await asyncio.to_thread(r.dp.admin.set_faults, **faults)


async def _clear(r: Rig) -> None:
    await asyncio.to_thread(r.dp.admin.clear_faults)


async def _dp_signal(r: Rig, sig: signal.Signals) -> None:
    if r.dp.proc is not None:
        os.killpg(r.dp.proc.pid, sig)


async def _dp_kill(r: Rig) -> None:
    await asyncio.to_thread(r.dp.kill)


async def _dp_start(r: Rig) -> None:
    await asyncio.to_thread(r.dp.start)


async def _fill(r: Rig) -> None:
    subprocess.run(["fallocate", "-l", "64m", str(r.data_dir / "filler")], check=False, capture_output=True)
    subprocess.run(["dd", "if=/dev/zero", f"of={r.data_dir / 'filler2'}", "bs=64k"], check=False, capture_output=True)


async def _unfill(r: Rig) -> None:
    for name in ("filler", "filler2"):
        (r.data_dir / name).unlink(missing_ok=True)


async def _read_only(r: Rig) -> None:
    """data_dir read-only. A mount with files open for writing (SQLite's) cannot be made read-only (EBUSY), as a
    file system's errors=remount-ro forces: so plexd is killed, the mount made read-only and plexd started again
    at once on it (no await in between, so `supervise` never sees it gone), where it waits until the heal makes
    data_dir writable. What is measured is plexd's wait on the file system, not the unit's RestartSec."""
    r.kill_daemon()
    subprocess.run(["mount", "-o", "remount,ro", str(r.data_dir)], check=True)
    r.start_daemon()


async def _writable(r: Rig) -> None:
    subprocess.run(["mount", "-o", "remount,rw", str(r.data_dir)], check=True)
    if r.proc is not None and r.proc.poll() is None:
        # plexd runs under `ip netns exec`, in a mount namespace of its own copied while data_dir was read-only:
        # that copy keeps the mount's own read-only flag until it is remounted there too (one namespace on a server)
        subprocess.run(["nsenter", "-t", str(r.proc.pid), "-m", "mount", "-o", "remount,rw", str(r.data_dir)],
                       check=False, capture_output=True)


def _alive(pid: int) -> bool:
    return (stat := process_stat(pid)) is not None and stat.alive


def _stopped(pid: int) -> bool:
    return (stat := process_stat(pid)) is not None and stat.state == "T"


def _answers(r: Rig, status: int) -> bool:
    try:
        return httpx.get(f"{r.dp.url}/v1/nodes/{r.node_id}/state", timeout=5).status_code == status
    except httpx.HTTPError:
        return False


def _in_node_out(r: Rig, *cmd: str) -> str:
    return subprocess.run(r.node.wrap_net(list(cmd)), capture_output=True, text=True).stdout


async def _by_hand(r: Rig, change: str, look: str, gone: str) -> None:
    """`change` in the node's namespace, then `look` in the same shell: whether `gone` was gone right after. The
    daemon repairs these within milliseconds when it sees them, so a look from here a moment later can miss it."""
    out = await asyncio.to_thread(_in_node_out, r, "sh", "-c", f"{change} && {look}")
    r.gone_right_after = gone not in out


async def _step_clock(r: Rig, offset: str) -> None:
    r.clock_file.write_text(offset + "\n")


def _clock_offset(r: Rig) -> float | None:
    """plexd's wall clock less the host's, in seconds, read from its status (start time + uptime = its now)."""
    doc = r.status()
    if doc is None:
        return None
    return doc["daemon"]["started_at"] + doc["daemon"]["uptime_seconds"] - time.time()


def _clock_stepped(r: Rig, seconds: float) -> bool:
    offset = _clock_offset(r)
    return offset is not None and abs(offset - seconds) < 600


def faults(outage: float) -> dict[str, Fault]:
    def statvfs(r: Rig) -> os.statvfs_result:
        return os.statvfs(r.data_dir)

    clock = {} if FAKETIME is None else {
        "clock_ahead": Fault(lambda r: _step_clock(r, "+1h"), lambda r: _step_clock(r, "+0"), outage,
                             lambda r: _clock_stepped(r, 3600)),
        "clock_behind": Fault(lambda r: _step_clock(r, "-1h"), lambda r: _step_clock(r, "+0"), outage,
                              lambda r: _clock_stepped(r, -3600)),
    }
    return {
        "plexd_kill": Fault(_plexd_kill, _nothing, 0.5, lambda r: r.proc is None or r.proc.poll() is not None),
        "plexd_kill_at": Fault(_plexd_kill_at, _nothing, 0.5, _died_at_point),
        "wg_kill": Fault(lambda r: _wg_signal(r, signal.SIGKILL), _nothing, 0.5,
                         lambda r: r.signalled is not None and not _alive(r.signalled)),
        "wg_stop": Fault(lambda r: _wg_signal(r, signal.SIGSTOP), lambda r: _wg_signal(r, signal.SIGCONT), 5,
                         lambda r: r.signalled is not None and _stopped(r.signalled)),
        "cp_500": Fault(lambda r: _faults(r, all_status=500), _clear, outage, lambda r: _answers(r, 500)),
        "cp_garbage": Fault(lambda r: _faults(r, state_body="{not json"), _clear, outage,
                            lambda r: r.dp.admin.status()["faults"].get("state_body") == "{not json"),
        "cp_silent": Fault(lambda r: _dp_signal(r, signal.SIGSTOP), lambda r: _dp_signal(r, signal.SIGCONT), outage,
                           lambda r: r.dp.proc is not None and _stopped(r.dp.proc.pid)),
        "dp_restart": Fault(_dp_kill, _dp_start, 2, lambda r: not r.dp.running),
        "disk_full": Fault(_fill, _unfill, 5, lambda r: statvfs(r).f_bavail * statvfs(r).f_frsize < 64 * 1024),
        "read_only": Fault(_read_only, _writable, 5, lambda r: bool(statvfs(r).f_flag & os.ST_RDONLY)),
        "nft_flush": Fault(lambda r: _by_hand(r, "nft flush ruleset", "nft list tables", "plexd"), _nothing, 0,
                           lambda r: r.gone_right_after),
        "link_del": Fault(lambda r: _by_hand(r, "ip link del plexd0", "ip -o link", "plexd0"), _nothing, 0,
                          lambda r: r.gone_right_after),
    } | clock


# -- the promises -------------------------------------------------------------------------------------------------


def expected_peers(r: Rig) -> set[str]:
    return {n["public_key"] for n in r.dp.admin.nodes() if n["id"] != r.node_id and n.get("public_key")}


def device_peers(r: Rig) -> set[str] | None:
    out = subprocess.run(r.node.wrap(["wg", "show", "plexd0", "peers"]), capture_output=True, text=True)
    return set(out.stdout.split()) if out.returncode == 0 else None


# Faults of the control plane: what it said meanwhile may be missing from the model (a refresh that failed), so the
# node has recovered only once it owes no state pull: it pulled since, or its event stream carried everything
PULL_AFTER = {"cp_500", "cp_garbage", "cp_silent", "dp_restart"}


def converged(r: Rig, since: float, pulled: bool = False) -> str:
    """"" when the node has converged after `since` (unix time), and if `pulled` owes no state pull; else what is
    not yet so."""
    doc = r.status()
    if doc is None:
        return "the daemon does not answer"
    if doc["event_stream"]["state"] != "connected":
        return f"event stream {doc['event_stream']['state']}"
    rec = doc["reconcile"]
    last = rec["last"]  # its age, not its `at`: plexd's wall clock may be the fault
    if last is None or time.time() - last["age_seconds"] < since or not last["ok"]:
        return "no successful reconcile since the heal"
    if pulled and rec["pull_due"] and (rec["last_pull_age_seconds"] is None
                                       or time.time() - rec["last_pull_age_seconds"] < since):
        return f"a state pull is due ({rec['pull_due']}) and none succeeded since the heal"
    if doc["policy"]["enforcement"] != "enforced":
        return f"policy {doc['policy']['enforcement']}: {doc['policy']['reason']}"
    want, have = expected_peers(r), device_peers(r)
    if have != want:
        return f"device peers differ: {len(want - (have or set()))} missing, {len((have or set()) - want)} extra"
    return ""


def promises(r: Rig, w: Workload, node_id: str) -> list[str]:
    problems = []
    runs = r.runs_file.read_text().split() if r.runs_file.exists() else []
    twice = {eid for eid in runs if runs.count(eid) > 1}
    if twice:
        problems.append(f"hook ran twice for {sorted(twice)}")
    executions = r.dp.admin.executions(r.node_id)
    unanswered = set(w.requested) - {ex["execution_id"] for ex in executions if ex.get("acks") or ex.get("ack")}
    if unanswered:
        problems.append(f"{len(unanswered)} requested action(s) never acknowledged: {sorted(unanswered)[:3]}")
    for ex in executions:
        results = ex.get("results") or ([ex["result"]] if ex.get("result") else [])
        accepted = any(a.get("status") == "accepted" for a in ex.get("acks") or [ex.get("ack") or {}])
        if len(results) > 1:
            problems.append(f"execution {ex['execution_id']}: {len(results)} results")
        if accepted and not results:
            problems.append(f"execution {ex['execution_id']}: accepted, no result yet")
    drift = [json.dumps(d, sort_keys=True) for d in r.dp.admin.drift(r.node_id)]
    if len(drift) != len(set(drift)):
        problems.append(f"{len(drift) - len(set(drift))} drift record(s) arrived twice")
    upstream = {e["key"]: e["payload"] for e in r.dp.admin.report_entries(r.node_id)}
    for key, payload in w.reports.items():
        if upstream.get(key) not in (payload, w.attempted.get(key)):
            problems.append(f"report {key}: control plane has {upstream.get(key)}, last written {payload}")
    try:
        ident = json.loads((r.data_dir / "identity.json").read_text())
        if ident["node_id"] != node_id:
            problems.append(f"node id changed: {node_id} -> {ident['node_id']}")
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"identity.json unreadable: {e}")
    repaired = sorted(p.name for p in r.data_dir.iterdir() if p.name.endswith((".corrupt", ".unreadable")))
    if repaired:
        problems.append(f"data_dir files needed repair (moved aside): {repaired}")
    text = "".join(p.read_text(errors="replace") for p in r.logs if p.exists())
    text += (r.dp.log_path.read_text(errors="replace") if r.dp.log_path.exists() else "")
    for secret in r.secrets():
        if secret in text:
            problems.append("a secret is in a log")
    return problems


# -- the run --------------------------------------------------------------------------------------------------------


@dataclass
class Trial:
    fault: str
    recovery: float | None
    problems: list[str]


@dataclass
class Run:
    trials: list[Trial]
    workload: Counter[str]  # what the workload did between the faults: peer, report, action, policy


async def run_trials(trials: int, names: list[str], seed: int, outage: float, recover: float,
                     report: Callable[[Trial], None] = lambda t: None) -> Run:
    rng = random.Random(seed)
    kinds = faults(outage)
    results: list[Trial] = []
    with rig() as r:
        node_id = r.node_id
        w = Workload(r)
        task = asyncio.create_task(w.run())
        supervisor = asyncio.create_task(supervise(r))
        try:
            settled = await wait_converged(r, 0, 120 * load_factor())
            if settled is None:
                raise RuntimeError(f"the node never converged before the first fault; see {r.logs[-1]}")
            for i in range(trials):
                name = names[i % len(names)] if i < len(names) else rng.choice(names)
                fault = kinds[name]
                w.running.set()
                await asyncio.sleep(rng.uniform(0.5, 3.0))
                await fault.inject(r)
                present = await is_present(fault, r)
                await asyncio.sleep(fault.hold)
                await fault.heal(r)
                healed = time.time()
                w.running.clear()
                took = await wait_converged(r, healed, max(recover, 60) * load_factor(), name in PULL_AFTER)
                problems = await settled_promises(r, w, node_id, SETTLE * load_factor())
                if not present:
                    problems.insert(0, "the fault was not there right after its injection")
                if took is None:
                    problems.insert(0, f"not converged within {max(recover, 60):.0f} s: "
                                       f"{converged(r, healed, name in PULL_AFTER)}")
                elif took > recover * load_factor():
                    problems.insert(0, f"converged {took:.1f} s after the heal (limit {recover:.0f} s)")
                trial = Trial(name, took, problems)
                results.append(trial)
                report(trial)
            print("workload: " + ", ".join(f"{k} {v}" for k, v in sorted(w.done.items())), flush=True)
            for why, count in w.failed.most_common(8):
                print(f"  {count:4} x {why}", flush=True)
        finally:
            for t in (task, supervisor):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    return Run(results, w.done)


async def is_present(fault: Fault, r: Rig, limit: float = 3.0) -> bool:
    """Whether the fault took hold within `limit` seconds of its injection: a signal is delivered when its target is
    next scheduled, so on a busy machine a SIGKILLed or SIGSTOPped process still runs for a moment."""
    deadline = time.monotonic() + limit * load_factor()
    while not await asyncio.to_thread(fault.present, r):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def settled_promises(r: Rig, w: Workload, node_id: str, limit: float) -> list[str]:
    """The promises' problems once they stop changing: a report is sent after a debounce, an action's result after
    its hook ends, so what is missing may still come (duplicates never go away, so waiting hides none)."""
    deadline = time.monotonic() + limit
    while True:
        problems = await asyncio.to_thread(promises, r, w, node_id)
        if not problems or time.monotonic() > deadline:
            return problems
        await asyncio.sleep(0.5)


async def supervise(r: Rig) -> None:
    """What the shipped unit asks of systemd: a plexd that exits on failure (or is killed) is started again
    RestartSec (5 s) later; a clean exit stays down. (Its start limit, 5 starts in 120 s, is not modelled: the
    trials kill plexd more often than any real node sees.)"""
    while True:
        await asyncio.sleep(0.2)
        if r.proc is not None and r.proc.poll() is not None and r.proc.returncode != 0:
            r.proc = None
            await asyncio.sleep(RESTART_SEC)
            r.start_daemon()


async def wait_converged(r: Rig, since: float, limit: float, pulled: bool = False) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if not await asyncio.to_thread(converged, r, since, pulled):
            return time.monotonic() - start
        await asyncio.sleep(0.2)
    return None


def table(results: list[Trial]) -> str:
    lines = [f"{'fault':12} {'trials':>6} {'failures':>8} {'recovery p50':>12} {'p99':>8}"]
    for name in sorted({t.fault for t in results}):
        mine = [t for t in results if t.fault == name]
        times = sorted(t.recovery for t in mine if t.recovery is not None)
        p50 = statistics.median(times) if times else float("nan")
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else float("nan")
        lines.append(f"{name:12} {len(mine):6} {sum(bool(t.problems) for t in mine):8} {p50:11.1f}s {p99:7.1f}s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--faults", default=",".join(faults(0)), help="comma-separated fault names (default: all)")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--outage", type=float, default=30.0, help="seconds a control-plane outage lasts")
    ap.add_argument("--recover", type=float, default=10.0, help="seconds a node has to converge after a heal")
    args = ap.parse_args()
    names = args.faults.split(",")
    unknown = sorted(set(names) - set(faults(0)))
    if unknown:
        sys.exit(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(faults(0))}")
    print(f"chaos: {args.trials} trials of {', '.join(names)}, seed {args.seed}", flush=True)

    def show(t: Trial) -> None:
        took = f"{t.recovery:.1f} s" if t.recovery is not None else "never"
        print(f"  {t.fault:12} recovered in {took:>7}  {'; '.join(t.problems) or 'ok'}", flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still takes its lab down
    run = asyncio.run(run_trials(args.trials, names, args.seed, args.outage, args.recover, show))
    print(table(run.trials))
    sys.exit(1 if any(t.problems for t in run.trials) else 0)


if __name__ == "__main__":
    main()
