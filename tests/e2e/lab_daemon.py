"""The e2e lab's helpers: a real `plexd up` in a lab node (`Daemon`), and what the tests check with the real
tools (`wg show`, `ping`, /proc). The `lab_dp` fixture (a lab plus a devplane on its bridge) is in conftest.py."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from nacl.public import PrivateKey
from waiting import pauses, scaled

from plexd.base.wgkeys import public_key_of
from plexd.devplane.harness import Devplane
from plexd.devplane.lab import Lab, LabNode, MeshLab

PLEXD = str(Path(sys.executable).with_name("plexd"))
# The kernel tier's daemons run without telemetry (the host's labs test it): on the VM's emulated CPU its collection
# costs what the tests need for the kernel's parts.
TIER_CONFIG = ("telemetry: {metrics: {enabled: false}, logs: {enabled: false}, audit: {enabled: false}}\n"
               if os.environ.get("PLEXD_KERNEL_VM") == "1" else "")


class Daemon:
    def __init__(self, lab: Lab, node: LabNode, dp: Devplane, workdir: Path, reconcile: str,
                 extra_config: str = "", env: dict[str, str] | None = None, node_api: str = "",
                 backend: str = "userspace") -> None:
        self.lab = lab
        self.node = node
        self.backend = backend
        self.dir = workdir / node.name
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "token").write_text(dp.admin.create_token())
        api = node_api if "socket_path" in node_api else f"socket_path: {self.dir / 'api.sock'}"
        self.api_socket = Path(re.search(r"socket_path:\s*([^,}\s]+)", api).group(1))
        self.config = self.dir / "config.yaml"
        # No api.dialect: every lab node finds the contract itself (auto), from its token and the devplane's answer.
        self.config.write_text(
            f"api: {{url: {dp.url}, allow_insecure: true}}\n"  # the devplane serves plain HTTP
            f"data_dir: {self.dir / 'data'}\ntoken: {{file: {self.dir / 'token'}}}\n"
            f"hooks: {{dir: {self.dir / 'hooks'}}}\nmesh: {{interface: plexd0, backend: {backend}}}\n"
            f"reconcile: {{interval: {reconcile}}}\nheartbeat: {{interval: 2s}}\n"
            "registration: {hostname: " + node.name + "}\n"
            f"node_api: {{{api}}}\n" + TIER_CONFIG + extra_config)
        self.extra_env = env or {}
        self.runs = 0
        self._start()

    def _start(self) -> None:
        self.runs += 1
        self.log_path = self.dir / ("plexd.log" if self.runs == 1 else f"plexd-{self.runs}.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        # systemd forced off: a purge in a test must never reach the host's own plexd.service
        # PYTHONFAULTHANDLER: a daemon a test gives up on prints its threads' stacks (`dump_stacks`)
        env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(self.config), "PLEXD_TEST_NO_SYSTEMD": "1",
               "PYTHONFAULTHANDLER": "1", **self.extra_env}
        self.proc = self.lab.spawn(self.node.wrap([PLEXD, "up"]), env=env, stdout=self.log,
                                   stderr=subprocess.STDOUT)

    def restart(self, main_only: bool = False) -> None:
        self.stop(main_only)
        self._start()

    def stop(self, main_only: bool = False) -> float:
        """SIGTERM, wait for the exit (SIGKILL after 20 s); returns how long the shutdown took. `main_only`: the
        signal goes to plexd alone, as systemd's KillMode=mixed sends it, so the wireguard-go it started (and a
        stop that keeps the tunnels) survives; otherwise to the whole process group."""
        start = time.monotonic()
        if self.proc.poll() is None:
            if main_only:
                os.kill(self.proc.pid, signal.SIGTERM)
            else:
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if not self.log.closed:
            self.log.close()
        return time.monotonic() - start

    def api_listening(self) -> bool:
        """Whether the node API socket accepts a connection (the file alone may be a previous run's)."""
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1)
            s.connect(str(self.api_socket))
            return True
        return False

    def logged(self) -> str:
        return self.log_path.read_text()

    def dump_stacks(self) -> str:
        """For a failure message: where each thread of a daemon that is still running is (SIGABRT makes
        faulthandler print the stacks, and ends the daemon: only ever done once a test has failed), or how it
        ended."""
        if self.proc.poll() is not None:
            return f"(not running: it exited with status {self.proc.returncode})"
        before = len(self.logged())
        os.kill(self.proc.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        return self.logged()[before:][-4000:]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`plexd ARGS` with this daemon's config, in its node (as an operator on that machine would)."""
        res = self.lab.exec(self.node, ["env", f"PLEXD_CONFIG={self.config}", "PLEXD_TEST_NO_SYSTEMD=1", PLEXD, *args],
                            check=False)
        if check and res.returncode != 0:
            raise AssertionError(f"plexd {' '.join(args)} exited {res.returncode}: {res.stderr}")
        return res

    def status(self) -> dict:
        """`plexd status --json` of the running daemon. Until its node API listens (at a start or a restart) the
        CLI answers from stored files, without the live sections: wait for it a little first."""
        deadline = time.monotonic() + scaled(15)
        while not self.api_listening() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return json.loads(self.cli("status", "--json").stdout)

    def mesh_ip(self) -> str | None:
        ident = self.dir / "data" / "identity.json"
        return json.loads(ident.read_text())["mesh_ip"] if ident.exists() else None

    def node_id(self) -> str | None:
        ident = self.dir / "data" / "identity.json"
        if not ident.exists():
            return None
        return json.loads(ident.read_text())["node_id"]


def connects(lab: Lab, node: LabNode, ip: str, port: int, timeout: float = 1.5) -> bool:
    """Whether a TCP connection from `node` to ip:port is accepted (a drop times out, a reset fails fast)."""
    code = f"import socket; socket.create_connection(({ip!r}, {port}), timeout={timeout}); print('ok')"
    return lab.exec(node, [sys.executable, "-c", code], check=False).stdout.strip() == "ok"


def wg_peers(lab: Lab, node: LabNode) -> dict[str, str]:
    """public key -> endpoint, as `wg show plexd0 dump` sees the live device."""
    out = lab.exec(node, ["wg", "show", "plexd0", "dump"], check=False)
    if out.returncode != 0:
        return {}
    lines = out.stdout.splitlines()[1:]
    return {f[0]: f[2] for f in (line.split("\t") for line in lines)}


def wait_until(pred, timeout: float, what: str, daemons=(), evidence=None) -> float:
    """Wait for `pred()`; on giving up, fail naming `what` with the daemons' log tails, their devices and what
    `evidence()` adds. `timeout` is stretched by the suite's load factor (tests/waiting.py)."""
    timeout = scaled(timeout)
    start = time.monotonic()
    for pause in pauses():
        if time.monotonic() - start >= timeout:
            break
        if pred():
            return time.monotonic() - start
        time.sleep(pause)
    logs = "\n".join(f"--- {d.node.name}\n{d.logged()[-3000:]}\n--- {d.node.name}: wg show (public fields)\n"
                     f"{_device(d)}" for d in daemons)
    extra = f"\n--- evidence\n{evidence()}" if evidence is not None else ""
    stacks = "".join(f"\n--- {d.node.name}: stacks\n{dump}" for d in daemons if (dump := d.dump_stacks()))
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}{extra}{stacks}")


