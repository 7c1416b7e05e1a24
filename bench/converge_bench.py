"""Converge benchmark: plexd vs `wg syncconf` on the same real wireguard-go device (in a lab namespace).

Figures (issue 4):
  * full apply of 100 / 1,000 / 5,000 peers onto an empty device, plexd vs `wg syncconf`
    (plexd is timed twice: the whole converge including one route per peer, and the device part alone:
    observe + diff + one UAPI transaction, which is what `wg syncconf` does);
  * a 1 % change (endpoints of 1 % of the peers) onto a full device;
  * RSS of a fresh process holding and converging 1,000 peers.

Run as root:  .venv/bin/python bench/converge_bench.py [--sizes 100,1000,5000] [--repeat 3]
`wg syncconf` is timed inside the node's namespace (date before and after, so the `ip netns exec` wrapper is not
counted against it).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from nacl.public import PrivateKey

from plexd.base.wgkeys import b64
from plexd.converge.engine import Engine
from plexd.devplane.lab import Lab, LabNode
from plexd.machine.links import DEFAULT_TABLE, Links
from plexd.machine.wireguard import DeviceUpdate
from plexd.machine.wireguard.kernel import KernelBackend
from plexd.machine.wireguard.userspace import UserspaceBackend
from plexd.mesh.mesh_plan import device_update, diff
from plexd.mesh.wireguard_domain import WireGuardDomain
from plexd.state.desired import DesiredState
from plexd.state.model import Peer

MESH = ipaddress.ip_network("10.128.0.0/10")


def make_desired(n: int, private_key: str) -> DesiredState:
    peers = []
    for i in range(n):
        pub = b64(bytes(PrivateKey(os.urandom(32)).public_key))
        ip = MESH[i + 2]
        peers.append(Peer(id=f"n_{i:05d}", public_key=pub, mesh_ip=str(ip),
                          endpoint=f"10.200.{i // 250}.{i % 250 + 1}:51820", allowed_ips=(f"{ip}/32",)))
    d = DesiredState.initial(interface="wg0", listen_port=51820, mtu=1420, private_key=private_key,
                             mesh_ip=str(MESH[1]))
    return d.with_peers(peers)


def change_one_percent(d: DesiredState) -> DesiredState:
    ids = sorted(d.peers)[:: 100]
    for pid in ids:
        d = d.with_peer_endpoint(pid, "10.201.0.1:" + str(40000 + int(pid[2:]) % 20000))
    return d


def wg_conf(d: DesiredState) -> str:
    lines = ["[Interface]", f"PrivateKey = {d.private_key}", f"ListenPort = {d.listen_port}"]
    for p in d.peers.values():
        lines += ["", "[Peer]", f"PublicKey = {p.public_key}", f"AllowedIPs = {', '.join(p.allowed_ips)}",
                  f"Endpoint = {p.endpoint}", f"PersistentKeepalive = {d.persistent_keepalive}"]
    return "\n".join(lines) + "\n"


_TIMED = 's=$(date +%s%N); "$@" || exit 1; e=$(date +%s%N); echo $((e - s))'


def timed_wg(node: LabNode, *args: str) -> float:
    """Wall time of one `wg` run, taken inside the node (the namespace wrapper is not counted)."""
    out = subprocess.run(node.wrap(["sh", "-c", _TIMED, "sh", "wg", *args]), check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[-1]) / 1e9


def device_of(conv: Engine) -> WireGuardDomain:
    return conv.domains[0]  # type: ignore[return-value]  # the bench's engine has this one domain


# Seconds to let the machine settle after emptying the device, before the next timed apply. Setting 1,000 peers'
# keepalive makes the kernel initiate 1,000 handshakes in its workqueue after the set returns (two Curve25519
# operations each: seconds on the kernel tier's emulated CPU); without a pause that work ran on into whichever
# apply was timed next, and the same medians moved by ±5 % from run to run.
SETTLE = {"kernel": 3.0, "userspace": 0.0}


async def reset(conv: Engine, node: LabNode, settle: float = 0.0) -> None:
    await device_of(conv).backend.apply(DeviceUpdate(replace_peers=True))
    subprocess.run(["ip", "-n", node.netns, "route", "flush", "dev", "wg0", "table", str(DEFAULT_TABLE)], check=False,
                   capture_output=True)
    await asyncio.sleep(settle)


async def device_only(conv: Engine, d: DesiredState) -> float:
    t = time.perf_counter()
    observed = await device_of(conv).read()
    await device_of(conv).backend.apply(device_update(diff(d, observed, time.time())))
    return time.perf_counter() - t


async def converge_time(conv: Engine, d: DesiredState) -> float:
    t = time.perf_counter()
    r = await conv.converge(d)
    dt = time.perf_counter() - t
    assert r.ok, r.errors
    return dt


def fmt(s: float) -> str:
    return f"{s * 1000:8.1f} ms"


def lab_backend(node: LabNode, kind: str) -> UserspaceBackend | KernelBackend:
    """wg0 in the node: wireguard-go (`userspace`), or the kernel's device (`kernel`, where the module is)."""
    if kind == "kernel":
        return KernelBackend("wg0", netns=node.netns)
    return UserspaceBackend("wg0", socket_dir=node.sock_dir, launch_prefix=node.wrap([]))


