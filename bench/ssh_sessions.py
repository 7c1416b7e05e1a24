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

    flock /tmp/plexd-tests.lock .venv/bin/python -m bench ssh_sessions [--sessions 100] [--rounds 3]
        [--sequential 20] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

CHILD = Path(__file__).with_name("_ssh_server_child.py")
TICKS = os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(the server's own utime+stime, that of its children it has waited for: the sessions' commands)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS, (int(fields[13]) + int(fields[14])) / TICKS


def clients_cpu_seconds() -> float:
    """utime+stime of this process's waited-for children: the sshpass and ssh clients."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ssh_argv(token: str, user: str, port: int, command: str) -> list[str]:
    return ["sshpass", "-p", token, "ssh", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "PreferredAuthentications=password", "-o", "NumberOfPasswordPrompts=1", "-o", "LogLevel=ERROR",
            "-p", str(port), f"{user}@127.0.0.1", command]


async def login(token: str, user: str, port: int) -> float:
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*ssh_argv(token, user, port, "true"),
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


async def run(sessions: int, rounds: int, sequential: int, concurrency: int) -> None:
    server = await asyncio.create_subprocess_exec(sys.executable, str(CHILD), str(sessions),
                                                  stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert server.stdin is not None and server.stdout is not None
    clients: list[asyncio.subprocess.Process] = []
    try:
        hello = json.loads(await asyncio.wait_for(server.stdout.readline(), 120))
        pid, user, targets = hello["pid"], hello["user"], [(p, t) for p, t in hello["sessions"]]
        listening = rss_mib(pid)
        if sequential:
            show("one at a time", [await login(targets[i % sessions][1], user, targets[i % sessions][0])
                                   for i in range(sequential)])
        times: list[float] = []
        (own, commands), by_clients = cpu_seconds(pid), clients_cpu_seconds()
        for _ in range(rounds):
            times += await asyncio.gather(*(login(t, user, p) for p, t in targets))
        show(f"{sessions} at once x {rounds}", times)
        (own_after, commands_after), by_clients_after = cpu_seconds(pid), clients_cpu_seconds()
        per_login = {"server (asyncssh, token check, spawn)": (own_after - own) / len(times),
                     "the commands (the login shell running `true`)": (commands_after - commands) / len(times),
                     "the clients (sshpass + ssh)": (by_clients_after - by_clients) / len(times)}
        for what, seconds in per_login.items():
            print(f"  CPU per login, {what}: {seconds * 1000:.1f} ms")
        cores = len(os.sched_getaffinity(0))
        print(f"  {sessions} at once on {cores} cores: the clients alone need "
              f"{sessions * per_login['the clients (sshpass + ssh)'] / cores * 1000:.0f} ms of every core, "
              f"all three {sessions * sum(per_login.values()) / cores * 1000:.0f} ms")

        clients += [await asyncio.create_subprocess_exec(
            *ssh_argv(t, user, p, "exec sleep 600"), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL) for p, t in targets]
        deadline = time.monotonic() + 60
        while True:
            server.stdin.write(b"live\n")
            live_now = int(await server.stdout.readline())
            if live_now == sessions:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"only {live_now} of {sessions} sessions went live")
            await asyncio.sleep(0.2)
        live = rss_mib(pid)
        print(f"server RSS: {sessions} listening {listening:.1f} MiB, {sessions} live {live:.1f} MiB: "
              f"{(live - listening) / sessions * 1024:.0f} KiB per live session")
        show(f"with {sessions} live, {concurrency} at a time", await logins(targets, user, concurrency))
    finally:
        for c in clients:
            if c.returncode is None:
                c.kill()
            await c.wait()
        server.stdin.close()
        try:
            await asyncio.wait_for(server.wait(), 30)
        except TimeoutError:
            server.kill()
            await server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=1, help="logins at a time with the sessions live")
    args = parser.parse_args()
    for tool in ("ssh", "sshpass"):
        if shutil.which(tool) is None:
            sys.exit(f"bench ssh_sessions: needs {tool} (apt-get install openssh-client sshpass)")
    asyncio.run(run(args.sessions, args.rounds, args.sequential, args.concurrency))


if __name__ == "__main__":
    main()
