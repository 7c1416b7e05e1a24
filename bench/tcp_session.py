"""TCP session throughput beside a direct connection on the same path (issue 33: goal >= 80 %).

iperf3 (a server and a client, processes of their own) runs `--seconds` once straight to the server and once
through a `TcpSession` listener forwarding to it (kernel splice), `--runs` times each, interleaved; prints Gbit/s
(median of the runs) and the ratio. Without iperf3 (apt-get install iperf3) it says so and stops: a Python client
in the same process as the relay would measure the client, not the relay.

Two paths:
  loopback (default)  client, session and server on 127.0.0.1 in this process's namespace: the session's own
                      cost at its worst (three processes share the cores where the direct run has two)
  --mesh              the path a session is used on: two lab namespaces joined by wireguard-go (configured with
                      `wg set`, no daemon); the client on one, the session (on the other's mesh IP, in a process
                      in that namespace) and the iperf3 server on the other (root; under the shared test lock)

    .venv/bin/python -m bench tcp_session [--seconds 5] [--runs 3] [--mesh]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import sys
import time

from plexd.access.tcp import TcpSession
from plexd.state.sessions_block import Session, TcpTarget


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def iperf(port: int, seconds: int) -> float:
    proc = await asyncio.create_subprocess_exec("iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds),
                                                "-J", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"iperf3 client failed: {out.decode()[-500:]}")
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9


async def run(seconds: int, runs: int) -> None:
    port = free_port()
    server = await asyncio.create_subprocess_exec("iperf3", "-s", "-B", "127.0.0.1", "-p", str(port),
                                                  stdout=asyncio.subprocess.DEVNULL)
    tcp = TcpSession(Session("bench", "tcp", TcpTarget("127.0.0.1", port), time.time() + 3600), "127.0.0.1")
    try:
        await asyncio.sleep(0.5)  # iperf3 -s prints nothing machine-readable when it listens
        session_port = await tcp.start()
        direct, relayed = [], []
        for _ in range(runs):
            direct.append(await iperf(port, seconds))
            relayed.append(await iperf(session_port, seconds))
    finally:
        await tcp.close("plexd_close")
        server.terminate()
        await server.wait()
    report(direct, relayed, "loopback")


# The session in the server's namespace: listens on the mesh IP, forwards to iperf3 on loopback, prints its port.
_SESSION_CHILD = """
import asyncio, sys, time
from plexd.state.sessions_block import Session, TcpTarget
from plexd.access.tcp import TcpSession
async def main():
    tcp = TcpSession(Session("bench", "tcp", TcpTarget("127.0.0.1", 5201), time.time() + 3600), sys.argv[1])
    print(await tcp.start(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


def run_mesh(seconds: int, runs: int) -> None:
    import subprocess
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))  # the relay lab helpers
    from relay_lab import nat_pair, point_at

    from plexd.devplane.lab import Lab

    def iperf_from(lab, node, ip: str, port: int) -> float:
        out = lab.exec(node, ["iperf3", "-c", ip, "-p", str(port), "-t", str(seconds), "-J"]).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9

    with Lab().up() as lab:
        a, b = nat_pair(lab, 1, snat="masquerade")
        point_at(lab, a, b, f"{b.router.public}:51820")
        point_at(lab, b, a, f"{a.router.public}:51820")
        lab.spawn(b.node.wrap(["iperf3", "-s", "-p", "5201"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        child = lab.spawn(b.node.wrap([sys.executable, "-c", _SESSION_CHILD, b.mesh_ip]), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
        session_port = int(child.stdout.readline())
        time.sleep(0.5)
        direct, relayed = [], []
        for _ in range(runs):
            direct.append(iperf_from(lab, a.node, b.mesh_ip, 5201))
            relayed.append(iperf_from(lab, a.node, b.mesh_ip, session_port))
    report(direct, relayed, "over wireguard-go between two namespaces")


def report(direct: list[float], relayed: list[float], path: str) -> None:
    d, r = statistics.median(direct), statistics.median(relayed)
    print(f"path: {path}")
    print(f"direct      {d:6.2f} Gbit/s  (runs: {', '.join(f'{x:.2f}' for x in direct)})")
    print(f"tcp session {r:6.2f} Gbit/s  (runs: {', '.join(f'{x:.2f}' for x in relayed)})")
    print(f"ratio       {r / d:6.2f}  (goal >= 0.80)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mesh", action="store_true", help="over wireguard-go between two lab namespaces")
    args = parser.parse_args()
    if shutil.which("iperf3") is None:
        sys.exit("bench tcp_session: needs iperf3 (apt-get install iperf3)")
    if args.mesh:
        run_mesh(args.seconds, args.runs)
    else:
        asyncio.run(run(args.seconds, args.runs))


if __name__ == "__main__":
    main()
