"""Firewall benchmark: plexd's nftables domain against real nftables in a namespace of its own (issue 12).

Figures, at 100 and 1,000 policy rules (each rule names its own source node, so as many sets as rules):
  * apply the whole policy onto an empty table (`Engine.converge` of the firewall domain: read, diff, one transaction);
  * a one-rule change on top (a rule inserted in the middle of the policy, then removed) through the event path
    (diff against the table as the last apply left it, one transaction; a full converge runs between changes,
    untimed, as the periodic reconcile would: the event path adds rules without reading their handles back, and
    a rule whose handle is not known yet is removed by a full converge); beside it the same change through a full
    converge (which reads the table back first, as the periodic reconcile does);
  * one peer joining (an element of its node's set) through the event path;
  * `nft -f` of the same full ruleset (the text `nft list table` prints), onto an empty table.
Each change is repeated (alternately made and undone); median and p95 are printed.

Run as root:  .venv/bin/python bench/firewall_bench.py [--sizes 100,1000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import subprocess
import tempfile
import time
import uuid

from pyroute2.netns import setns

from plexd.converge.engine import Engine
from plexd.firewall.firewall_domain import FirewallDomain
from plexd.state.desired import DesiredState
from plexd.state.model import Peer, Policy, PolicyRule

KEY = "aGVsbG8gd29ybGQgdGhpcyBpcyBhIHRlc3Qga2V5IQ=="


def _key(i: int) -> str:
    import base64

    return base64.b64encode(i.to_bytes(4, "big") * 8).decode()


def _peer(i: int) -> Peer:
    return Peer(f"n_{i}", _key(i + 1), f"10.100.{i // 250}.{i % 250 + 2}")


def _model(rules: list[PolicyRule], peers: list[Peer]) -> DesiredState:
    d = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key=KEY,
                             mesh_ip="10.100.200.1", node_id="n_self", enforce_policy=True)
    return d.with_peers(peers).with_policies([Policy("bench", tuple(rules))])


def _rules(n: int) -> list[PolicyRule]:
    # n-1 rules naming existing nodes, one naming a node that joins later (its set starts empty)
    rules = [PolicyRule(f"n_{i}", "n_self", 1000 + i, "tcp", "allow") for i in range(n - 1)]
    return [*rules, PolicyRule("n_joiner", "n_self", 22, "tcp", "allow")]


def _ms(samples: list[float]) -> str:
    s = sorted(samples)
    p95 = s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]
    return f"median {statistics.median(s) * 1000:6.2f} ms  p95 {p95 * 1000:6.2f} ms"


async def bench_size(n: int, repeat: int, pool: concurrent.futures.Executor, ns: str) -> None:
    loop = asyncio.get_running_loop()

    async def run(fn, *args):
        return await loop.run_in_executor(pool, fn, *args)

    fw = FirewallDomain("plexd0", run_blocking=run)
    engine = Engine([fw])
    peers = [_peer(i) for i in range(n - 1)]
    rules = _rules(n)
    base = _model(rules, peers)
    await engine.converge(base)  # warm the contexts (and the rule rendering caches)
    full = []
    for _ in range(max(3, repeat // 4)):  # each from an empty table
        await fw.teardown()
        t = time.perf_counter()
        result = await engine.converge(base)
        full.append(time.perf_counter() - t)
        assert not result.errors, result.errors
    print(f"{n:5d} rules  full apply on an empty table: {_ms(full)} "
          f"({len(result.changes)} change: {result.changes[0].detail})")

    changed = _model([*rules[:n // 2], PolicyRule("n_1", "n_self", 9999, "udp", "allow"), *rules[n // 2:]], peers)
    inserted, removed, reread = [], [], []
    for i in range(repeat):
        target = changed if i % 2 == 0 else base
        t = time.perf_counter()
        r = await engine.apply_delta(target)
        (inserted if target is changed else removed).append(time.perf_counter() - t)
        assert len(r.changes) == 1 and not r.errors, r  # the rule in input (forward holds no rule to this node)
        # The periodic reconcile between two policy changes reads the table (and so learns the handles of the
        # rules the event path added without reading them back); untimed here.
        await engine.converge(target)
    for i in range(repeat):
        target = changed if i % 2 == 0 else base
        t = time.perf_counter()
        await engine.converge(target)
        reread.append(time.perf_counter() - t)
    print(f"{n:5d} rules  one rule inserted, event path: {_ms(inserted)}")
    print(f"{n:5d} rules  one rule removed, event path:  {_ms(removed)}")
    print(f"{n:5d} rules  one-rule change, full converge:{_ms(reread)}")

    joined = base.with_peer(Peer("n_joiner", _key(999_999), "10.100.250.250"))
    join = []
    for i in range(repeat):
        target = joined if i % 2 == 0 else base
        t = time.perf_counter()
        r = await engine.apply_delta(target, ["n_joiner"])  # the peer the event named, as the daemon passes it
        join.append(time.perf_counter() - t)
        assert len(r.changes) == 1 and not r.errors, r
    print(f"{n:5d} rules  one peer joining (one element): {_ms(join)}")

    text = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "plexd"],
                          capture_output=True, text=True, check=True).stdout
    nft_f = []
    with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
        f.write(text)
        f.flush()
        for _ in range(max(3, repeat // 4)):
            await fw.teardown()
            out = subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",
                                  f"s=$(date +%s%N); nft -f {f.name}; e=$(date +%s%N); echo $((e - s))"],
                                 capture_output=True, text=True, check=True).stdout
            nft_f.append(int(out.strip().splitlines()[-1]) / 1e9)
    print(f"{n:5d} rules  nft -f of the same ruleset:     {_ms(nft_f)}  (includes starting the nft process)")
    await fw.teardown()


async def main(sizes: list[int], repeat: int) -> None:
    ns = f"pxfwb{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=setns, initargs=(ns,))
    try:
        for n in sizes:
            await bench_size(n, repeat, pool, ns)
    finally:
        pool.shutdown()
        subprocess.run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    asyncio.run(main([int(x) for x in args.sizes.split(",")], args.repeat))
