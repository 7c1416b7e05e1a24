"""NAT discovery from the WireGuard listen port: which methods work while the device holds the port, and their cost.

`python -m bench nat_probe [--rounds N]` (root). A lab with coturn on two addresses and one node behind an nft
masquerade router, measured once with `masquerade` and once with `masquerade fully-random`:

  bound    an ordinary socket on the listen port (what the first discovery uses, before the device exists)
  taken    the same while wireguard-go holds the port: does the bind work? (no: EADDRINUSE)
  raw      plexd's refresh: a raw socket sends from the listen port and reads the answer (device up)
  second   a probe from another port, usable only if the router preserves ports (mapped port == local port)
  aiostun  aiostun 0.6.1 from another port against coturn, and against a server answering garbage

Prints each method's mapped address and the median / max round trip over N rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from plexd.devplane.lab import Lab

PROBE = r"""
import asyncio, json, socket, sys, time
from plexd.nat.probe import BoundTransport, RawTransport, ask
from plexd.nat.stun import StunError
method, servers, rounds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])

async def one(make):
    out = []
    for _ in range(rounds):
        t = make()
        try:
            start = time.perf_counter()
            answers = [await ask(t, ip, 3478, 3) for ip in servers]
            out.append((time.perf_counter() - start, [str(a.mapped) for a in answers], t.local_port))
        finally:
            t.close()
    return out

async def main():
    if method == "taken":
        try:
            BoundTransport.bind(51820).close(); print(json.dumps({"bind": "ok"}))
        except OSError as e:
            print(json.dumps({"bind": e.strerror}))
        return
    if method == "aiostun":
        import aiostun, contextlib, io
        garbage = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); garbage.bind(("127.0.0.1", 0))
        async def serve():
            loop = asyncio.get_running_loop()
            while True:
                data, addr = await loop.sock_recvfrom(garbage, 2048)
                garbage.sendto(b"\xde\xad\xbe\xef" * 8, addr)
        garbage.setblocking(False); task = asyncio.create_task(serve())
        res = {}
        for name, host, port in (("coturn", servers[0], 3478), ("garbage", "127.0.0.1", garbage.getsockname()[1])):
            start = time.perf_counter(); printed = io.StringIO()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                async with aiostun.Client(host=host, port=port, family=aiostun.IP4, proto=aiostun.UDP, timeout=2) as c:
                    mapped = await c.get_mapped_address()
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); sock.bind(("0.0.0.0", 0))
            t = BoundTransport(sock); s2 = time.perf_counter()
            try:
                ours = str((await ask(t, host, port, 2)).mapped)
            except StunError as e:
                ours = f"StunError: {e}"
            finally:
                t.close()
            res[name] = {"aiostun": mapped, "aiostun_s": round(s2 - start, 3),
                         "aiostun_printed": printed.getvalue().strip()[-120:],
                         "plexd": ours, "plexd_s": round(time.perf_counter() - s2, 3)}
        task.cancel()
        print(json.dumps(res)); return
    make = {"bound": lambda: BoundTransport.bind(51820), "raw": lambda: RawTransport(51820),
            "second": lambda: BoundTransport.bind(0)}[method]
    print(json.dumps(await one(make)))

asyncio.run(main())
"""


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench nat_probe")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    for mode in ("masquerade", "masquerade fully-random"):
        with Lab().up(0) as lab:
            stun = list(lab.start_stun())
            router = lab.add_router(mode)
            node = lab.add_node(behind=router)

            def run(method: str, rounds: int = args.rounds, node=node, stun=stun) -> object:
                res = lab.exec(node, [sys.executable, "-c", PROBE, method, json.dumps(stun), str(rounds)])
                return json.loads(res.stdout)

            print(f"\n== router: {mode} (public {router.public}), node {node.address}, listen port 51820")
            _report("bound (before the device)", run("bound", 1), router.public)
            lab.spawn(node.wrap(["env", "WG_PROCESS_FOREGROUND=1", "wireguard-go", "wgbench"]))
            deadline = time.monotonic() + 5
            while lab.exec(node, ["wg", "show", "wgbench"], check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise SystemExit("wireguard-go did not start")
                time.sleep(0.05)
            key = os.path.join(lab.workdir, "bench.key")
            lab.exec(node, ["sh", "-c", f"umask 077; wg genkey > {key} && wg set wgbench listen-port 51820 "
                                        f"private-key {key} && ip link set wgbench up"])
            print(f"taken (wireguard-go holds 51820): bind → {run('taken')['bind']}")
            _report("raw (device holds the port)", run("raw"), router.public)
            _report("second port (port-preservation check)", run("second"), router.public, second=True)
            if mode == "masquerade":
                for name, r in run("aiostun").items():
                    print(f"{name:>8}: aiostun {r['aiostun'] or '{}'} in {r['aiostun_s']}s"
                          f"{' printing ' + repr(r['aiostun_printed']) if r['aiostun_printed'] else ''}; "
                          f"plexd {r['plexd']} in {r['plexd_s']}s")
    return 0


def _report(label: str, rounds: list, public: str, second: bool = False) -> None:
    times = [r[0] * 1000 for r in rounds]
    mappings = sorted({tuple(r[1]) for r in rounds})
    line = (f"{label}: {len(rounds)} round(s), median {statistics.median(times):.2f} ms, max {max(times):.2f} ms "
            f"for both servers; mappings {[list(m) for m in mappings][:3]}")
    if second:
        preserved = sum(all(m.endswith(f":{r[2]}") for m in r[1]) for r in rounds)
        line += (f"; port preserved in {preserved}/{len(rounds)} (only a preserving router lets {public}:51820 be "
                 "inferred from it)")
    print(line)


if __name__ == "__main__":
    sys.exit(main())
