"""The checks of `plexd doctor`, one small function each: `check(ctx) -> Result`.

A check reads the machine only through `Context`, whose parts (the command runner, the kernel probe, file paths,
the control-plane probe) a unit test replaces where the real thing cannot be arranged here (a kernel with
WireGuard, systemd as PID 1, a symmetric NAT). A check never changes the machine.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from plexd.base import boundedjson
from plexd.base.childenv import child_environment
from plexd.config.settings import Config
from plexd.node.doctor_reach import Reach, reach

OK, WARN, FAIL = "ok", "warn", "fail"
WIREGUARD_OVERHEAD = 80  # bytes: outer IPv6 header 40, UDP 8, WireGuard 32 (IPv4 needs 60; the worse case counts)
CAP_NET_ADMIN, CAP_NET_RAW = 12, 13
SKEW_OK = 5.0  # seconds: HTTP dates have one-second steps, and NTP keeps well within this
SKEW_FAIL = 30.0  # access-session tokens allow 30 s (plexd.access.token.NBF_SKEW); signed events 5 minutes
SHIPPED_EXPOSURE = 2.5  # the shipped unit rates 2.3 (tests/security/test_unit_hardening.py keeps it at most 2.5)
COMMAND_TIMEOUT = 4.0


@dataclass(frozen=True)
class Result:
    verdict: str  # ok | warn | fail
    detail: str
    fix: str = ""  # what to do, when not ok


@dataclass(frozen=True)
class Ran:
    """A command's outcome: returncode 127 when it could not be run at all (`stderr` says why)."""

    returncode: int
    stdout: str
    stderr: str


def run_command(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> Ran:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False,
                              env=child_environment({"LC_ALL": "C"}))
    except subprocess.TimeoutExpired:
        return Ran(124, "", f"{argv[0]} did not finish within {timeout:g}s")
    except OSError as exc:
        return Ran(127, "", f"cannot run {argv[0]}: {exc.strerror or exc}")
    return Ran(done.returncode, done.stdout, done.stderr.strip())


def _kernel_wireguard() -> bool:
    from plexd.machine.wireguard.kernel_probe import kernel_wireguard_available

    return kernel_wireguard_available()


def _nftables_probe() -> None:
    from plexd.machine.nft import Nftables

    Nftables().probe()


def _systemd_booted() -> bool:
    from plexd.system.systemd import booted

    return booted()


@dataclass
class Context:
    """What the checks read. The defaults are the real machine."""

    config: Config
    run: Callable[..., Ran] = run_command
    which: Callable[[str], str | None] = shutil.which
    kernel_wireguard: Callable[[], bool] = _kernel_wireguard
    nftables_probe: Callable[[], None] = _nftables_probe  # raises PlexdError naming what is missing
    systemd_booted: Callable[[], bool] = _systemd_booted
    probe_control_plane: Callable[[Config], Reach] = field(default=lambda config: reach(
        config.api.url, ca_file=config.api.tls.ca_file, insecure_skip_verify=config.api.tls.insecure_skip_verify))
    discover_nat: Callable[[Config], Any] = field(default=lambda config: _discover(config))
    tun_path: str = "/dev/net/tun"
    proc_status: str = "/proc/self/status"
    pid1_comm: str = "/proc/1/comm"
    _reach: Reach | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def control_plane(self) -> Reach:
        """Reached once, for every check that needs it (they run side by side)."""
        with self._lock:
            if self._reach is None:
                self._reach = self.probe_control_plane(self.config)
            return self._reach


# -- the WireGuard backend ----------------------------------------------------------------------------------------