async def close_backend(backend: UserspaceBackend | KernelBackend) -> None:
    if isinstance(backend, KernelBackend):
        await backend.delete_device()
    else:
        await backend.close()


async def bench(sizes: list[int], repeat: int, kind: str = "userspace") -> None:
    with Lab().up(1) as lab:
        node = lab.nodes[0]
        backend = lab_backend(node, kind)
        conv = Engine([WireGuardDomain(backend, Links("wg0", netns=node.netns))])
        try:
            priv = b64(os.urandom(32))
            await conv.converge(make_desired(0, priv))  # device up, address, mtu
            conf_path = os.path.join(node.sock_dir, "bench.conf")  # visible inside as /run/wireguard/bench.conf
            if kind == "kernel":
                print(f"kernel WireGuard on {os.uname().release}; wg syncconf timed inside the namespace")
            else:
                version = subprocess.run(["wireguard-go", "--version"], capture_output=True,
                                         text=True).stdout.split()[1]
                print(f"wireguard-go {version}; wg syncconf timed inside the namespace")
            print(f"{'case':34} {'plexd converge':>15} {'plexd device':>14} {'wg syncconf':>13} "
                  f"{'ratio conv':>10} {'ratio dev':>9}")
            for n in sizes:
                d = make_desired(n, priv)
                with open(conf_path, "w") as f:
                    f.write(wg_conf(d))
                full, dev, sync = [], [], []
                for _ in range(repeat):
                    await reset(conv, node, SETTLE[kind])
                    full.append(await converge_time(conv, d))
                    await reset(conv, node, SETTLE[kind])
                    dev.append(await device_only(conv, d))
                    await reset(conv, node, SETTLE[kind])
                    sync.append(timed_wg(node, "syncconf", "wg0", "/run/wireguard/bench.conf"))
                await converge_time(conv, d)  # full device for the 1 % change
                assert len((await backend.observe()).peers) == n
                row(f"full apply, {n} peers", full, dev, sync)

                changed = change_one_percent(d)
                with open(conf_path + ".changed", "w") as f:
                    f.write(wg_conf(changed))
                full, dev, sync = [], [], []
                for _ in range(repeat):
                    await converge_time(conv, d)
                    full.append(await converge_time(conv, changed))
                    await converge_time(conv, d)
                    dev.append(await device_only(conv, changed))
                    await converge_time(conv, d)
                    sync.append(timed_wg(node, "syncconf", "wg0", "/run/wireguard/bench.conf.changed"))
                row(f"1 % change ({n // 100} peers) of {n}", full, dev, sync)
        finally:
            await close_backend(backend)


def row(name: str, full: list[float], dev: list[float], sync: list[float]) -> None:
    f, d, s = statistics.median(full), statistics.median(dev), statistics.median(sync)
    print(f"{name:34} {fmt(f):>15} {fmt(d):>14} {fmt(s):>13} {f / s:10.2f} {d / s:9.2f}", flush=True)


async def rss_child(n: int) -> None:
    """In a fresh process: build 1,000 peers, converge them onto a real device, report VmRSS."""
    with Lab().up(1) as lab:
        node = lab.nodes[0]
        backend = UserspaceBackend("wg0", socket_dir=node.sock_dir, launch_prefix=node.wrap([]))
        try:
            conv = Engine([WireGuardDomain(backend, Links("wg0", netns=node.netns))])
            d = make_desired(n, b64(os.urandom(32)))
            await converge_time(conv, d)
            d = replace(d)
            await converge_time(conv, d)  # a steady-state converge, as the reconciler runs it
            with open("/proc/self/status") as f:
                rss = next(line for line in f if line.startswith("VmRSS")).split()[1]
            print(f"RSS of a process holding and converging {n} peers: {int(rss) / 1024:.1f} MiB")
        finally:
            await backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000,5000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        asyncio.run(rss_child(args.rss_child))
        return
    asyncio.run(bench([int(s) for s in args.sizes.split(",")], args.repeat))
    subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", "1000"], check=True)


if __name__ == "__main__":
    main()