def _device(d: Daemon) -> str:
    """The live device's peers for a failure message: public key, endpoint, allowed IPs, handshake, rx, tx. The
    interface line (private key) and the preshared keys are left out."""
    res = d.lab.exec(d.node, ["wg", "show", "plexd0", "dump"], check=False)
    if res.returncode != 0:
        return f"(wg show failed: {res.stderr.strip()})"
    peers = [line.split("\t") for line in res.stdout.splitlines()[1:]]
    return "\n".join("\t".join([f[0], *f[2:]]) for f in peers) or "(no peers)"


def start_mesh(lab, dp, daemons, tmp_path, reconcile: str, count: int = 3) -> None:
    for node in lab.nodes[:count]:
        daemons.append(Daemon(lab, node, dp, tmp_path, reconcile))
    keys = lambda: {n["public_key"] for n in dp.admin.nodes()}  # noqa: E731
    wait_until(lambda: len(dp.admin.nodes()) == count, 30, "registration", daemons)
    for d in daemons:
        wait_until(lambda d=d: len(wg_peers(lab, d.node)) == count - 1 and set(wg_peers(lab, d.node)) < keys(),
                   30, f"{d.node.name} to list the other nodes", daemons)


def register_ghost(dp: Devplane, hostname: str) -> tuple[dict, str]:
    """A node that exists only in the control plane (no tunnel, so no handshake protects its endpoint)."""
    token = dp.admin.create_token()
    pub = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
    r = httpx.post(f"{dp.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                   json={"token": token, "public_key": pub, "hostname": hostname}, timeout=10)
    r.raise_for_status()
    return r.json(), pub


def wg_endpoint(lab: Lab, node: LabNode, key: str) -> str | None:
    return wg_peers(lab, node).get(key)


def publish_endpoints(dp: Devplane, daemons) -> None:
    """The lab plays the operator until NAT discovery exists: each node's lab address becomes its endpoint,
    which the devplane pushes to the others as peer_endpoint_changed (a real event for each)."""
    for d in daemons:
        dp.admin.set_node_endpoint(d.node_id(), f"{d.node.address}:51820")


def ping_count(lab: Lab, node: LabNode, ip: str, count: int, interval: float = 0.5) -> int:
    out = lab.exec(node, ["ping", "-c", str(count), "-i", str(interval), "-W", "1", "-q", ip], check=False).stdout
    return int(out.split(" received")[0].rsplit(" ", 1)[-1]) if " received" in out else 0


def ping_during(lab: Lab, src: LabNode, dst_ip: str, count: int, during):
    """Ping `dst_ip` from `src` `count` times at 10 per second, calling `during()` once the first echo came back.
    Returns what `during` returned, then how many echoes were lost and sent."""
    ping = lab.spawn(src.wrap(["ping", "-n", "-c", str(count), "-i", "0.1", "-W", "1", dst_ip]),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert ping.stdout is not None
        seen = []
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline:  # the first answer: the tunnel carries traffic before `during`
            line = ping.stdout.readline()
            seen.append(line)
            if "bytes from" in line or not line:
                break
        if not any("bytes from" in line for line in seen):
            raise AssertionError(f"no first echo from {dst_ip} before the change: {''.join(seen)}")
        result = during()
        rest, _ = ping.communicate(timeout=count / 10 + 30)
        out = "".join(seen) + rest
    finally:
        if ping.poll() is None:
            ping.kill()
            ping.wait()
    counts = re.search(r"(\d+) packets transmitted, (\d+) received", out)
    if counts is None:
        raise AssertionError(f"ping printed no summary: {out}")
    sent, received = map(int, counts.groups())
    return result, sent - received, sent


def wireguard_go_pids(lab: Lab, node: LabNode) -> list[int]:
    """wireguard-go processes serving plexd0 in the node's network namespace, read from /proc here (a shell loop
    in the node, which spawned three programs per process, took over 30 s on the kernel tier's emulated CPU)."""
    netns = os.stat(f"/run/netns/{node.netns}")
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ns = os.stat(proc / "ns" / "net")
            args = (proc / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if (ns.st_dev, ns.st_ino) == (netns.st_dev, netns.st_ino) and len(args) >= 3 \
                and args[-2:] == [b"-f", b"plexd0"] and args[-3].endswith(b"wireguard-go"):
            pids.append(int(proc.name))
    return sorted(pids)


def pinging_pair(lab: Lab, dp: Devplane, daemons: list[Daemon], workdir: Path, reconcile: str = "2s",
                 a_env: dict[str, str] | None = None, a_config: str = "",
                 backends: tuple[str, str] = ("userspace", "userspace")) -> tuple[Daemon, Daemon]:
    """Two nodes, a and b, that see each other, know each other's endpoints and ping through the tunnel; their
    WireGuard backends are `backends`."""
    a = Daemon(lab, lab.nodes[0], dp, workdir, reconcile=reconcile, env=a_env, extra_config=a_config,
               backend=backends[0])
    b = Daemon(lab, lab.nodes[1], dp, workdir, reconcile=reconcile, backend=backends[1])
    daemons += [a, b]
    wait_until(lambda: a.mesh_ip() and b.mesh_ip() and len(wg_peers(lab, a.node)) == 1
               and len(wg_peers(lab, b.node)) == 1, 30, "the two nodes to see each other", daemons)
    keys = {n["id"]: n["public_key"] for n in dp.admin.nodes()}
    a_key, b_key = keys[a.node_id()], keys[b.node_id()]
    publish_endpoints(dp, [a, b])
    started = time.monotonic()

    def endpoints_on_both() -> bool:
        return (wg_endpoint(lab, a.node, b_key) == f"{b.node.address}:51820"
                and wg_endpoint(lab, b.node, a_key) == f"{a.node.address}:51820")

    # Pinging before both devices hold both endpoints would make wireguard-go initiate on its own for the first
    # data packet, around plexd's first-contact ordering, and the two initiations can cross (5-15 s lost each).
    try:
        wait_until(endpoints_on_both, 15, "the published endpoints on both devices", [a, b])
    except AssertionError:
        # An endpoint event was lost (reconcile may be 1h here): the state pull carries the endpoints too.
        for d in (a, b):
            d.cli("reconcile", "--once", check=False)
        wait_until(endpoints_on_both, 15, "the endpoints on both devices after a reconcile", [a, b])
    wait_until(lambda: handshake_at(lab, a.node, b_key) > 0, 30, "the first handshake between a and b", [a, b],
               evidence=lambda: f"{time.monotonic() - started:.1f}s after publishing the endpoints")
    # 30 s, not 15: when the first handshakes cross anyway (a CI run saw one after both endpoints and a handshake
    # were in place: each side then holds a session the other dropped), WireGuard itself starts over only after
    # 15 s of sending without an answer (KEEPALIVE_TIMEOUT + REKEY_TIMEOUT).
    # And both ways, as real traffic goes: with a pinging alone, b's persistent keepalives reached a (any
    # authenticated packet stops a's "no answer" timer, so a never started over) while b dropped a's packets, for
    # all 30 s (twice in stop 45's full runs: b's received bytes stayed at the handshake's). b sending too sees no
    # answer, and b starts the handshake over. The crossings themselves came from first contact's hold, which did
    # not hold a peer known before its endpoint (both nodes initiated); fixed in plexd.mesh.mesh_plan.device_update.
    back = subprocess.Popen(b.node.wrap(["ping", "-n", "-q", "-i", "0.2", "-w", str(int(scaled(30))), a.mesh_ip()]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first_ping(lab, a.node, b.mesh_ip(), 30, [a, b])
    finally:
        back.kill()
        back.wait()
    return a, b


def device_index(lab: Lab, node: LabNode) -> int | None:
    """The interface index of plexd0 in the node (None: no such link); the same index means the same device."""
    res = lab.exec(node, ["ip", "-j", "link", "show", "plexd0"], check=False)
    return json.loads(res.stdout)[0]["ifindex"] if res.returncode == 0 else None


def handshake_at(lab: Lab, node: LabNode, key: str) -> int:
    """The unix time of the latest handshake with `key` on the node's device (0: none yet)."""
    out = lab.exec(node, ["wg", "show", "plexd0", "latest-handshakes"], check=False).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == key:
            return int(fields[1])
    return 0


def first_ping(lab: Lab, node: LabNode, ip: str, deadline: float, daemons=()) -> None:
    """One long-lived ping (`-w`) that ends at its first answer; on failure its whole output, the route to `ip`
    and both devices are in the message, instead of a count of throw-away single pings."""
    deadline = scaled(deadline)
    res = subprocess.run(node.wrap(["ping", "-n", "-c", "1", "-i", "0.2", "-w", str(int(deadline)), ip]),
                         capture_output=True, text=True, timeout=deadline + 15)
    if res.returncode == 0:
        return
    route = lab.exec(node, ["ip", "route", "get", ip], check=False)
    devices = "\n".join(f"--- {d.node.name}: wg show\n{_device(d)}" for d in daemons)
    raise AssertionError(f"no answer to ping {ip} from {node.name} within {deadline:.0f}s:\n{res.stdout}{res.stderr}"
                         f"--- ip route get {ip}: {route.stdout.strip() or route.stderr.strip()}\n{devices}")


@contextlib.contextmanager
def mesh_lab(nodes: int, **mesh_kwargs: str) -> Iterator[tuple[Lab, MeshLab]]:
    """A lab with `nodes` nodes and the devplane on its bridge (`MeshLab`); everything removed afterwards."""
    lab = Lab().up(nodes)
    mesh = MeshLab(lab, **mesh_kwargs)
    try:
        mesh.start_devplane()
        yield lab, mesh
    finally:
        mesh.close()
        lab.down()
        assert lab.leaks() == []


@contextlib.contextmanager
def lab_with_devplane(tmp_path: Path, nodes: int,
                      dialect: str = "spec") -> Iterator[tuple[Lab, Devplane, list[Daemon], Path]]:
    """`nodes` lab nodes and a devplane on the lab bridge speaking `dialect` ("spec" or "platform"; the daemons
    are configured to match); every daemon the test appends to the list is stopped, the devplane too, and the lab
    is taken down and checked for leftovers, whatever happened."""
    lab = Lab().up(nodes)
    dp = None
    daemons: list[Daemon] = []
    try:
        dp = Devplane(tmp_path / "dp", listen=f"{lab.bridge_address}:0", keepalive="5s", dialect=dialect)
        dp.start()
        yield lab, dp, daemons, tmp_path
    finally:
        for d in daemons:
            d.stop()
        if dp is not None:
            dp.stop()
        lab.down()
        assert lab.leaks() == []


# -- key rotation (test_key_rotation_lab.py, test_kernel_node_lab.py) ----------------------------------------


def own_key(lab: Lab, d: Daemon) -> str:
    """The public key of the live device, as `wg show` prints it."""
    return lab.exec(d.node, ["wg", "show", "plexd0", "public-key"]).stdout.strip()


def stored_key(d: Daemon) -> str:
    """The public key of the private key kept in data_dir."""
    raw = base64.b64decode((d.dir / "data" / "private_key").read_text())
    return base64.b64encode(public_key_of(raw)).decode()


def assert_rotated(lab: Lab, dp, a: Daemon, b: Daemon, old: str, daemons) -> str:
    """a is on one new key everywhere and the old one is gone; returns the new key."""
    new = dp.admin.node(a.node_id())["public_key"]
    assert new != old
    wait_until(lambda: set(wg_peers(lab, b.node)) == {new}, 15, "b to swap a's key", daemons)
    # b may hear of the new key (the devplane publishes it first) before a has read the answer and committed it
    wait_until(lambda: own_key(lab, a) == new == stored_key(a) and not (a.dir / "data" / "private_key.next").exists(),
               15, "a to commit its new key", daemons)
    assert old not in {n["public_key"] for n in dp.admin.nodes()}
    return new


# -- leaving the mesh (test_lifecycle_lab.py, test_kernel_node_lab.py) --------------------------------------


def has_interface(lab: Lab, node: LabNode) -> bool:
    return lab.exec(node, ["ip", "link", "show", "plexd0"], check=False).returncode == 0


def has_table(lab: Lab, node: LabNode) -> bool:
    out = lab.exec(node, ["nft", "-j", "list", "tables"]).stdout
    return any("table" in o and o["table"]["name"] == "plexd" for o in json.loads(out)["nftables"])


def assert_nothing_left(lab: Lab, node: LabNode) -> None:
    assert not has_interface(lab, node), "plexd0 is still there"
    assert not has_table(lab, node), "table inet plexd is still there"
    assert wireguard_go_pids(lab, node) == [], "wireguard-go is still running"


def exited(d: Daemon, timeout: float = 40.0) -> int:
    d.proc.wait(timeout)
    d.log.close()
    return d.proc.returncode