def check_wireguard(ctx: Context) -> Result:
    backend = ctx.config.mesh.backend
    if backend != "userspace" and ctx.kernel_wireguard():
        return Result(OK, f"kernel WireGuard is available (mesh.backend: {backend})")
    if backend == "kernel":
        return Result(FAIL, "mesh.backend is kernel, but this kernel has no WireGuard module",
                      "modprobe wireguard (Debian's stock kernel has it), or set mesh.backend: auto to use "
                      "wireguard-go")
    impl = ctx.config.mesh.userspace_implementation
    path = ctx.which(impl)
    why = "no kernel WireGuard; " if backend == "auto" else ""
    if path is None:
        return Result(FAIL, f"{why}the userspace implementation {impl} is not on PATH",
                      "apt-get install wireguard-go (or set mesh.userspace_implementation to its path)")
    tun = _tun_problem(ctx.tun_path)
    if tun:
        return Result(FAIL, f"{why}{impl} needs {ctx.tun_path}, which {tun}",
                      "modprobe tun; in a container, pass the device in (--device /dev/net/tun)")
    return Result(OK, f"{why}userspace {path} with {ctx.tun_path}")


def _tun_problem(path: str) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be checked ({exc.strerror})"
    if not stat.S_ISCHR(st.st_mode):
        return "is not a character device"
    try:
        os.close(os.open(path, os.O_RDWR))  # opening attaches nothing: only TUNSETIFF makes an interface
    except OSError as exc:
        return f"cannot be opened ({exc.strerror})"
    return ""


# -- nftables and capabilities ------------------------------------------------------------------------------------


def check_nftables(ctx: Context) -> Result:
    from plexd.base.errors import PlexdError

    try:
        ctx.nftables_probe()
    except PlexdError as exc:
        verdict = FAIL if ctx.config.policy.enabled else WARN
        needed = "" if ctx.config.policy.enabled else " (policy.enabled is false: needed once it is on)"
        return Result(verdict, f"nftables cannot be used: {exc}{needed}",
                      "apt-get install nftables libnftables1; modprobe nf_tables; run as root (CAP_NET_ADMIN)")
    return Result(OK, "nftables usable (libnftables answers)")


