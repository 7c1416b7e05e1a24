"""What plexd tells systemd, without libsystemd: sd_notify(3) datagrams and the watchdog.

    READY=1      once the interface is configured (or restored from data_dir while offline) and services run
    STATUS=...   follows what the daemon is doing: "connected, 12 peers", "control plane unreachable since …"
    WATCHDOG=1   every third of WatchdogSec, and only while the event loop turns and no converge is stuck
    STOPPING=1   when a stop begins

Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op. The watchdog only runs when systemd asked for it
(``WATCHDOG_USEC``, and ``WATCHDOG_PID`` naming this process when set), so a hook or a child never pings for us.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping

from plexd.base.childenv import child_environment
from plexd.base.clock import Clock

log = logging.getLogger(__name__)


def notify(*lines: str, env: Mapping[str, str] | None = None) -> bool:
    """One datagram to $NOTIFY_SOCKET; False outside systemd or when it cannot be sent (logged at debug)."""
    target = (os.environ if env is None else env).get("NOTIFY_SOCKET")
    if not target or not lines:
        return False
    if target.startswith("@"):
        target = "\0" + target[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(lines).encode(), target)
        return True
    except OSError as exc:
        log.debug("sd_notify failed: %s", exc)
        return False


NO_SYSTEMD_ENV = "PLEXD_TEST_NO_SYSTEMD"


def booted() -> bool:
    """sd_booted(3): systemd is PID 1 here. Test hook: PLEXD_TEST_NO_SYSTEMD=1 says no, so a test of
    `deregister --purge` or `install` on a machine that does run systemd never disables or reloads the host's
    real units."""
    if os.environ.get(NO_SYSTEMD_ENV) == "1":
        return False
    return os.path.isdir("/run/systemd/system")


def in_unit(env: Mapping[str, str] | None = None) -> bool:
    """This process was started by systemd as (part of) a unit: systemd is PID 1 and set INVOCATION_ID."""
    return booted() and bool((os.environ if env is None else env).get("INVOCATION_ID"))


# The limits of wireguard-go's scope: outside plexd.service's cgroup, the unit's MemoryMax, TasksMax and device
# policy no longer cover it (its sandbox does: seccomp, capabilities and mounts belong to the process).
SCOPE_PROPERTIES = ("DevicePolicy=closed", "DeviceAllow=/dev/net/tun rw", "MemoryMax=256M", "TasksMax=64")


def scope_command(interface: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The command prefix that runs a long-lived child (wireguard-go) in a transient scope of its own when
    plexd runs as a systemd unit, else (). systemd-run --scope execs the command itself, so the pid plexd holds
    stays the child's, and the child outlives plexd.service's KillMode=mixed (the tunnels stay up through a
    restart, an upgrade, a stop with shutdown.deregister: false). The name is unique: a scope that is still
    being emptied must not stop the next start."""
    found = shutil.which("systemd-run")
    if not in_unit(env) or found is None:
        return ()
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", interface)
    props = [arg for prop in SCOPE_PROPERTIES for arg in ("--property", prop)]
    return (found, "--scope", "--quiet", "--collect", f"--unit=plexd-wireguard-{name}-{secrets.token_hex(4)}",
            f"--description=userspace WireGuard of plexd for {interface}", *props, "--")


def systemctl(*args: str, timeout: float = 60.0) -> str:
    """Run ``systemctl ARGS``: "" when it worked, else why not (its stderr, or why it could not run)."""
    try:
        done = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=timeout, check=False,
                              env=child_environment())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if done.returncode == 0 else (done.stderr.strip() or f"exit status {done.returncode}")


def own_unit(cgroup_file: str = "/proc/self/cgroup") -> str:
    """The service unit this process runs in, from its cgroup ("plexd.service"), or ""."""
    try:
        with open(cgroup_file) as f:
            path = f.read().splitlines()[0].rpartition(":")[2]
    except (OSError, IndexError):
        return ""
    name = path.rstrip("/").rpartition("/")[2]
    return name if name.endswith(".service") else ""


def restart_queued(env: Mapping[str, str] | None = None, unit: str | None = None) -> bool:
    """systemd is restarting this very unit (`systemctl restart plexd`, `try-restart`): its job for the unit is a
    restart. A stop then is not the operator asking plexd to leave: the mesh stays up for the next start to adopt.
    False outside a unit, and whenever systemd cannot be asked (a stop never waits more than 3 s for it)."""
    unit = own_unit() if unit is None else unit
    if not in_unit(env) or not unit:
        return False
    try:
        done = subprocess.run(["systemctl", "list-jobs", "--no-legend", "--plain", unit], capture_output=True,
                              text=True, timeout=3, check=False, env=child_environment())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.split()[1:3] == [unit, "restart"] for line in done.stdout.splitlines())


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (a third of WatchdogSec), or None when systemd did not ask for them."""
    env = os.environ if env is None else env
    if not env.get("NOTIFY_SOCKET"):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if usec <= 0 or (owner and owner != str(pid if pid is not None else os.getpid())):
        return None
    return usec / 1e6 / 3


class Watchdog:
    """Pings systemd while `healthy()` says the daemon can still do its job, and keeps STATUS= current.

    A wedged event loop stops the pings by itself (this coroutine no longer runs); `healthy()` covers what the
    loop cannot see, such as a converge that has not finished for too long. When pings are withheld systemd
    restarts plexd (Restart=on-failure), which adopts the live device without dropping the tunnels."""

    def __init__(self, interval: float, healthy: Callable[[], str | None], status: Callable[[], str], *,
                 ping: bool = True, clock: Clock | None = None, send: Callable[..., bool] = notify) -> None:
        self.interval = interval
        self.ping = ping  # False: systemd set no WatchdogSec, only STATUS= lines are kept current
        self.healthy = healthy  # None when healthy, else why not
        self.status = status
        self.clock = clock or Clock()
        self.send = send
        self._last_status = ""
        self._withheld = ""

    async def run(self) -> None:
        while True:
            self.tick()
            await self.clock.sleep(self.interval)

    def tick(self) -> None:
        """One round: the status line if it changed, and a ping unless something is wedged."""
        problem = self.healthy() if self.ping else ""
        if problem is None:
            if self._withheld:
                log.info("watchdog pings resumed (%s is over)", self._withheld)
            self._withheld = ""
            self.send("WATCHDOG=1")
        elif problem and problem != self._withheld:
            log.error("withholding the systemd watchdog ping: %s", problem)
            self._withheld = problem
        line = self.status()
        if line != self._last_status:
            self._last_status = line
            self.send(f"STATUS={line}")
