"""Shared set-up of the connected-state benches: one lab node running the real `plexd up` (real wireguard-go in
its namespace), the real devplane on the lab bridge. Needs root."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nacl.public import PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plexd.base.errors import PlexdError
from plexd.devplane.harness import Devplane
from plexd.devplane.lab import Lab, LabNode

PLEXD = str(Path(sys.executable).with_name("plexd"))
# PLEXD_BENCH_PROFILE=/path/out.prof runs the daemon under cProfile (written when it exits).
_PROFILE = os.environ.get("PLEXD_BENCH_PROFILE")
DAEMON = [sys.executable, "-m", "cProfile", "-o", _PROFILE, PLEXD, "up"] if _PROFILE else [PLEXD, "up"]
# PLEXD_BENCH_TRACEMALLOC=/path/out.snap runs the daemon under tracemalloc; `Node.tracemalloc_snapshot()` takes one.
_TRACEMALLOC = os.environ.get("PLEXD_BENCH_TRACEMALLOC")
# PLEXD_BENCH_KEEP=1 keeps the bench's workdir (config, data_dir, plexd.log), which goes after a run that finished.
_KEEP = bool(os.environ.get("PLEXD_BENCH_KEEP") or os.environ.get("PLEXD_BENCH_TRACEMALLOC"))
# PLEXD_BENCH_LOG_LEVEL=info (default warning) sets the daemon's log level, to see what it did in workdir/plexd.log.
if _TRACEMALLOC:
    DAEMON = [sys.executable, str(Path(__file__).with_name("_traced_daemon.py"))]


def api_socket(workdir: Path) -> Path:
    """Where a connected node's daemon serves its local socket (node API and `plexd` commands)."""
    return workdir / "api.sock"