def check_capabilities(ctx: Context) -> Result:
    try:
        with open(ctx.proc_status) as f:
            line = next((x for x in f if x.startswith("CapEff:")), "")
        effective = int(line.split()[1], 16)
    except (OSError, IndexError, ValueError) as exc:
        return Result(FAIL, f"cannot read CapEff from {ctx.proc_status} ({exc})", "run on Linux with /proc mounted")
    missing = [name for name, bit in (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_NET_RAW", CAP_NET_RAW))
               if not effective >> bit & 1]
    if missing:
        fix = ("this root process had them taken (a container, or a bounding set): add NET_ADMIN and NET_RAW"
               if os.geteuid() == 0 else "run plexd (and plexd doctor) as root")
        return Result(FAIL, f"this process (uid {os.geteuid()}) lacks {' and '.join(missing)}", fix)
    return Result(OK, "CAP_NET_ADMIN and CAP_NET_RAW are effective")


# -- the control plane, the clock, the path ---------------------------------------------------------------------


def check_control_plane(ctx: Context) -> Result:
    found = ctx.control_plane()
    if not found.ok:
        return Result(FAIL, f"{found.url}: {found.error}" if found.url else found.error, found.fix)
    via = f" through proxy {found.proxy}" if found.proxy else (f" ({found.address})" if found.address else "")
    said = f"GET /v1/ping answered {found.status} in {found.seconds * 1000:.0f} ms"
    if found.tls == "verified":
        return Result(OK, f"{found.url}{via}: TLS verified, {said}")
    what = "plain http://" if not found.tls else "TLS without certificate verification"
    return Result(WARN, f"{found.url}{via}: {said}, over {what} (api.allow_insecure: labs only)",
                  "use https:// with a certificate this machine trusts (or api.tls.ca_file)")


def check_clock(ctx: Context) -> Result:
    found = ctx.control_plane()
    if found.server_date is None or found.local_time is None:
        why = ("no control plane configured" if found.step == "config" else
               f"the control plane did not answer ({found.step})" if found.step else
               "the control plane's answer has no Date header")
        return Result(WARN, f"not checked: {why}", "see the control_plane line" if found.step else "")
    skew = found.server_date + 0.5 - found.local_time  # a Date is truncated to the second
    # "about": a Date has one-second steps, and a server may cache it for a second
    off = "in step with" if round(abs(skew)) == 0 else f"about {abs(skew):.0f}s {'behind' if skew > 0 else 'ahead of'}"
    text = f"this clock is {off} the control plane's (by its Date header)"
    fix = "turn on time sync: timedatectl set-ntp true (or chrony / systemd-timesyncd)"
    if abs(skew) <= SKEW_OK:
        return Result(OK, f"{text}, within {SKEW_OK:g}s")
    if abs(skew) <= SKEW_FAIL:
        return Result(WARN, text, fix)
    return Result(FAIL, f"{text}: access-session tokens are refused past {SKEW_FAIL:g}s, signed events past "
                        "5 minutes", fix)


def check_mtu(ctx: Context) -> Result:
    found = ctx.control_plane()
    if not found.address:
        return Result(WARN, "not checked: the control plane's address is unknown (see the control_plane line)")
    mesh_if, mesh_mtu = ctx.config.mesh.interface, ctx.config.mesh.mtu
    route = _json(ctx.run(["ip", "-j", "route", "get", found.address]), f"ip route get {found.address}")
    if isinstance(route, Result):
        return route
    hop = route[0] if route else {}
    dev = str(hop.get("dev", ""))
    if not dev:
        return Result(FAIL, f"no route to the control plane's address {found.address}",
                      "add a default route (or one to the control plane)")
    if dev == mesh_if:
        return Result(FAIL, f"the control plane's address {found.address} is routed through the mesh interface "
                            f"{mesh_if} itself", "the tunnel cannot carry its own control traffic: route the "
                                                 "control plane's address through the uplink")
    link = _json(ctx.run(["ip", "-j", "link", "show", "dev", dev]), f"ip link show dev {dev}")
    if isinstance(link, Result):
        return link
    mtu = int(link[0].get("mtu", 0)) if link else 0
    cached = _route_mtu(hop)
    path = min(m for m in (mtu, cached) if m) if (mtu or cached) else 0
    need = mesh_mtu + WIREGUARD_OVERHEAD
    where = f"route to {found.address} via {dev} (MTU {path}{', a learnt path MTU' if cached and cached < mtu else ''})"
    if not path:
        return Result(WARN, f"{where}: its MTU is unknown")
    if path < need:
        return Result(FAIL, f"{where} cannot hold mesh.mtu {mesh_mtu} + {WIREGUARD_OVERHEAD} bytes of WireGuard "
                            f"overhead ({need})", f"set mesh.mtu: {max(576, path - WIREGUARD_OVERHEAD)} (or less)")
    return Result(OK, f"{where} holds mesh.mtu {mesh_mtu} + {WIREGUARD_OVERHEAD}")


def _route_mtu(hop: dict[str, Any]) -> int:
    """A learnt path MTU in `ip -j route get`'s answer (top level, or under metrics), or 0."""
    for source in (hop, *[m for m in hop.get("metrics", []) if isinstance(m, dict)]):
        value = source.get("mtu")
        if isinstance(value, int) and value > 0:
            return value
    return 0


# -- what could be in the mesh's way -----------------------------------------------------------------------------


def check_mesh_routes(ctx: Context) -> Result:
    mesh_if = ctx.config.mesh.interface
    ranges = [ipaddress.ip_network(r, strict=False) for r in ctx.config.policy.mesh_range]
    conflicts, covering = [], []
    for family in sorted({n.version for n in ranges}):
        routes = _json(ctx.run(["ip", "-j", f"-{family}", "route", "show", "table", "main"]), "ip route show")
        if isinstance(routes, Result):
            return routes
        for route in routes:
            dst, dev = str(route.get("dst", "")), str(route.get("dev", ""))
            if dst == "default" or dev == mesh_if or route.get("type") in ("local", "broadcast", "multicast"):
                continue
            try:
                net = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                continue
            via = f"{dst} {'via ' + dev if dev else route.get('type', 'without a device')}"
            for mesh in ranges:
                if net.version != mesh.version or not net.overlaps(mesh) or net.prefixlen == 0:
                    continue
                (conflicts if net.prefixlen >= mesh.prefixlen else covering).append(f"{via} (mesh range {mesh})")
    if conflicts:
        return Result(FAIL, f"the main table routes part of policy.mesh_range elsewhere than {mesh_if}: "
                            f"{'; '.join(conflicts[:5])}",
                      "a local network uses the mesh's addresses: move it, or remove the route (ip route del ...)")
    if covering:
        return Result(WARN, f"routes covering policy.mesh_range go elsewhere than {mesh_if}: "
                            f"{'; '.join(covering[:5])}: a mesh address plexd has not routed yet would leave there",
                      "usually harmless (the mesh's own routes are more specific); make sure that network does not "
                      "use the mesh range")
    return Result(OK, f"no route in the main table claims policy.mesh_range ({', '.join(map(str, ranges))})")


def check_mesh_interface(ctx: Context) -> Result:
    name = ctx.config.mesh.interface
    ran = ctx.run(["ip", "-j", "-d", "link", "show", "dev", name])
    if ran.returncode != 0 and ("does not exist" in ran.stderr or "Cannot find device" in ran.stderr):
        return Result(OK, f"mesh.interface {name} does not exist yet (plexd creates it)")
    links = _json(ran, f"ip link show dev {name}")
    if isinstance(links, Result):
        return links
    kind = str(((links[0] if links else {}).get("linkinfo") or {}).get("info_kind", ""))
    if kind in ("wireguard", "tun"):
        return Result(OK, f"mesh.interface {name} exists and is a {kind} device (plexd adopts it)")
    return Result(FAIL, f"mesh.interface {name} exists and is {'a ' + kind if kind else 'a plain'} device, not "
                        "WireGuard: plexd would not take it over",
                  f"remove it (ip link del {name}) if it is a leftover, or set mesh.interface to another name")


# -- directories plexd trusts -------------------------------------------------------------------------------------


def check_trusted_dirs(ctx: Context) -> Result:
    from plexd.trust.pathtrust import trust_problem

    problems, seen = [], []
    for key, path in (("data_dir", ctx.config.data_dir), ("hooks.dir", ctx.config.hooks.dir)):
        problem = trust_problem(path)
        if problem:
            problems.append(f"{key} {path}: {problem}")
        else:
            seen.append(f"{key} {path}{'' if os.path.exists(path) else ' (not created yet)'}")
    if problems:
        return Result(FAIL, "; ".join(problems) + ": plexd refuses to start",
                      "chown root:root and chmod go-w the path named (and every directory above it)")
    return Result(OK, f"only root can change {' and '.join(seen)}")


# -- NAT ----------------------------------------------------------------------------------------------------------

NAT_TEXT = {
    "none": (OK, "no NAT: the servers see this machine's own address"),
    "full_cone": (OK, "endpoint-independent NAT mapping: peers can reach this node directly"),
    "symmetric": (WARN, "symmetric NAT (a mapping per destination): peers cannot use it, so the relay (a bridge) "
                        "is needed"),
    "unknown": (WARN, "only one STUN server answered: the NAT type needs two"),
}


def _discover(config: Config) -> Any:
    """One discovery from an ephemeral port (the daemon's listen port may be held by its device)."""
    from plexd.nat.discovery import discover
    from plexd.nat.probe import BoundTransport
    from plexd.nat.servers import parse_server

    servers = [parse_server(s) for s in config.nat_traversal.stun_servers]
    per_server = min(config.nat_traversal.stun_timeout, 2.0)

    async def run() -> Any:
        transport = BoundTransport.bind(0)
        try:
            return await discover(transport, servers, per_server)
        finally:
            transport.close()

    return asyncio.run(run())


def check_stun(ctx: Context) -> Result:
    nat = ctx.config.nat_traversal
    if not nat.enabled:
        return Result(OK, "not checked: NAT traversal is off (nat_traversal.enabled: false)")
    if not nat.stun_servers:
        return Result(OK, "not checked: no STUN servers configured (nat_traversal.stun_servers); the node reports "
                          "its local endpoint")
    found = ctx.discover_nat(ctx.config)
    if not found.ok:
        why = "; ".join(f"{server}: {reason}" for server, reason in found.failures) or "no answer"
        return Result(FAIL, f"no STUN server answered ({why})",
                      "allow outbound UDP to the STUN servers (port 3478 by default) and check their names")
    verdict, text = NAT_TEXT.get(found.nat_type, (WARN, f"NAT type {found.nat_type}"))
    fix = {"symmetric": "give the mesh a bridge (mode: bridge) as relay, or forward UDP mesh.listen_port to this "
                        "machine on the router",
           "unknown": "configure a second STUN server in nat_traversal.stun_servers"}.get(found.nat_type, "")
    return Result(verdict, f"{text}; public endpoint {found.public} (from {found.server})", fix)


# -- systemd ------------------------------------------------------------------------------------------------------


def check_systemd(ctx: Context) -> Result:
    if not ctx.systemd_booted():
        return Result(OK, f"not checked: systemd is not PID 1 here ({_pid1(ctx)})")
    ran = ctx.run(["systemctl", "show", "plexd.service", "--property=LoadState,ActiveState,SubState,UnitFileState"])
    if ran.returncode != 0:
        return Result(WARN, f"systemctl show plexd.service failed: {ran.stderr or ran.returncode}", "")
    props = dict(line.partition("=")[::2] for line in ran.stdout.splitlines() if "=" in line)
    if props.get("LoadState") != "loaded":
        return Result(WARN, f"plexd.service is not installed (LoadState {props.get('LoadState', '?')})",
                      "plexd install, then plexd join and systemctl enable --now plexd")
    active, sub = props.get("ActiveState", "?"), props.get("SubState", "?")
    score = _exposure(ctx)
    line = f"plexd.service {active} ({sub}), {props.get('UnitFileState', '?')}; {score[1]}"
    if active == "failed" or sub == "auto-restart":  # auto-restart: it keeps dying and systemd keeps restarting it
        return Result(FAIL, line, "journalctl -u plexd -e shows why")
    if score[0] is not None and score[0] > SHIPPED_EXPOSURE:
        return Result(WARN, f"{line}: looser than the shipped unit (2.3)",
                      "systemd-analyze security plexd.service names what a drop-in or edit opened; "
                      "systemctl revert plexd undoes it unless a hook needs it")
    if active == "inactive":
        return Result(WARN, line, "systemctl enable --now plexd (after plexd join)")
    if active != "active":
        return Result(WARN, line, "it is changing state: run plexd doctor again in a moment")
    return Result(OK, line)


def _exposure(ctx: Context) -> tuple[float | None, str]:
    ran = ctx.run(["systemd-analyze", "security", "plexd.service", "--no-pager"], timeout=COMMAND_TIMEOUT * 2)
    hit = re.search(r"Overall exposure level for \S+:\s*([\d.]+)\s*(\S*)", ran.stdout)
    if not hit:
        return None, f"systemd-analyze security gave no score ({(ran.stderr or 'no output')[:120]})"
    return float(hit.group(1)), f"systemd-analyze security: {hit.group(1)} {hit.group(2)}".rstrip()


def _pid1(ctx: Context) -> str:
    if os.environ.get("PLEXD_TEST_NO_SYSTEMD") == "1":
        return "PLEXD_TEST_NO_SYSTEMD=1"
    try:
        with open(ctx.pid1_comm) as f:
            return f"PID 1 is {f.read().strip() or '?'}"
    except OSError as exc:
        return f"PID 1 cannot be read: {exc.strerror}"


# -- helpers ------------------------------------------------------------------------------------------------------


def _json(ran: Ran, what: str) -> list[dict[str, Any]] | Result:
    """A command's JSON array, or the check's failure naming the command."""
    if ran.returncode != 0:
        return Result(FAIL, f"{what} failed: {(ran.stderr or f'exit status {ran.returncode}')[:200]}",
                      "apt-get install iproute2" if ran.returncode == 127 else "")
    try:
        doc = boundedjson.parse(ran.stdout or "[]")
    except ValueError:
        return Result(FAIL, f"{what} printed no JSON", "apt-get install iproute2 (a version with -j)")
    return [d for d in doc if isinstance(d, dict)] if isinstance(doc, list) else []
