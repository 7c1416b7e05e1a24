"""Shared parts of the relay lab test and bench: a relay process on the lab's public side, and plain
wireguard-go pairs behind random-port masquerading routers, configured with `wg set` (no plexd daemon)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

from mesh_helpers import keypair
from waiting import pauses, scaled

from plexd.devplane.lab import Lab, LabNode, LabRouter

RELAY_PORT = 51821
RANDOM_NAT = "masquerade random,fully-random"


class RelayProcess:
    """`python -m plexd.bridge.standalone` in a lab node on the bridge, one JSON command per line."""

    def __init__(self, lab: Lab, node: LabNode) -> None:
        self.node = node
        self.address = f"{node.address}:{RELAY_PORT}"
        self.proc = lab.spawn(node.wrap([sys.executable, "-m", "plexd.bridge.standalone", "--listen",
                                         f"0.0.0.0:{RELAY_PORT}"]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = self._read(15)
        assert first.get("ok") and first.get("port") == RELAY_PORT, first

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"the relay did not answer within {timeout}s (exit status {self.proc.poll()})"
        line = self.proc.stdout.readline()
        assert line, f"the relay closed its output (exit status {self.proc.poll()})"
        return json.loads(line)

    def command(self, doc: dict) -> dict:
        self.proc.stdin.write(json.dumps(doc) + "\n")
        self.proc.stdin.flush()
        return self._read(10)

    def status(self) -> dict:
        return self.command({"status": True})

    def session(self, sid: str) -> dict:
        return next(s for s in self.status()["sessions"] if s["session_id"] == sid)


@dataclass
class WgEnd:
    node: LabNode
    router: LabRouter
    mesh_ip: str
    private_key: str
    public_key: str


def start_wireguard(lab: Lab, end: WgEnd, backend: str = "userspace") -> None:
    """wg0 in the end's node: wireguard-go, or (`backend="kernel"`) the kernel's device."""
    if backend == "kernel":
        lab.exec(end.node, ["ip", "link", "add", "wg0", "type", "wireguard"])
    else:
        lab.spawn(end.node.wrap(["wireguard-go", "-f", "wg0"]), env={**os.environ, "WG_PROCESS_FOREGROUND": "1"},
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sock = os.path.join(end.node.sock_dir, "wg0.sock")
        wait(lambda: os.path.exists(sock), 10, f"wireguard-go's socket {sock}")
    keyfile = os.path.join(end.node.sock_dir, "private.key")  # the lab's 0700 directory, removed with it
    with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(end.private_key + "\n")
    lab.exec(end.node, ["wg", "set", "wg0", "private-key", keyfile, "listen-port", "51820"])
    lab.exec(end.node, ["ip", "addr", "add", f"{end.mesh_ip}/32", "dev", "wg0"])
    lab.exec(end.node, ["ip", "link", "set", "wg0", "up"])


def point_at(lab: Lab, end: WgEnd, other: WgEnd, endpoint: str) -> None:
    lab.exec(end.node, ["wg", "set", "wg0", "peer", other.public_key, "endpoint", endpoint,
                        "allowed-ips", f"{other.mesh_ip}/32", "persistent-keepalive", "1"])
    lab.exec(end.node, ["ip", "route", "replace", f"{other.mesh_ip}/32", "dev", "wg0"])


def nat_pair(lab: Lab, k: int, snat: str = RANDOM_NAT, backend: str = "userspace") -> tuple[WgEnd, WgEnd]:
    """Two WireGuard nodes (wireguard-go, or the kernel's), each behind its own router (`snat`), not yet pointed
    anywhere."""
    ends = []
    for side in (1, 2):
        router = lab.add_router(snat)
        node = lab.add_node(behind=router)
        priv, pub = keypair()
        end = WgEnd(node, router, f"10.77.{k}.{side}", priv, pub)
        start_wireguard(lab, end, backend)
        ends.append(end)
    return ends[0], ends[1]


def session_doc(sid: str, a: WgEnd, b: WgEnd, expires_in: float = 3600) -> dict:
    """What a control plane would list: each node's router with the WireGuard port, which a port-randomising
    NAT never uses towards the relay (the relay must learn the real ports), and the ends' public keys (they are
    no bridge's peers: the relay checks their handshakes' mac1 with these)."""
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + expires_in))
    return {"session_id": sid, "peer_a_id": f"n_{sid}_a", "peer_a_endpoint": f"{a.router.public}:51820",
            "peer_b_id": f"n_{sid}_b", "peer_b_endpoint": f"{b.router.public}:51820", "expires_at": expires,
            "peer_a_public_key": a.public_key, "peer_b_public_key": b.public_key}


def ping(lab: Lab, end: WgEnd, ip: str, count: int = 3) -> subprocess.CompletedProcess[str]:
    return lab.exec(end.node, ["ping", "-c", str(count), "-i", "0.2", "-W", "2", ip], check=False)


def flush_conntrack(router: LabRouter) -> None:
    """The router forgets its NAT mappings (as after a reboot or a timeout): the next packet gets a new random
    port. `conntrack -F` through pyroute2 (the conntrack tool is not installed)."""
    subprocess.run(["ip", "netns", "exec", router.netns, sys.executable, "-c",
                    "from pyroute2 import Conntrack; Conntrack().flush()"], check=True, timeout=30)


def wait(pred, timeout: float, what: str) -> None:
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    last = None
    for pause in pauses():
        if time.monotonic() >= deadline:
            break
        last = pred()
        if last:
            return
        time.sleep(pause)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def kernel_forwarded(lab: Lab, relay: RelayProcess) -> int:
    """Packets the fast path's prerouting rule rewrote (its counter, read with nft in the relay's namespace)."""
    out = subprocess.run(["ip", "netns", "exec", relay.node.netns, "nft", "-j", "list", "chain", "inet",
                          "plexd_relay", "prerouting"], capture_output=True, text=True, timeout=30, check=True).stdout
    for item in json.loads(out)["nftables"]:
        for expr in item.get("rule", {}).get("expr", []):
            if "counter" in expr:
                return int(expr["counter"]["packets"])
    raise AssertionError(f"no counter in the fast path rule: {out}")


def fastpath_elements(lab: Lab, relay: RelayProcess) -> str:
    return subprocess.run(["ip", "netns", "exec", relay.node.netns, "nft", "list", "map", "inet", "plexd_relay",
                           "fwd_port"], capture_output=True, text=True, timeout=30, check=True).stdout


def relay_tables(relay: RelayProcess) -> str:
    return subprocess.run(["ip", "netns", "exec", relay.node.netns, "nft", "list", "tables"], capture_output=True,
                          text=True, timeout=30, check=True).stdout


def relay_forwards(relay: RelayProcess) -> None:
    """The relay host forwards IPv4 (the fast path routes rewritten packets) without redirecting the routers."""
    for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0", "net.ipv4.conf.eth0.send_redirects=0"):
        subprocess.run(["ip", "netns", "exec", relay.node.netns, "sysctl", "-qw", key], check=True, timeout=30)
