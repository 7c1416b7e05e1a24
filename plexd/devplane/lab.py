"""A network-namespace lab: a bridge in a switch namespace of its own and N nodes, each in its own namespace.

Used by `plexd-devplane demo` and, as a pytest fixture, by the e2e tests. Every node has a veth to the bridge and
an address on a private test subnet (10.231.X.0/24, X picked free at random), and a private socket directory
that commands run through `LabNode.wrap()` see as `/run/wireguard` (docs/test-environment.md §2: `ip netns exec` already
unshares the mount namespace, so the bind mount never shows on the host). Names are `px<tag>...` and unique per
lab, so labs can run side by side. The root namespace (the devplane, the tests) reaches the bridge through a veth
of its own holding the subnet's first address.

The bridge is not in the root namespace because there the machine's own netfilter would see every frame it
bridges: with `br_netfilter` loaded, `bridge-nf-call-iptables` is on by default, so each crossing went through
the host's conntrack (and a host FORWARD policy of drop, as Docker sets, would cut the lab in pieces). In the
switch namespace nothing of the host's firewall applies to traffic between nodes, and plexd turns the calls off
there too where the kernel keeps them per namespace (5.3 and later).

Teardown is guaranteed and ordered (docs/test-environment.md §9): processes first (wireguard-go keeps a deleted
namespace alive), then the uplink, then the namespaces (the switch's takes the bridge and every bridge-side veth with
it), then links an older lab left in the root namespace, then files. A kept lab writes a state file so
`Lab.down_from_state()` (`plexd-devplane demo --down`) can remove it later.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from plexd.base.atomicfile import write_atomic
from plexd.base.errors import PlexdError
from plexd.base.procstat import process_stat
from plexd.config import datadir

_BIND_RUN_WIREGUARD = '[ -d /run/wireguard ] || mkdir -p /run/wireguard; mount --bind "$0" /run/wireguard && exec "$@"'
# Commands that need only the node's network namespace (not its /run/wireguard): entered with nsenter, one process
# instead of ip netns exec, sh, mkdir and mount. It matters where a process costs: a poll of `ip` or `ping` in a
# lab on an emulated CPU (the kernel tier).
_NET_ONLY = frozenset({"ip", "ping", "nft", "sysctl", "ss", "conntrack"})
DEFAULT_STATE_FILE = "/run/plexd-lab.json"


def _load_factor() -> float:
    """PLEXD_TEST_LOAD_FACTOR (tests, benches): a slow machine's waits last longer and look less often."""
    try:
        return max(1.0, float(os.environ.get("PLEXD_TEST_LOAD_FACTOR", "1")))
    except ValueError:
        return 1.0


class LabError(PlexdError):
    """The lab could not be built or removed."""


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=30 * _load_factor())
    if check and res.returncode != 0:
        raise LabError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


