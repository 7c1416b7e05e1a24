"""The root socket under a TCP slowloris: latency of `GET /v1/state/metadata` on the daemon's Unix socket while
200 unauthenticated TCP connections hold half-sent request heads against its node API listener.

A real `plexd up` in a lab namespace (real wireguard-go, real devplane) with `node_api.http_enabled` on
0.0.0.0:9100 inside the namespace. The flood is its own process in the root namespace, reaching the listener over
the lab bridge: it keeps `--connections` connections open, each sending a partial head a byte at a time, and opens
a new one whenever the daemon closes one (at the head deadline, or at once when TCP's budget is full). Root asks
the Unix socket one request after another, first without the flood, then during it; the latency is measured per
request from sending it to reading the whole answer.

    sudo .venv/bin/python -m bench node_api_tcp_flood [--connections 200] [--seconds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _connected_lab import connected_node

PORT = 9100
REQUEST = b"GET /v1/state/metadata HTTP/1.1\r\nHost: localhost\r\n\r\n"
PARTIAL = b"GET /v1/state HTTP/1.1\r\nHost: node\r\nUser-Agent: "


def flood(address: str, connections: int, stop: multiprocessing.Event, out: multiprocessing.Queue) -> None:
    """Hold `connections` slow connections open until `stop`; report how many were opened and refused."""
    opened = refused = 0
    socks: list[socket.socket] = []

    def connect() -> None:
        nonlocal opened
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((address, PORT))
            s.sendall(PARTIAL)
            s.setblocking(False)
            socks.append(s)
            opened += 1
        except OSError:
            s.close()

    while len(socks) < connections:
        connect()
    while not stop.is_set():
        for s in list(socks):
            try:
                s.send(b"x")  # one byte more of a head that never ends
                s.recv(4096, socket.MSG_PEEK)
            except BlockingIOError:
                continue  # nothing to read: still held open by the daemon
            except OSError:
                pass
            # the daemon answered (503 at the door, 408 at the deadline) or closed it: replace it
            refused += 1
            socks.remove(s)
            s.close()
            connect()
        time.sleep(0.2)
    for s in socks:
        s.close()
    out.put((opened, refused))


def ask(sock_path: str, seconds: float) -> tuple[list[float], dict[str, int]]:
    """Latencies of the answered requests (ms), and the count of each status (`closed`: no answer at all)."""
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    s: socket.socket | None = None
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        try:
            if s is None:
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(30)
                s.connect(sock_path)
            s.sendall(REQUEST)
            buf = b""
            while True:
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0:
                    length = next(int(line.split(b":", 1)[1]) for line in buf[:head_end].split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    if len(buf) >= head_end + 4 + length:
                        break
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionResetError
                buf += chunk
            status = buf[9:12].decode()
        except OSError:
            status = "closed"
        if status != "200" and s is not None:
            s.close()
            s = None
        statuses[status] = statuses.get(status, 0) + 1
        if status == "200":
            latencies.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.01)  # a steady client, not a flood of its own
    if s is not None:
        s.close()
    return latencies, statuses


def summary(result: tuple[list[float], dict[str, int]]) -> str:
    lat, statuses = result
    if len(lat) < 2:
        return f"statuses {statuses}: (almost) nothing answered"
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return (f"statuses {dict(sorted(statuses.items()))}, answered: p50 {statistics.median(lat):.2f} ms   "
            f"p99 {q[98]:.2f} ms   max {max(lat):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    token_dir = Path("/tmp") / f"plexd-bench-token-{int(time.time())}"
    token_dir.mkdir(mode=0o700)
    token_file = token_dir / "http-token"
    token_file.write_text("bench-token-not-guessed\n")
    try:
        settings = f"http_enabled: true, http_listen: '0.0.0.0:{PORT}', http_token_file: {token_file}"
        with connected_node(reconcile="1h", node_api=settings) as node:
            sock = str(node.api_socket)
            quiet = ask(sock, args.seconds)
            ctx = multiprocessing.get_context("fork")
            stop, out = ctx.Event(), ctx.Queue()
            flooder = ctx.Process(target=flood, args=(node.lab_node.address, args.connections, stop, out))
            flooder.start()
            time.sleep(2)  # let the flood fill the TCP budget before measuring
            try:
                busy = ask(sock, args.seconds)
            finally:
                stop.set()
                opened, refused = out.get(timeout=60)
                flooder.join(10)
            alive = node.proc.poll() is None
    finally:
        token_file.unlink(missing_ok=True)
        token_dir.rmdir()
    print(f"GET /v1/state/metadata on the Unix socket, root, one request at a time for {args.seconds:g}s each")
    print(f"  without a flood:                      {summary(quiet)}")
    print(f"  during a {args.connections}-connection TCP slowloris: {summary(busy)}")
    print(f"  the flood opened {opened} connections, {refused} of them answered or closed by the daemon; "
          f"daemon {'still running' if alive else 'DIED'}")
    print("  goal: the root socket answers within 100 ms (max) during the flood")


if __name__ == "__main__":
    main()
