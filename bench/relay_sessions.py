"""Many relay sessions at once through one userspace relay: every session forwarding both ways at the same time.

`python -m bench relay_sessions [--sessions 100] [--seconds 10] [--pps 10000]` (no root needed: loopback only).
The relay is the real one (`python -m plexd.bridge.standalone` on 127.0.0.1); each session's two ends are UDP
sockets of this process speaking WireGuard's framing (an initiation, its response, then transport packets: the
relay routes by their indices exactly as it does a real pair's; the handshakes carry the mac1 of each end's public
key, listed in its session, which the relay checks; the payloads are not encrypted, which the relay never looks
at). Reported: sessions that forwarded both ways, packets delivered and lost, one-way latency
p50/p99 through the relay (sender and receiver share this process's clock), and the relay process's CPU.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")
EXPIRES = "2999-01-01T00:00:00Z"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def with_mac1(message: bytes, public_key: bytes) -> bytes:
    """WireGuard's mac1 for the holder of `public_key`, in the 16 bytes before the message's last 16 (mac2)."""
    key = hashlib.blake2s(b"mac1----" + public_key).digest()
    at = len(message) - 32
    return message[:at] + hashlib.blake2s(message[:at], key=key, digest_size=16).digest() + message[at + 16:]


def initiation(sender: int, responder_key: bytes) -> bytes:
    return with_mac1(bytes([1, 0, 0, 0]) + struct.pack("<I", sender) + bytes(140), responder_key)


def response(sender: int, receiver: int, initiator_key: bytes) -> bytes:
    return with_mac1(bytes([2, 0, 0, 0]) + struct.pack("<II", sender, receiver) + bytes(80), initiator_key)


def transport(receiver: int, sent_ns: int) -> bytes:
    return bytes([4, 0, 0, 0]) + struct.pack("<IQQ", receiver, 0, sent_ns) + bytes(104)  # 128 bytes


class Relay:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "plexd.bridge.standalone", "--listen", "127.0.0.1:0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = json.loads(self.proc.stdout.readline())
        self.port = first["port"]

    def command(self, doc: dict) -> dict:
        self.proc.stdin.write(json.dumps(doc) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench relay_sessions", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--pps", type=int, default=10_000, help="packets per second offered, all sessions together")
    args = p.parse_args(argv)
    relay = Relay()
    target = ("127.0.0.1", relay.port)
    ends: list[tuple[socket.socket, socket.socket]] = []
    keys = [(os.urandom(32), os.urandom(32)) for _ in range(args.sessions)]  # any 32 bytes serve as public keys
    try:
        docs = []
        for i in range(args.sessions):
            pair = []
            for _ in range(2):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                s.bind(("127.0.0.1", 0))
                s.setblocking(False)
                pair.append(s)
            a, b = pair
            ends.append((a, b))
            docs.append({"session_id": f"rel_{i}", "peer_a_id": f"n_{i}_a",
                         "peer_a_endpoint": f"127.0.0.1:{a.getsockname()[1]}", "peer_b_id": f"n_{i}_b",
                         "peer_b_endpoint": f"127.0.0.1:{b.getsockname()[1]}", "expires_at": EXPIRES,
                         "peer_a_public_key": base64.b64encode(keys[i][0]).decode(),
                         "peer_b_public_key": base64.b64encode(keys[i][1]).decode()})
        answer = relay.command({"sessions": docs})
        assert answer.get("ok") and not answer.get("refused"), answer
        # Handshakes: a's index is 2i+1, b's 2i+2.
        for i, (a, b) in enumerate(ends):
            a.sendto(initiation(2 * i + 1, keys[i][1]), target)
            _wait_one(b)
            b.sendto(response(2 * i + 2, 2 * i + 1, keys[i][0]), target)
            _wait_one(a)
        sel = selectors.DefaultSelector()
        for i, (a, b) in enumerate(ends):
            sel.register(a, selectors.EVENT_READ, (i, 0))
            sel.register(b, selectors.EVENT_READ, (i, 1))
        sent = received = 0
        per_direction = [[0, 0] for _ in ends]
        latencies: list[int] = []
        cpu0, t0 = cpu_seconds(relay.proc.pid), time.perf_counter()
        interval = 1.0 / args.pps
        next_send = t0
        k = 0
        while True:
            now = time.perf_counter()
            if now - t0 >= args.seconds:
                break
            while next_send <= now and sent < args.pps * args.seconds:
                i, side = (k // 2) % len(ends), k % 2
                a, b = ends[i]
                src, receiver = (a, 2 * i + 2) if side == 0 else (b, 2 * i + 1)
                try:
                    src.sendto(transport(receiver, time.perf_counter_ns()), target)
                    sent += 1
                except BlockingIOError:
                    pass
                k += 1
                next_send += interval
            for key, _ in sel.select(timeout=max(0.0, min(0.002, next_send - time.perf_counter()))):
                sock = key.fileobj
                i, side = key.data
                while True:
                    try:
                        data = sock.recv(2048)  # type: ignore[union-attr]
                    except BlockingIOError:
                        break
                    received += 1
                    per_direction[i][side] += 1
                    if data[0] == 4:
                        latencies.append(time.perf_counter_ns() - struct.unpack_from("<Q", data, 16)[0])
        time.sleep(0.2)
        for key, _ in sel.select(timeout=0):
            while True:
                try:
                    key.fileobj.recv(2048)  # type: ignore[union-attr]
                except BlockingIOError:
                    break
                received += 1
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds(relay.proc.pid) - cpu0
        status = relay.command({"status": True})
        latencies.sort()
        both_ways = sum(1 for got in per_direction if got[0] and got[1])
        result = {"sessions": args.sessions, "sessions_forwarding_both_ways": both_ways, "offered_pps": args.pps,
                  "sent": sent, "received": received, "lost_percent": round(100 * (sent - received) / max(sent, 1), 2),
                  "delivered_pps": round(received / elapsed),
                  "latency_p50_ms": round(latencies[len(latencies) // 2] / 1e6, 3) if latencies else None,
                  "latency_p99_ms": round(latencies[int(len(latencies) * 0.99)] / 1e6, 3) if latencies else None,
                  "relay_cpu_percent": round(100 * cpu / elapsed, 1),
                  "relay_cpu_percent_per_10k_pps": round(100 * cpu / elapsed * 10_000 / max(received / elapsed, 1), 1),
                  "relay_dropped": status.get("dropped"), "relay_send_dropped": status.get("send_dropped")}
        print(f"{args.sessions} sessions, {both_ways} forwarding both ways; {result['delivered_pps']} packets/s "
              f"delivered of {args.pps} offered, {result['lost_percent']} % lost; one-way p50 "
              f"{result['latency_p50_ms']} ms, p99 {result['latency_p99_ms']} ms; relay CPU "
              f"{result['relay_cpu_percent']} % ({result['relay_cpu_percent_per_10k_pps']} % per 10,000 packets/s)")
        print(json.dumps(result))
        return 0 if both_ways == args.sessions else 1
    finally:
        for a, b in ends:
            a.close()
            b.close()
        relay.close()


def _wait_one(sock: socket.socket, timeout: float = 5.0) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return sock.recv(2048)
        except BlockingIOError:
            time.sleep(0.001)
    raise SystemExit(f"no packet through the relay within {timeout}s (socket {sock.getsockname()})")


if __name__ == "__main__":
    sys.exit(main())