@dataclass
class Node:
    lab: Lab
    lab_node: LabNode
    dp: Devplane
    proc: subprocess.Popen
    workdir: Path
    backend: str = "userspace"

    async def device_keys(self) -> set[str]:
        """The public keys of the peers on the node's live device (wireguard-go's UAPI, or the kernel's netlink)."""
        if self.backend == "kernel":
            from plexd.machine.wireguard.kernel import KernelBackend

            device = await KernelBackend("plexd0", netns=self.lab_node.netns).observe()
        else:
            from plexd.machine.wireguard.uapi import UapiClient

            device = await UapiClient("plexd0", socket_dir=self.lab_node.sock_dir).get()
        return set(device.peers) if device is not None else set()

    @property
    def api_socket(self) -> Path:
        return api_socket(self.workdir)

    @property
    def node_id(self) -> str:
        return json.loads((self.workdir / "data" / "identity.json").read_text())["node_id"]

    def cpu_seconds(self) -> float:
        """user+system CPU of the plexd process (the `ip netns exec` wrapper execs into it)."""
        return _cpu(self.proc.pid)

    def rss_mib(self) -> float:
        """Resident set size of the plexd process, from /proc/<pid>/status."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS line")

    def rss_by_mapping(self, top: int = 8) -> list[tuple[str, float]]:
        """Where the RSS is, from /proc/<pid>/smaps: MiB per mapped file (by name) and for anonymous memory
        (the Python heap and the threads' arenas), largest first."""
        totals: dict[str, int] = {}
        name = "[anon]"
        for line in Path(f"/proc/{self.proc.pid}/smaps").read_text().splitlines():
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode [path]
                name = Path(fields[5]).name if len(fields) > 5 else "[anon]"
            elif fields[0] == "Rss:":
                totals[name] = totals.get(name, 0) + int(fields[1])
        ranked = sorted(totals.items(), key=lambda kv: -kv[1])
        return [(n, kb / 1024) for n, kb in ranked[:top]]

    def tracemalloc_snapshot(self) -> Path | None:
        """With PLEXD_BENCH_TRACEMALLOC set: ask the daemon for a snapshot (SIGUSR1) and wait until it is written."""
        if not _TRACEMALLOC:
            return None
        path = Path(_TRACEMALLOC)
        path.unlink(missing_ok=True)
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not path.exists():  # the daemon writes <path>.tmp and renames it when complete
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon wrote no tracemalloc snapshot")
            time.sleep(0.2)
        return path


def _ready(socket_path: Path) -> bool:
    from plexd.node.control import STATUS_PATH
    from plexd.node.control_client import DaemonNotRunning, call

    try:
        doc = call(str(socket_path), "GET", STATUS_PATH, timeout=5)
    except (DaemonNotRunning, OSError, PlexdError):
        return False
    last = doc["reconcile"]["last"]
    return doc["event_stream"]["state"] == "connected" and last is not None and last["ok"]


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def random_peer(i: int, prefix: str = "10.101", tag: str = "bench") -> dict:
    pub = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
    ip = f"{prefix}.{i // 250}.{i % 250 + 1}"
    return {"id": f"n_{tag}{i}", "public_key": pub, "mesh_ip": ip, "endpoint": f"192.0.2.{i % 250 + 1}:51820",
            "allowed_ips": [f"{ip}/32"], "psk": ""}


async def preload(node: Node, n: int) -> float:
    """Put `n` peers on the node's device before measuring (`--peers N`), as a burst of `peer_added` events (the
    benches run with a long reconcile interval, so no state pull removes them). Returns the seconds it took."""
    import asyncio

    if n <= 0:
        return 0.0
    start = time.perf_counter()
    peers = [random_peer(i, prefix="10.102", tag="preload") for i in range(n)]

    def publish() -> None:
        for peer in peers:
            node.dp.admin.publish_event(node.node_id, "peer_added", peer)

    await asyncio.to_thread(publish)
    deadline = time.monotonic() + 300
    while True:
        arrived = len(await node.device_keys())
        if arrived >= n:
            return time.perf_counter() - start
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {arrived} of {n} preloaded peers arrived; see {node.workdir}/plexd.log")
        await asyncio.sleep(0.2)


# For a bench's `--without-telemetry`: how much of a figure is the daemon itself, and how much its telemetry.
WITHOUT_TELEMETRY = "telemetry: {metrics: {enabled: false}, logs: {enabled: false}, audit: {enabled: false}}\n"


@contextlib.contextmanager
def connected_node(reconcile: str = "60s", heartbeat: str = "30s",
                   peer_heartbeat: str | None = None, node_api: str = "", extra_config: str = "",
                   backend: str = "userspace") -> Iterator[Node]:
    """`peer_heartbeat`: the heartbeat interval the devplane expects of its nodes. Peers a bench registers never
    heartbeat, so a bench that must keep them online for minutes sets it long (they go offline after 10).
    `node_api`: further node_api settings, as YAML flow-mapping entries (``rate_limit: 0``). `extra_config`: more
    YAML lines for the daemon's config file. `backend`: the node's WireGuard backend (`kernel` where the kernel has
    the module: the kernel bench, in the VM)."""
    lab = Lab().up(1)
    workdir = Path(tempfile.mkdtemp(prefix="plexd-bench-"))
    dp = proc = None
    finished = False
    try:
        dp = Devplane(workdir / "dp", listen=f"{lab.bridge_address}:0", heartbeat_interval=peer_heartbeat)
        dp.start()
        (workdir / "token").write_text(dp.admin.create_token())
        (workdir / "hooks").mkdir()  # as `plexd install` makes /etc/plexd/hooks.d: the daemon watches it
        cfg = workdir / "config.yaml"
        cfg.write_text(f"api: {{url: {dp.url}, allow_insecure: true}}\n"  # the devplane serves plain HTTP
                       f"data_dir: {workdir / 'data'}\ntoken: {{file: {workdir / 'token'}}}\n"
                       f"hooks: {{dir: {workdir / 'hooks'}}}\nmesh: {{interface: plexd0, backend: {backend}}}\n"
                       f"reconcile: {{interval: {reconcile}}}\nheartbeat: {{interval: {heartbeat}}}\n"
                       f"node_api: {{socket_path: {api_socket(workdir)}{', ' + node_api if node_api else ''}}}\n"
                       f"log_level: {os.environ.get('PLEXD_BENCH_LOG_LEVEL', 'warning')}\n" + extra_config)
        node = lab.nodes[0]
        log = open(workdir / "plexd.log", "w")  # noqa: SIM115 - lives as long as the process
        env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(cfg),
               **{k: v for k, v in os.environ.items() if k.startswith(("PLEXD_BENCH_TRACEMALLOC", "PLEXD_TEST_"))}}
        proc = lab.spawn(node.wrap(DAEMON), env=env,
                         stdout=log, stderr=subprocess.STDOUT)
        # a slow machine (the kernel bench's emulated CPU) gets the tests' load factor here too
        deadline = time.monotonic() + 30 * max(1.0, float(os.environ.get("PLEXD_TEST_LOAD_FACTOR", "1")))
        def device_up() -> bool:
            if backend == "kernel":
                return subprocess.run(node.wrap(["ip", "link", "show", "plexd0"]), capture_output=True).returncode == 0
            return Path(node.sock_dir, "plexd0.sock").exists()

        while not (workdir / "data" / "identity.json").exists() or not device_up():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"plexd up did not come up:\n{(workdir / 'plexd.log').read_text()[-3000:]}")
            time.sleep(0.1)
        # Connected and past its first state pull (events for peers the control plane does not hold, as the
        # benches publish, would be removed again by that pull): ask the daemon itself.
        while not _ready(api_socket(workdir)):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"plexd up did not connect:\n{(workdir / 'plexd.log').read_text()[-3000:]}")
            time.sleep(0.1)
        yield Node(lab, node, dp, proc, workdir, backend)
        finished = True
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if dp is not None:
            dp.stop()
        lab.down()
        # Its data_dir holds the bench node's keys: kept only to look into a failure, or when asked to
        if finished and not _KEEP:
            shutil.rmtree(workdir, ignore_errors=True)
