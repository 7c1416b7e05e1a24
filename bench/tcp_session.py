"""TCP session throughput beside a direct connection on the same loopback path (issue 33: goal >= 80 %).

iperf3 (a server and a client, processes of their own) runs `--seconds` once straight to the server and once
through a `TcpSession` listener forwarding to it (kernel splice in this process), `--runs` times each,
interleaved; prints Gbit/s (median of the runs) and the ratio. Without iperf3 (apt-get install iperf3) it says so
and stops: a Python client in the same process as the relay would measure the client, not the relay.

    .venv/bin/python -m bench tcp_session [--seconds 5] [--runs 3]
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

from plexd.access.sessions import Session, TcpTarget
from plexd.access.tcp import TcpSession


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
    d, r = statistics.median(direct), statistics.median(relayed)
    print(f"direct      {d:6.2f} Gbit/s  (runs: {', '.join(f'{x:.2f}' for x in direct)})")
    print(f"tcp session {r:6.2f} Gbit/s  (runs: {', '.join(f'{x:.2f}' for x in relayed)})")
    print(f"ratio       {r / d:6.2f}  (goal >= 0.80)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if shutil.which("iperf3") is None:
        sys.exit("bench tcp_session: needs iperf3 (apt-get install iperf3)")
    asyncio.run(run(args.seconds, args.runs))


if __name__ == "__main__":
    main()
