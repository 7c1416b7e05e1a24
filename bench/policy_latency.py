"""Policy-change latency: the admin changes one rule of 1,000 → the rule is live in the node's nftables table.

A real `plexd up` in a lab namespace (real nftables, real wireguard-go), the real devplane on the lab bridge. The
policy holds `--rules` rules (each naming a node of its own: as many sets as rules). Each measured change inserts
one rule in the middle of the policy, or takes it away again, alternately. The clock starts before the admin API
call (`PUT /admin/v1/policies`: the devplane stores it and publishes `policy_updated`) and stops when
`nft monitor` in the node's namespace shows the rule added or deleted. The path: admin HTTP → sign → SSE →
verify → state refresh (`GET /state`, conditional) → desired model → the firewall's event path (diff against the
table as its last apply left it, one transaction).
The periodic reconcile (which reads the table, and so learns the handles of rules added by events) runs between
changes, as it would in a day: every `--reconcile-every` changes one is asked for (untimed).

    sudo .venv/bin/python -m bench policy_latency [--rules 1000] [--changes 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time

from _connected_lab import connected_node


def policy(node_id: str, n: int, extra: bool) -> list[dict]:
    rules = [{"src": f"n_other{i}", "dst": node_id, "port": 1000 + i, "protocol": "tcp", "action": "allow"}
             for i in range(n - 1)]
    if extra:
        rules.insert(n // 2, {"src": "n_other1", "dst": node_id, "port": 9999, "protocol": "udp", "action": "allow"})
    return [{"id": "bench", "rules": rules}]


async def measure(n_rules: int, changes: int, reconcile_every: int) -> list[float]:
    with connected_node(reconcile="10m") as node:
        admin, node_id = node.dp.admin, node.node_id
        netns = node.lab_node.netns
        monitor = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", netns, "stdbuf", "-oL", "nft", "-j", "monitor", "rules",  # a line at a time
            stdout=asyncio.subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert monitor.stdout is not None

        async def seen(verbs: tuple[str, ...], port: int, timeout: float) -> float:
            async with asyncio.timeout(timeout):
                while True:
                    line = await monitor.stdout.readline()
                    if not line:
                        raise RuntimeError("nft monitor ended")
                    if str(port).encode() not in line:
                        continue  # cheap filter first: the whole policy is 1,000 lines
                    doc = json.loads(line)  # a rule placed by handle is listed as "insert", appended as "add"
                    rule = next((doc[v]["rule"] for v in verbs if "rule" in doc.get(v, {})), {})
                    if any(e.get("match", {}).get("right") == port for e in rule.get("expr", [])):
                        return time.perf_counter()

        try:
            admin.set_policies(policy(node_id, n_rules, False))
            try:
                await seen(("add", "insert"), 1000 + n_rules - 2, 60)  # the whole policy is live
            except TimeoutError:
                raise RuntimeError(f"the policy did not go live in 60 s; see {node.workdir}/plexd.log") from None
            await asyncio.sleep(1)
            node_cli_reconcile(node)  # the policy arrived by the event path: a reconcile learns its rules' handles
            latencies = []
            for i in range(changes):
                if i % reconcile_every == reconcile_every - 1:
                    node_cli_reconcile(node)
                extra = i % 2 == 0
                start = time.perf_counter()
                await asyncio.to_thread(admin.set_policies, policy(node_id, n_rules, extra))
                ADMIN_CALLS.append(time.perf_counter() - start)
                latencies.append(await seen(("add", "insert") if extra else ("delete",), 9999, 30) - start)
                await asyncio.sleep(0.2)
            return latencies
        finally:
            monitor.kill()
            await monitor.wait()


ADMIN_CALLS: list[float] = []  # how long the admin API call took (devplane: store, sign, queue the event)


def node_cli_reconcile(node) -> None:
    from _connected_lab import PLEXD

    subprocess.run(["ip", "netns", "exec", node.lab_node.netns, PLEXD, "--config", str(node.workdir / "config.yaml"),
                    "reconcile", "--once"], capture_output=True, check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rules", type=int, default=1000)
    ap.add_argument("--changes", type=int, default=40)
    ap.add_argument("--reconcile-every", type=int, default=2, help="a full reconcile every N changes (untimed)")
    args = ap.parse_args()
    lat = sorted(x * 1000 for x in asyncio.run(measure(args.rules, args.changes, args.reconcile_every)))
    q = statistics.quantiles(lat, n=100, method="inclusive")
    print(f"policy change → rule live in nftables, {len(lat)} one-rule changes of a {args.rules}-rule policy")
    print(f"  min {lat[0]:.1f} ms   p50 {statistics.median(lat):.1f} ms   p90 {q[89]:.1f} ms   "
          f"p99 {q[98]:.1f} ms   max {lat[-1]:.1f} ms")
    print(f"  of which the admin API call (devplane: store the policy, sign, queue): p50 "
          f"{statistics.median(ADMIN_CALLS) * 1000:.1f} ms")
    print("  goal: p99 <= 50 ms")
    print(json.dumps({"p50_ms": round(statistics.median(lat), 1), "p99_ms": round(q[98], 1)}))


if __name__ == "__main__":
    main()