@dataclass
class LabNode:
    name: str
    netns: str
    address: str  # underlay address on the lab subnet
    veth: str  # host side
    sock_dir: str  # host path seen inside the node as /run/wireguard

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run inside the node's namespace with its private /run/wireguard; exec keeps the pid."""
        return ["ip", "netns", "exec", self.netns, "sh", "-c", _BIND_RUN_WIREGUARD, self.sock_dir, *cmd]

    def wrap_net(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run in the node's network namespace alone (for what needs no /run/wireguard)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", *cmd]


@dataclass
class LabRouter:
    """A NAT router namespace: `public` on the lab bridge, a LAN towards the nodes behind it, nft masquerade."""

    name: str
    netns: str
    public: str  # its address on the lab subnet (what the nodes behind it are seen as)
    lan: str  # the LAN prefix, e.g. 192.168.1.0/24
    behind: int = 0  # nodes placed behind it so far

    def nat_ruleset(self, snat: str = "masquerade") -> str:
        """The router's NAT table; `snat`: `masquerade` or `masquerade fully-random`.

        Like a home router it also drops unsolicited packets to itself from the public side. Without that, a
        peer's hole-punching packet that arrives before our node's first packet to that peer leaves a conntrack
        entry (peer → router:51820, refreshed by every retry) that makes masquerade map our node's flow to that
        peer to another port: the two NATs then never meet. A dropped packet's entry is never confirmed."""
        return ("table ip pxnat\ndelete table ip pxnat\ntable ip pxnat {\n chain postrouting {\n"
                "  type nat hook postrouting priority srcnat; policy accept;\n"
                f'  oifname "pub" {snat}\n }}\n chain input {{\n'
                "  type filter hook input priority filter; policy accept;\n"
                '  iifname "pub" ct state new drop\n }\n}\n')


@dataclass
class Lab:
    tag: str = field(default_factory=lambda: secrets.token_hex(3)[:5])
    workdir: str = ""
    subnet: str = ""
    nodes: list[LabNode] = field(default_factory=list)
    routers: list[LabRouter] = field(default_factory=list)
    stun_netns: str = ""  # the namespace of the STUN server (coturn), once started
    pids: list[int] = field(default_factory=list)
    starts: dict[int, int] = field(default_factory=dict)  # pid -> its start time: a reused pid is someone else's
    state_file: str | None = None
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _up: bool = False

    @property
    def bridge(self) -> str:
        return f"px{self.tag}br"

    @property
    def switch_netns(self) -> str:
        return f"px{self.tag}sw"

    @property
    def uplink(self) -> str:
        """The root namespace's veth to the bridge (its peer in the switch namespace is `host`)."""
        return f"px{self.tag}up"

    @property
    def bridge_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[1])

    # -- building -------------------------------------------------------------------------------------------

    def up(self, nodes: int = 0) -> Lab:
        try:
            self.workdir = self.workdir or tempfile.mkdtemp(prefix=f"px{self.tag}-")
            self.subnet = self.subnet or _free_subnet()
            self._up = True
            self._save()
            _run(["ip", "netns", "add", self.switch_netns])
            self._save()
            sw = ["ip", "-n", self.switch_netns]
            _run([*sw, "link", "add", self.bridge, "type", "bridge"])
            for table in ("iptables", "ip6tables", "arptables"):  # absent without br_netfilter: nothing to turn off
                _run(["ip", "netns", "exec", self.switch_netns, "sysctl", "-qw",
                      f"net.bridge.bridge-nf-call-{table}=0"], check=False)
            _run([*sw, "link", "set", self.bridge, "up"])
            _run(["ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "host", "netns", self.switch_netns])
            _run([*sw, "link", "set", "host", "master", self.bridge, "up"])
            _run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.uplink])
            _run(["ip", "link", "set", self.uplink, "up"])
            for _ in range(nodes):
                self.add_node()
        except BaseException:
            self.down()
            raise
        return self

    def add_node(self, behind: LabRouter | None = None) -> LabNode:
        """A node on the bridge, or on the LAN of a NAT router (`behind`)."""
        i = len(self.nodes) + 1
        if behind is not None:
            behind.behind += 1
            lan = ipaddress.ip_network(behind.lan)
            address = str(lan[1 + behind.behind])
        else:
            address = str(ipaddress.ip_network(self.subnet)[10 + i])
        node = LabNode(name=f"node{i}", netns=f"px{self.tag}n{i}", address=address, veth=f"px{self.tag}h{i}",
                       sock_dir=os.path.join(self.workdir, f"run-wireguard-{i}"))
        os.makedirs(node.sock_dir, mode=0o700, exist_ok=True)
        self.nodes.append(node)
        self._save()
        if behind is not None:
            self._behind_router(node, behind)
            return node
        self._on_bridge(node.netns, node.veth, "eth0", [node.address], default_route=False)
        return node

    def add_lan_host(self, gateway: LabNode, lan: str) -> LabNode:
        """A host on a LAN of its own behind `gateway` (a site's subnet): `lan`'s first address on the gateway's
        `lanN`, the second on the host, whose default route is the gateway. Nothing forwards it yet."""
        i = len(self.nodes) + 1
        net = ipaddress.ip_network(lan)
        host = LabNode(name=f"node{i}", netns=f"px{self.tag}n{i}", address=str(net[2]), veth=f"px{self.tag}h{i}",
                       sock_dir=os.path.join(self.workdir, f"run-wireguard-{i}"))
        os.makedirs(host.sock_dir, mode=0o700, exist_ok=True)
        self.nodes.append(host)
        self._save()
        _run(["ip", "netns", "add", host.netns])
        _run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", f"{host.veth}x"])
        _run(["ip", "link", "set", host.veth, "netns", gateway.netns])
        _run(["ip", "link", "set", f"{host.veth}x", "netns", host.netns])
        gns, ns = ["ip", "-n", gateway.netns], ["ip", "-n", host.netns]
        _run([*gns, "link", "set", host.veth, "name", f"lan{i}"])
        _run([*gns, "addr", "add", f"{net[1]}/{net.prefixlen}", "dev", f"lan{i}"])
        _run([*gns, "link", "set", f"lan{i}", "up"])
        _run([*ns, "link", "set", f"{host.veth}x", "name", "eth0"])
        _run([*ns, "addr", "add", f"{host.address}/{net.prefixlen}", "dev", "eth0"])
        _run([*ns, "link", "set", "eth0", "up"])
        _run([*ns, "link", "set", "lo", "up"])
        _run([*ns, "route", "add", "default", "via", str(net[1]), "dev", "eth0"])
        return host

    def add_router(self, snat: str = "masquerade") -> LabRouter:
        """A NAT router on the bridge (`add_node(behind=router)` puts nodes behind it)."""
        i = len(self.routers) + 1
        router = LabRouter(name=f"router{i}", netns=f"px{self.tag}r{i}",
                           public=str(ipaddress.ip_network(self.subnet)[100 + i]), lan=f"192.168.{i}.0/24")
        self.routers.append(router)
        self._save()
        self._on_bridge(router.netns, f"px{self.tag}q{i}", "pub", [router.public])
        _run(["ip", "netns", "exec", router.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        self.set_router_nat(router, snat)
        return router

    def set_router_nat(self, router: LabRouter, snat: str) -> None:
        """Replace the router's NAT rule (its existing conntrack mappings stay until they expire or its address
        changes)."""
        res = subprocess.run(["ip", "netns", "exec", router.netns, "nft", "-f", "-"], input=router.nat_ruleset(snat),
                             capture_output=True, text=True, timeout=30 * _load_factor())
        if res.returncode != 0:
            raise LabError(f"nft in {router.netns} failed: {res.stderr.strip()}")

    def renumber_router(self, router: LabRouter, host: int) -> str:
        """Give the router another public address (as an ISP does): masquerade drops the mappings of the old one."""
        new = str(ipaddress.ip_network(self.subnet)[host])
        ns = ["ip", "-n", router.netns]
        _run([*ns, "addr", "del", f"{router.public}/24", "dev", "pub"])  # takes the default route with it
        _run([*ns, "addr", "add", f"{new}/24", "dev", "pub"])
        _run([*ns, "route", "replace", "default", "via", self.bridge_address, "dev", "pub"])
        router.public = new
        self._save()
        return new

    def start_stun(self) -> tuple[str, str]:
        """coturn (STUN only) in its own namespace on the bridge, on two addresses (the second lets a node
        classify its NAT); returns them. docs/test-environment.md §4 has the command line."""
        assert not self.stun_netns, "one STUN server per lab"
        self.stun_netns = f"px{self.tag}s"
        self._save()
        net = ipaddress.ip_network(self.subnet)
        addrs = [str(net[2]), str(net[3])]
        self._on_bridge(self.stun_netns, f"px{self.tag}st", "eth0", addrs)
        sdir = os.path.join(self.workdir, "stun")
        os.makedirs(sdir, exist_ok=True)
        with open(os.path.join(sdir, "turnserver.log"), "w") as log:
            self.spawn(["ip", "netns", "exec", self.stun_netns, "turnserver", "-n", "--stun-only", "--no-cli",
                        "--no-tls", "--no-dtls", *[a for addr in addrs for a in ("-L", addr)], "-p", "3478",
                        "--log-file", "stdout", "--simple-log", "--no-software-attribute",
                        "--pidfile", os.path.join(sdir, "turn.pid"), "--userdb", os.path.join(sdir, "turndb")],
                       stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ss = _run(["ip", "netns", "exec", self.stun_netns, "ss", "-Hlun"], check=False).stdout
            if all(f"{a}:3478" in ss for a in addrs):
                return addrs[0], addrs[1]
            time.sleep(0.05)
        raise LabError("coturn did not start listening within 10s")

    def _on_bridge(self, netns: str, host_side: str, inside: str, addrs: Sequence[str], *,
                   default_route: bool = True) -> None:
        """Namespace `netns` on the lab bridge: a veth (`host_side` on the bridge, `inside` in the namespace with
        `addrs`), loopback up, and a default route via the bridge address unless told otherwise."""
        _run(["ip", "netns", "add", netns])
        _run(["ip", "link", "add", host_side, "netns", self.switch_netns, "type", "veth", "peer", "name",
              f"{host_side}x", "netns", netns])
        _run(["ip", "-n", self.switch_netns, "link", "set", host_side, "master", self.bridge, "up"])
        ns = ["ip", "-n", netns]
        _run([*ns, "link", "set", f"{host_side}x", "name", inside])
        for addr in addrs:
            _run([*ns, "addr", "add", f"{addr}/24", "dev", inside])
        _run([*ns, "link", "set", inside, "up"])
        _run([*ns, "link", "set", "lo", "up"])
        if default_route:
            _run([*ns, "route", "add", "default", "via", self.bridge_address, "dev", inside])

    def _behind_router(self, node: LabNode, router: LabRouter) -> None:
        lan = ipaddress.ip_network(router.lan)
        _run(["ip", "netns", "add", node.netns])
        _run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", f"{node.veth}x"])
        _run(["ip", "link", "set", node.veth, "netns", router.netns])
        _run(["ip", "link", "set", f"{node.veth}x", "netns", node.netns])
        rns, ns = ["ip", "-n", router.netns], ["ip", "-n", node.netns]
        lan_if = f"lan{router.behind}"
        _run([*rns, "link", "set", node.veth, "name", lan_if])
        if router.behind == 1:
            _run([*rns, "addr", "add", f"{lan[1]}/{lan.prefixlen}", "dev", lan_if])
        else:  # one LAN per router: the further nodes' veths join it through a bridge-less /32 route
            _run([*rns, "route", "add", f"{node.address}/32", "dev", lan_if])
        _run([*rns, "link", "set", lan_if, "up"])
        _run([*ns, "link", "set", f"{node.veth}x", "name", "eth0"])
        _run([*ns, "addr", "add", f"{node.address}/{lan.prefixlen}", "dev", "eth0"])
        _run([*ns, "link", "set", "eth0", "up"])
        _run([*ns, "link", "set", "lo", "up"])
        _run([*ns, "route", "add", "default", "via", str(lan[1]), "dev", "eth0"])

    def spawn(self, cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start a process the lab will stop at teardown (its own session, so we can signal its group)."""
        popen_kwargs.setdefault("start_new_session", True)
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(list(cmd), **popen_kwargs)
        self._procs.append(proc)
        self.pids.append(proc.pid)
        stat = process_stat(proc.pid)
        if stat is not None:
            self.starts[proc.pid] = stat.start_ticks
        self._save()
        return proc

    def exec(self, node: LabNode, cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a short command in the node (with its private /run/wireguard, unless it is a network tool that
        needs none) and return its output."""
        return _run(node.wrap_net(cmd) if os.path.basename(cmd[0]) in _NET_ONLY else node.wrap(cmd), check=check)

    # -- teardown -------------------------------------------------------------------------------------------

    def down(self) -> None:
        """Remove everything, in order, tolerating parts that are already gone."""
        if not self._up and not self.nodes:
            return
        procs = list(self._procs)
        for p in procs:
            _signal_group(p.pid, signal.SIGTERM)
        _wait_all(procs, 5.0)
        for p in procs:
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(2)
        for pid in self.pids:  # pids from a state file (no Popen): only while still the process the lab started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                stat = process_stat(pid)
                if stat is not None and stat.alive and self.starts.get(pid) == stat.start_ticks:
                    os.killpg(pid, signal.SIGKILL)
        # Anything still living in a namespace (e.g. a wireguard-go started by a killed daemon).
        namespaces = [n.netns for n in self.nodes] + [r.netns for r in self.routers]
        namespaces += [self.stun_netns] if self.stun_netns else []
        for netns in [self.switch_netns, *namespaces]:  # a process left in one keeps it alive after `netns del`
            _kill_netns_pids(netns)
        # The switch namespace holds the bridge and the bridge side of every veth: deleting it removes them all,
        # and with them their peers. A lab from before the switch namespace had them in the root namespace.
        _run(["ip", "link", "del", self.uplink], check=False)
        for netns in [self.switch_netns, *namespaces]:
            _run(["ip", "netns", "del", netns], check=False)
        uplinks = [f"px{self.tag}q{i}" for i in range(1, len(self.routers) + 1)]
        for link in [n.veth for n in self.nodes] + uplinks + ([f"px{self.tag}st"] if self.stun_netns else []):
            if os.path.exists(f"/sys/class/net/{link}"):
                _run(["ip", "link", "del", link], check=False)
        if os.path.exists(f"/sys/class/net/{self.bridge}"):
            _run(["ip", "link", "del", self.bridge], check=False)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self.state_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.state_file)
        self._procs.clear()
        self._up = False

    def leaks(self) -> list[str]:
        """What of this lab still exists (for tests' leak checks)."""
        found = []
        netns = _run(["ip", "netns", "list"], check=False).stdout
        found += [f"netns {n.split()[0]}" for n in netns.splitlines() if n.startswith(f"px{self.tag}")]
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
        found += [f"link {line.split(':')[1].strip().split('@')[0]}" for line in links.splitlines()
                  if f"px{self.tag}" in line]
        found += [f"process {pid}" for pid in self.pids if _alive(pid)]
        if self.workdir and os.path.exists(self.workdir):
            found.append(f"directory {self.workdir}")
        return found

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- state file -----------------------------------------------------------------------------------------

    def _save(self) -> None:
        if not self.state_file:
            return
        data = {"tag": self.tag, "workdir": self.workdir, "subnet": self.subnet, "pids": self.pids,
                "starts": {str(pid): ticks for pid, ticks in self.starts.items()},
                "nodes": [asdict(n) for n in self.nodes], "routers": [asdict(r) for r in self.routers],
                "stun_netns": self.stun_netns}
        write_atomic(Path(self.state_file), json.dumps(data, indent=2).encode(), mode=0o644)

    @classmethod
    def down_from_state(cls, state_file: str = DEFAULT_STATE_FILE) -> bool:
        """Remove a kept lab described by `state_file`. False when there is none."""
        try:
            with open(state_file) as f:
                data = json.load(f)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:
            raise LabError(f"cannot read lab state {state_file}: {e}") from None
        lab = cls(tag=data["tag"], workdir=data.get("workdir", ""), subnet=data.get("subnet", ""),
                  nodes=[LabNode(**n) for n in data.get("nodes", [])], pids=list(data.get("pids", [])),
                  starts={int(pid): int(ticks) for pid, ticks in (data.get("starts") or {}).items()},
                  routers=[LabRouter(**r) for r in data.get("routers", [])], stun_netns=data.get("stun_netns", ""),
                  state_file=state_file, _up=True)
        lab.down()
        return True


def _alive(pid: int) -> bool:
    stat = process_stat(pid)
    return stat is not None and stat.alive


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))


def _kill_netns_pids(netns: str) -> None:
    def pids() -> list[int]:
        out = _run(["ip", "netns", "pids", netns], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        current = pids()
        if not current:
            return
        for pid in current:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in current):
            time.sleep(0.02)


def _free_subnet() -> str:
    used = _run(["ip", "-o", "addr", "show"], check=False).stdout
    for _ in range(100):
        octet = secrets.randbelow(254) + 1
        net = f"10.231.{octet}.0/24"
        if f"10.231.{octet}." not in used:
            return net
    raise LabError("no free 10.231.X.0/24 lab subnet")


# --- the mesh on top of the lab: the devplane on the bridge, `plexd up` in every node -----------------------


@dataclass
class LabDaemon:
    node: LabNode
    dir: str
    proc: subprocess.Popen
    discovers: bool = False  # NAT discovery on: the node reports its own endpoint

    def _identity(self, key: str) -> str | None:
        """A field of the daemon's identity.json; None until it has registered."""
        try:
            with open(os.path.join(self.dir, "data", datadir.IDENTITY)) as f:
                return json.load(f)[key]
        except (OSError, ValueError, KeyError):
            return None

    @property
    def node_id(self) -> str | None:
        return self._identity("node_id")

    @property
    def mesh_ip(self) -> str | None:
        return self._identity("mesh_ip")

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(os.path.join(self.dir, "plexd.log")) as f:
                return f.read()[-n:]
        except OSError:
            return ""


class MeshLab:
    """Runs the real devplane on the lab bridge and a real `plexd up` in each node namespace (each with its
    private /run/wireguard). Everything is spawned through the `Lab`, so its teardown (or `--down`) stops it.

    Until NAT discovery reports endpoints, the lab plays the operator and tells the devplane each node's lab
    address (`set_node_endpoint`), which the devplane pushes to the other nodes as `peer_endpoint_changed`.
    """

    LISTEN_PORT = 51820

    def __init__(self, lab: Lab, *, reconcile: str = "60s", heartbeat: str = "5s", plexd: str | None = None,
                 dialect: str = "spec") -> None:
        import sys

        self.lab = lab
        self.dialect = dialect  # the contract the devplane and every node speak: "spec" or "platform"
        self.reconcile = reconcile
        self.heartbeat = heartbeat
        self.plexd = plexd or os.path.join(os.path.dirname(sys.executable), "plexd")
        self.python = sys.executable
        self.daemons: list[LabDaemon] = []
        self.url = ""
        self.admin = None  # plexd.devplane.harness.AdminClient once started
        self._endpoint_set: set[str] = set()

    def start_devplane(self, timeout: float = 20.0) -> str:
        from plexd.devplane.harness import AdminClient

        timeout *= _load_factor()

        ddir = os.path.join(self.lab.workdir, "devplane")
        os.makedirs(ddir, exist_ok=True)
        log_path = os.path.join(ddir, "devplane.log")
        with open(log_path, "w") as log:
            self.lab.spawn([self.python, "-m", "plexd.devplane.devplane_cli", "serve", "--listen",
                            f"{self.lab.bridge_address}:0", "--db", os.path.join(ddir, "devplane.db"),
                            *(["--dialect", self.dialect] if self.dialect != "spec" else [])],
                           stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(log_path) as f:
                for line in f:
                    if line.startswith("plexd-devplane listening on "):
                        self.url = line.split()[-1]
                        break
            if self.url:
                break
            time.sleep(0.05)
        if not self.url:
            with open(log_path) as f:
                raise LabError(f"the devplane did not start within {timeout:.0f}s: {f.read()[-500:]}")
        with open(os.path.join(ddir, "devplane.db.admin-token")) as f:
            self.admin = AdminClient(self.url, f.read().strip())
        self._release_key()
        return self.url

    @property
    def release_key_file(self) -> str:
        """The lab's demo release key (kept in its devplane directory): what signs the releases it publishes,
        pinned in every lab node's upgrade.release_keys."""
        return os.path.join(self.lab.workdir, "devplane", "release.key")

    def _release_key(self):  # -> nacl.signing.SigningKey
        from plexd.upgrade import signing

        if os.path.exists(self.release_key_file):
            return signing.load_signing_key(self.release_key_file)
        return signing.write_signing_key(self.release_key_file)

    def _public_release_key(self) -> str:
        from plexd.upgrade import signing

        return signing.public_key(self._release_key())

    def publish_release(self, version: str) -> str:
        """Build a release of this checkout as `version`, sign it with the demo key, store both in the devplane;
        returns its checksum."""
        from plexd.upgrade import signing, zipapp

        assert self.admin is not None, "start_devplane() first"
        path = os.path.join(self.lab.workdir, "devplane", f"plexd-{version}.pyz")
        checksum = zipapp.build(path, version=version)
        with open(path, "rb") as f:
            self.admin.put_artifact(version, f.read(), signature=signing.sign(self._release_key(), version, checksum))
        return checksum

    def start_node(self, node: LabNode, mesh_extra: str = "", *, stun: Sequence[str] = (),
                   nat_extra: str = "", extra: str = "", backend: str = "userspace") -> LabDaemon:
        """`plexd up` in `node`; `mesh_extra` (", key: value") extends its `mesh:` config (tests). With `stun`
        servers the node discovers and reports its own endpoint (`nat_extra` extends `nat_traversal:`); without,
        the lab reports it (`publish_endpoints`). `extra`: more top-level config lines (`mode: bridge\n`).
        `backend`: its WireGuard backend (wireguard-go by default; "kernel" where the kernel has the module)."""
        assert self.admin is not None, "start_devplane() first"
        ndir = os.path.join(self.lab.workdir, node.name)
        os.makedirs(ndir, exist_ok=True)
        token = os.path.join(ndir, "token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self.admin.create_token())
        config = os.path.join(ndir, "config.yaml")
        with open(config, "w") as f:
            # No api.dialect: the node finds the contract itself (auto), from its token and the devplane's answer.
            f.write(f"api: {{url: {self.url}, allow_insecure: true}}\ndata_dir: {ndir}/data\n"
                    f"token: {{file: {token}}}\n"
                    f"hooks: {{dir: {ndir}/hooks}}\n"
                    f"mesh: {{interface: plexd0, backend: {backend}, listen_port: {self.LISTEN_PORT}{mesh_extra}}}\n"
                    f"reconcile: {{interval: {self.reconcile}}}\nheartbeat: {{interval: {self.heartbeat}}}\n"
                    f"registration: {{hostname: {node.name}}}\nnode_api: {{socket_path: {ndir}/api.sock}}\n"
                    f"upgrade: {{dir: {ndir}/releases, release_keys: ['{self._public_release_key()}']}}\n")
            if stun:
                f.write(f"nat_traversal: {{stun_servers: [{', '.join(stun)}]{nat_extra}}}\n")
            f.write(extra)
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "PLEXD_CONFIG": config}
        with open(os.path.join(ndir, "plexd.log"), "w") as log:
            proc = self.lab.spawn(node.wrap([self.plexd, "up"]), env=env, stdout=log, stderr=subprocess.STDOUT)
        daemon = LabDaemon(node, ndir, proc, discovers=bool(stun))
        self.daemons.append(daemon)
        return daemon

    def run_plexd(self, d: LabDaemon, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`plexd ARGS` inside the daemon's node with its config: what an operator on that machine types."""
        return self.lab.exec(d.node, ["env", f"PLEXD_CONFIG={os.path.join(d.dir, 'config.yaml')}", self.plexd,
                                      *args], check=check)

    def publish_endpoints(self) -> None:
        """Tell the devplane where each registered node listens (the NAT-discovery stand-in, see the class doc)."""
        assert self.admin is not None
        for d in self.daemons:
            nid = d.node_id
            if nid and nid not in self._endpoint_set and not d.discovers:
                self.admin.set_node_endpoint(nid, f"{d.node.address}:{self.LISTEN_PORT}")
                self._endpoint_set.add(nid)

    def wg_dump(self, node: LabNode) -> dict[str, dict]:
        """public key -> {endpoint, allowed_ips, latest_handshake, rx, tx}, as `wg show plexd0 dump` sees it."""
        res = self.lab.exec(node, ["wg", "show", "plexd0", "dump"], check=False)
        if res.returncode != 0:
            return {}
        out = {}
        for line in res.stdout.splitlines()[1:]:
            f = line.split("\t")
            out[f[0]] = {"endpoint": f[2], "allowed_ips": f[3], "latest_handshake": int(f[4]), "rx": int(f[5]),
                         "tx": int(f[6])}
        return out

    def wait(self, pred, timeout: float, what: str) -> float:
        start = time.monotonic()
        pause = 0.1 * _load_factor()
        while time.monotonic() - start < timeout:
            self.publish_endpoints()
            for d in self.daemons:
                if d.proc.poll() is not None:
                    raise LabError(f"plexd up in {d.node.name} exited ({d.proc.returncode}): {d.log_tail(1500)}")
            if pred():
                return time.monotonic() - start
            time.sleep(pause)
            # a long wait looks less often: each look spawns tools, which an emulated CPU pays dearly for
            pause = min(pause * 1.25, 0.4 * _load_factor())
        logs = "\n".join(f"--- {d.node.name}\n{d.log_tail()}" for d in self.daemons)
        raise LabError(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")

    def full_handshake_matrix(self) -> bool:
        """Every node has a handshake with every other node."""
        n = len(self.daemons)
        for d in self.daemons:
            dump = self.wg_dump(d.node)
            if len(dump) != n - 1 or not all(p["latest_handshake"] > 0 for p in dump.values()):
                return False
        return True

    def status_rows(self) -> list[list[str]]:
        now = time.time()
        rows = []
        for d in self.daemons:
            dump = self.wg_dump(d.node)
            latest = max((p["latest_handshake"] for p in dump.values()), default=0)
            rows.append([d.node.name, d.node_id or "-", d.mesh_ip or "-", f"{d.node.address}:{self.LISTEN_PORT}",
                         str(len(dump)), f"{now - latest:.0f}s ago" if latest else "never"])
        return rows

    def ping_matrix(self, count: int = 1, wait: int = 3) -> dict[tuple[str, str], bool]:
        """(from node, to node) -> ping over the mesh IP succeeded."""
        out = {}
        for a in self.daemons:
            for b in self.daemons:
                if a is b or not b.mesh_ip:
                    continue
                res = self.lab.exec(a.node, ["ping", "-c", str(count), "-W", str(wait), "-q", b.mesh_ip],
                                    check=False)
                out[(a.node.name, b.node.name)] = res.returncode == 0
        return out

    def close(self) -> None:
        if self.admin is not None:
            self.admin.close()
