"""SSH sessions: 100 concurrent connect+auth+`exec true` with the real OpenSSH client (p50/p99), and the server's
RSS per live session (issue 33: goals p99 <= 100 ms on loopback, <= 0.5 MiB per live session).

One `SshSessionServer` per session on 127.0.0.1 in this process (the server's RSS is this process's); the clients
are `sshpass ... ssh` processes of their own. A login's time is the client's, from its start to its exit (so it
includes starting ssh and sshpass); `--sequential` also times them one at a time, without the contention of 100
clients on the machine's cores. Then `--sessions` clients each keep a shell (`exec sleep`) open, and the RSS
growth over the listening servers, divided by the live sessions, is the cost of one. The target user is the user
running the bench (root: the sessions run as root).

    flock /tmp/plexd-tests.lock .venv/bin/python -m bench ssh_sessions [--sessions 100] [--rounds 3] [--sequential 20]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import pwd
import shutil
import sys
import tempfile
import time

from nacl.signing import SigningKey

from plexd.access.sessions import Session, SshTarget
from plexd.access.ssh import SshSessionServer
from plexd.access.ssh_host_key import load_or_create_host_key
from plexd.access.token import sign_session_token


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


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
    print(f"{label:38s} n={len(ms):4d}  p50 {percentile(ms, 50):7.1f} ms  p99 {percentile(ms, 99):7.1f} ms  "
          f"max {max(ms):7.1f} ms")


async def run(sessions: int, rounds: int, sequential: int) -> None:
    user = pwd.getpwuid(os.geteuid()).pw_name
    key = SigningKey.generate()
    servers: list[tuple[SshSessionServer, str]] = []
    with tempfile.TemporaryDirectory() as key_dir:
        host_key = load_or_create_host_key(key_dir)
        gc.collect()
        base = rss_mib()
        for i in range(sessions):
            sid = f"bench_{i}"
            session = Session(sid, "ssh", SshTarget(user), time.time() + 3600)
            server = SshSessionServer(session, "127.0.0.1", host_key=host_key, keys=lambda: [key.verify_key],
                                      is_live=lambda s: True, record_command=lambda s, c: True)
            await server.start()
            token = sign_session_token(key, {"jti": sid, "kind": "ssh", "target": {"kind": "ssh", "user": user},
                                             "exp": time.time() + 3600})
            servers.append((server, token))
        gc.collect()
        listening = rss_mib()
        clients: list[asyncio.subprocess.Process] = []
        try:
            if sequential:
                times = [await login(servers[i % sessions][1], user, servers[i % sessions][0].port)
                         for i in range(sequential)]
                show("one at a time", times)
            all_times: list[float] = []
            for _ in range(rounds):
                all_times += await asyncio.gather(*(login(t, user, s.port) for s, t in servers))
            show(f"{sessions} concurrent x {rounds} rounds", all_times)

            clients += [await asyncio.create_subprocess_exec(
                *ssh_argv(t, user, s.port, "exec sleep 600"), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL) for s, t in servers]
            deadline = time.monotonic() + 60
            while sum(_running(s) for s, _ in servers) < sessions:
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {sum(_running(s) for s, _ in servers)} of {sessions} sessions went live")
                await asyncio.sleep(0.1)
            gc.collect()
            live = rss_mib()
            print(f"server RSS: before {base:.1f} MiB, {sessions} listening {listening:.1f} MiB "
                  f"({(listening - base) / sessions * 1024:.0f} KiB per listener), {sessions} live "
                  f"{live:.1f} MiB ({(live - listening) / sessions * 1024:.0f} KiB per live session; "
                  f"{(live - base) / sessions * 1024:.0f} KiB with its listener)")
        finally:
            await asyncio.gather(*(s.close("plexd_close") for s, _ in servers))
            for c in clients:
                if c.returncode is None:
                    c.kill()
                await c.wait()


def _running(server: SshSessionServer) -> int:
    return sum(1 for conn in server.connections for chan in conn.channels if chan.proc is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential", type=int, default=20)
    args = parser.parse_args()
    for tool in ("ssh", "sshpass"):
        if shutil.which(tool) is None:
            sys.exit(f"bench ssh_sessions: needs {tool} (apt-get install openssh-client sshpass)")
    asyncio.run(run(args.sessions, args.rounds, args.sequential))


if __name__ == "__main__":
    main()
