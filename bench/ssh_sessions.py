"""SSH sessions: logins (connect+auth+`exec true`) with the real OpenSSH client, p50/p99, with 100 sessions
live and as a burst of 100 at once; and the server's RSS per live session (issue 33: goals p99 <= 100 ms on
loopback, <= 0.5 MiB per live session).

The server (`bench/_ssh_server_child.py`: one `SshSessionServer` per session on 127.0.0.1) runs in a process of
its own, so its RSS and CPU time (read from /proc) are the server's alone; the clients are `sshpass ... ssh`
processes started from here. A login's time is the client's, from its start to its exit (it includes starting
sshpass and ssh). The target user is the user running the bench (root: the sessions run as root).

In order:
  one at a time          `--sequential` logins, the server otherwise idle
  N at once x rounds     every session gets a login at the same instant, `--rounds` times. On a small machine
                         this measures the cores: the clients' own CPU is printed beside the server's, and
                         N x (clients' CPU per login) / cores is what the last login waits before the server
                         does any work at all
  N live                 every session's client keeps `exec sleep` running; the server's RSS growth over its
                         listening state, divided by N, is the cost of one live session
  with N live            a login into each of the N live sessions, `--concurrency` at a time (default 1): the
                         latency of a user's login while the server carries N sessions

`--server sshd` runs the same steps against OpenSSH's own sshd (`bench/_openssh_server.py`; public-key login,
since sshd checks passwords against /etc/shadow) on the same machine: the baseline a user would compare with.
sshd's CPU is one figure (its per-connection processes and the commands are waited for together), and its
memory per live session is the PSS of its per-connection processes (two per session), not one process's RSS.

    flock /tmp/plexd-tests.lock .venv/bin/python -m bench ssh_sessions [--sessions 100] [--rounds 3]
        [--sequential 20] [--concurrency 1] [--server plexd|sshd]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import resource
import shutil
import sys
import time
from pathlib import Path

from bench._openssh_server import OpensshServer, descendants

CHILD = Path(__file__).with_name("_ssh_server_child.py")
TICKS = os.sysconf("SC_CLK_TCK")


def _proc_mib(pid: int, file: str, field: str) -> float:
    """A kB field of /proc/PID/FILE, in MiB (0 without the field)."""
    for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_mib(pid: int) -> float:
    return _proc_mib(pid, "status", "VmRSS:")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(the server's own utime+stime, that of its children it has waited for: the sessions' commands)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS, (int(fields[13]) + int(fields[14])) / TICKS


def clients_cpu_seconds() -> float:
    """utime+stime of this process's waited-for children: the sshpass and ssh clients."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ssh_argv(credential: str, user: str, port: int, command: str) -> list[str]:
    """A login with a password (the plexd server's session token) or, for a path, that private key (sshd). Both go
    through sshpass, so the clients' cost is the same either way."""
    if credential.startswith("/"):
        auth = ["-p", "unused", "ssh", "-i", credential, "-o", "PreferredAuthentications=publickey"]
    else:
        auth = ["-p", credential, "ssh", "-o", "PreferredAuthentications=password", "-o", "NumberOfPasswordPrompts=1"]
    return ["sshpass", *auth, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-p", str(port), f"{user}@127.0.0.1", command]


async def login(credential: str, user: str, port: int) -> float:
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*ssh_argv(credential, user, port, "true"),
                                                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"login failed ({proc.returncode}): {err.decode(errors='replace')[-300:]}")
    return elapsed


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def show(label: str, times: list[float]) -> None:
    ms = [t * 1000 for t in times]
    print(f"{label:28s} n={len(ms):4d}  p50 {percentile(ms, 50):7.1f} ms  p99 {percentile(ms, 99):7.1f} ms  "
          f"max {max(ms):7.1f} ms")


async def logins(targets: list[tuple[int, str]], user: str, concurrency: int) -> list[float]:
    """One login into each target, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(port: int, token: str) -> float:
        async with gate:
            return await login(token, user, port)

    return list(await asyncio.gather(*(one(p, t) for p, t in targets)))


class PlexdServer:
    """`bench/_ssh_server_child.py`: N `SshSessionServer`s in a process of their own."""

    name = "plexd"

    def __init__(self, sessions: int) -> None:
        self.sessions = sessions

    async def __aenter__(self) -> PlexdServer:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, str(CHILD), str(self.sessions),
                                                         stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        hello = json.loads(await asyncio.wait_for(self.proc.stdout.readline(), 120))
        self.pid, self.user, self.targets = hello["pid"], hello["user"], [(p, t) for p, t in hello["sessions"]]
        return self

    def memory_mib(self) -> float:
        return rss_mib(self.pid)

    async def live(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"live\n")
        return int(await self.proc.stdout.readline())

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


class SshdServer(OpensshServer):
    """OpenSSH's sshd: one listener for all N sessions, each login a connection of its own."""

    name = "sshd"

    def __init__(self, sessions: int) -> None:
        super().__init__()
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.targets = [(self.port, str(self.key_path))] * sessions

    def memory_mib(self) -> float:
        """The listener's RSS plus the PSS of its per-connection sshd processes (shared pages split fairly)."""
        return rss_mib(self.pid) + sum(pss_mib(pid) for pid in descendants(self.pid) if comm(pid) == "sshd")

    async def live(self) -> int:
        return sum(1 for pid in descendants(self.pid) if comm(pid) == "sleep")


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pss_mib(pid: int) -> float:
    try:
        return _proc_mib(pid, "smaps_rollup", "Pss:")
    except OSError:  # a connection's process that ended meanwhile
        return 0.0


async def run(server: PlexdServer | SshdServer, rounds: int, sequential: int, concurrency: int) -> None:
    clients: list[asyncio.subprocess.Process] = []
    async with server:
        pid, user, targets = server.pid, server.user, server.targets
        sessions = len(targets)
        print(f"server: {server.name}")
        listening = server.memory_mib()
        try:
            if sequential:
                show("one at a time", [await login(targets[i % sessions][1], user, targets[i % sessions][0])
                                       for i in range(sequential)])
            times: list[float] = []
            (own, commands), by_clients = cpu_seconds(pid), clients_cpu_seconds()
            for _ in range(rounds):
                times += await asyncio.gather(*(login(t, user, p) for p, t in targets))
            show(f"{sessions} at once x {rounds}", times)
            (own_after, commands_after), by_clients_after = cpu_seconds(pid), clients_cpu_seconds()
            server_side = (own_after - own + commands_after - commands) / len(times)
            clients_per_login = (by_clients_after - by_clients) / len(times)
            per_login = {}
            if server.name == "plexd":
                per_login["server (asyncssh, token check, spawn)"] = (own_after - own) / len(times)
                per_login["the commands (the shell running `true`)"] = (commands_after - commands) / len(times)
                per_login["server side in all"] = server_side
            else:
                per_login["server side in all (sshd, its per-connection processes, the commands)"] = server_side
            for what, seconds in per_login.items():
                print(f"  CPU per login, {what}: {seconds * 1000:.1f} ms")
            print(f"  CPU per login, the clients (sshpass + ssh): {clients_per_login * 1000:.1f} ms")
            cores = len(os.sched_getaffinity(0))
            print(f"  {sessions} at once on {cores} cores: the clients alone need "
                  f"{sessions * clients_per_login / cores * 1000:.0f} ms of every core, "
                  f"clients and server {sessions * (clients_per_login + server_side) / cores * 1000:.0f} ms")

            clients += [await asyncio.create_subprocess_exec(
                *ssh_argv(t, user, p, "exec sleep 600"), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL) for p, t in targets]
            deadline = time.monotonic() + 60
            while (live_now := await server.live()) != sessions:
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {live_now} of {sessions} sessions went live")
                await asyncio.sleep(0.2)
            live = server.memory_mib()
            print(f"server memory: {sessions} listening {listening:.1f} MiB, {sessions} live {live:.1f} MiB: "
                  f"{(live - listening) / sessions * 1024:.0f} KiB per live session")
            show(f"with {sessions} live, {concurrency} at a time", await logins(targets, user, concurrency))
        finally:
            for c in clients:
                if c.returncode is None:
                    c.kill()
                await c.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=1, help="logins at a time with the sessions live")
    parser.add_argument("--server", choices=("plexd", "sshd"), default="plexd",
                        help="plexd's SSH session server, or OpenSSH's sshd as the baseline")
    args = parser.parse_args()
    for tool in ("ssh", "sshpass"):
        if shutil.which(tool) is None:
            sys.exit(f"bench ssh_sessions: needs {tool} (apt-get install openssh-client sshpass)")
    server = PlexdServer(args.sessions) if args.server == "plexd" else SshdServer(args.sessions)
    asyncio.run(run(server, args.rounds, args.sequential, args.concurrency))


if __name__ == "__main__":
    main()
