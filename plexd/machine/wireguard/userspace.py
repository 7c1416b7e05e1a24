"""The userspace WireGuard backend: runs wireguard-go (or boringtun) in the foreground and configures it over UAPI.

Like `wg-quick` with `WG_QUICK_USERSPACE_IMPLEMENTATION`, plexd starts the implementation itself when the kernel
has no WireGuard. It runs with `-f` so its pid is ours (without it wireguard-go daemonizes and the pid is lost).
Supervision is level-triggered: when the process dies, `observe()` returns None and `process_gone()` is True;
the next converge calls `ensure_device()`, which starts a new process, and then re-applies the whole
configuration because the fresh device is empty.

Its output (stdout and stderr) goes to a file beside the socket (`<if>.out`), followed by a thread: never a
pipe, whose read end dies with plexd, after which wireguard-go's next log line would kill it with SIGPIPE, taking
down the very tunnels a restart that keeps them (shutdown.deregister: false, an upgrade) was meant to keep.

A plexd killed with SIGKILL leaves its wireguard-go running (in its own session, on purpose: the tunnels stay up
while plexd restarts). The next start finds the device answering on its socket and adopts it: it finds the
process listening on that socket (`find_serving_process`), supervises it by pid, and stops it at teardown as if
it had started it. Nothing is restarted, so the tunnels are not interrupted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import signal
import threading
from collections.abc import Callable, Mapping, Sequence

from plexd.base.childenv import child_environment
from plexd.base.children import signal_child
from plexd.base.procstat import process_stat
from plexd.machine.wireguard import (
    CounterRow,
    DeviceConfig,
    DeviceUpdate,
    PeerCounters,
    WireGuardError,
    check_interface_name,
)
from plexd.machine.wireguard.uapi import DEFAULT_SOCKET_DIR, UapiClient, UapiUnavailable

log = logging.getLogger(__name__)

START_TIMEOUT = 5.0
STOP_TIMEOUT = 5.0
OUTPUT_POLL = 0.2  # how soon the output file is looked at again after it grew
OUTPUT_POLL_QUIET = 2.0  # ... and at most this long while it stays quiet (an idle daemon wakes rarely)
OUTPUT_LIMIT = 1 << 20  # the output file is emptied past this (LOG_LEVEL=error writes next to nothing)


class UserspaceBackend:
    """`WireGuardBackend` over UAPI, owning the userspace process.

    `launch_prefix` is prepended to the command line, e.g. `ip netns exec NS sh -c '... exec "$@"' sh` in the lab;
    it must `exec` so the pid we hold stays the implementation's pid. `socket_dir` is where this process (not
    the child) finds `<if>.sock`. `scope` comes after it: under systemd, `systemd-run --scope ... --`
    (`plexd.system.systemd.scope_command`), which moves the implementation out of plexd.service's cgroup so that
    KillMode=mixed, which ends everything else of the unit when plexd exits, leaves the tunnels up; it too execs.
    The implementation's environment is `plexd.base.childenv`'s allow-list plus `env`, never the daemon's.
    """

    def __init__(
        self,
        interface: str,
        *,
        implementation: str = "wireguard-go",
        socket_dir: str = DEFAULT_SOCKET_DIR,
        launch_prefix: Sequence[str] = (),
        scope: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        start_timeout: float = START_TIMEOUT,
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        self.interface = interface
        self.implementation = implementation
        self.launch_prefix = tuple(launch_prefix)
        self.scope = tuple(scope)
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.on_exit = on_exit
        self.uapi = UapiClient(interface, socket_dir)
        self._proc: asyncio.subprocess.Process | None = None
        self._output: collections.deque[str] = collections.deque(maxlen=20)
        self._output_file = os.path.join(socket_dir, f"{interface}.out")
        self._follower: threading.Event | None = None  # set: the thread following the output file stops
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._adopted: int | None = None  # pid of a process left by an earlier plexd, serving our device
        self._adopt_tried = False
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        if self._adopted is not None:
            return self._adopted if _alive(self._adopted) else None
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    def process_gone(self) -> bool:
        if self._adopted is not None:
            return not _alive(self._adopted) and not self._stopping
        return self._proc is not None and self._proc.returncode is not None and not self._stopping

    async def counters(self) -> Mapping[str, PeerCounters] | None:
        try:
            return await self.uapi.counters()
        except UapiUnavailable:
            return None

    async def counter_rows(self) -> list[CounterRow] | None:
        try:
            return await self.uapi.counter_rows()
        except UapiUnavailable:
            return None

    async def observe(self) -> DeviceConfig | None:
        try:
            device = await self.uapi.get()
        except UapiUnavailable:
            return None
        if self._proc is None and self._adopted is None and not self._adopt_tried:
            self._adopt()  # a device we did not start: left by an earlier plexd (killed, or stopped keeping it)
        return device

    async def apply(self, update: DeviceUpdate) -> None:
        await self.uapi.set(update)

    async def _socket_answers(self) -> bool:
        try:
            await self.uapi.get()
            return True
        except UapiUnavailable:
            return False

    def _binary(self) -> str:
        impl = self.implementation
        path = impl if os.sep in impl else shutil.which(impl)
        if not path or not os.access(path, os.X_OK):
            raise WireGuardError(
                f"the kernel has no WireGuard and the userspace implementation {impl!r} was not found or is not "
                "executable: install wireguard-go (apt-get install wireguard-go) or set mesh.userspace_implementation"
            )
        return path

    async def ensure_device(self) -> bool:
        check_interface_name(self.interface)
        if await self._socket_answers():
            if self._proc is None and self._adopted is None:
                self._adopt()
            return False
        if self._adopted is not None:  # the adopted process died: from now on the process is our own child
            log.warning("adopted userspace WireGuard for %s (pid %d) is gone; starting a new one", self.interface,
                        self._adopted)
            self._adopted = None
            self._adopt_tried = False
            self.restarts += 1
        was_running = self._proc is not None
        if self._proc is not None and self._proc.returncode is None:
            # Alive but not answering: give it a moment (it may be starting), then replace it.
            if await self._wait_for_socket(self.start_timeout):
                return False
            log.warning("userspace WireGuard for %s does not answer on %s; restarting it", self.interface,
                        self.uapi.path)
            await self._stop_process()
        binary = self._binary()
        env = child_environment({"LOG_LEVEL": "error", **self.env, "WG_PROCESS_FOREGROUND": "1"})
        cmd = [*self.launch_prefix, *self.scope, binary, "-f", self.interface]
        self._output.clear()
        self._stopping = False
        # The output goes to a file (see the module's docstring), followed by a thread, not the event loop.
        try:
            out_fd = os.open(self._output_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                             0o600)
        except OSError as e:
            raise WireGuardError(f"cannot create {self._output_file} for {binary}'s output: {e}") from None
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out_fd, stderr=out_fd,
                start_new_session=True,
            )
        except OSError as e:
            raise WireGuardError(f"cannot start {binary} for {self.interface}: {e}") from None
        finally:
            os.close(out_fd)
        if was_running:
            self.restarts += 1
        self._follow_output(self._proc.pid, from_end=False)
        self._reader = asyncio.create_task(self._watch_exit(self._proc), name=f"wg-exit-{self.interface}")
        log.info("started %s for %s (pid %d)", os.path.basename(binary), self.interface, self._proc.pid,
                 extra={"interface": self.interface, "pid": self._proc.pid})
        if not await self._wait_for_socket(self.start_timeout):
            rc = self._proc.returncode
            output = " | ".join(self._last_output()) or "no output"
            await self._stop_process()
            if self.scope:
                # systemd-run could not make the scope (no bus, a policy): run it as a plain child instead.
                log.warning("could not start %s for %s in a scope of its own (%s): starting it in plexd's own "
                            "cgroup, where it will not outlive a restart of plexd.service (KillMode=mixed)",
                            os.path.basename(binary), self.interface, output)
                self.scope = ()
                return await self.ensure_device()
            state = f"exited with status {rc}" if rc is not None else f"did not open {self.uapi.path}"
            raise WireGuardError(f"{os.path.basename(binary)} for {self.interface} {state}: {output}")
        return True

    async def _wait_for_socket(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self._proc is not None and self._proc.returncode is not None:
                await asyncio.sleep(0.05)  # let the output pump catch the last lines
                return False
            if await self._socket_answers():
                return True
            await asyncio.sleep(0.02)
        return False

    def _follow_output(self, pid: int, *, from_end: bool) -> None:
        if self._follower is not None:
            self._follower.set()
        stop = self._follower = threading.Event()
        threading.Thread(target=self._output_lines, args=(pid, stop, from_end), daemon=True,
                         name=f"wg-output-{self.interface}").start()

    def _output_lines(self, pid: int, stop: threading.Event, from_end: bool) -> None:
        """Follow the output file until the process is gone (and its last lines read) or `stop`. The file is
        truncated past OUTPUT_LIMIT (the process appends, so it simply goes on at the new end)."""
        try:
            f = open(self._output_file, "rb")  # noqa: SIM115 - closed below, the loop may run for days
        except OSError:
            return
        with f:
            if from_end:
                f.seek(0, os.SEEK_END)
            partial = b""
            wait = OUTPUT_POLL
            while True:
                chunk = f.read(1 << 16)
                if chunk:
                    *lines, partial = (partial + chunk).split(b"\n")
                    for line in lines:
                        self._note_output(line, pid)
                    wait = OUTPUT_POLL
                    continue
                if stop.is_set() or not _alive(pid):
                    if partial:
                        self._note_output(partial, pid)
                    return
                if f.tell() > OUTPUT_LIMIT:
                    with contextlib.suppress(OSError):
                        os.truncate(self._output_file, 0)
                    f.seek(0)
                stop.wait(wait)
                wait = min(wait * 2, OUTPUT_POLL_QUIET)  # five looks a second cost 1/4 of an idle daemon's CPU

    def _last_output(self) -> list[str]:
        """The output's last lines, read now (a process that failed at once may have exited before the follower
        looked)."""
        try:
            with open(self._output_file, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return list(self._output)
        return [line.rstrip() for line in lines if line.strip()][-20:]

    def _note_output(self, line: bytes, pid: int) -> None:
        text = line.decode(errors="replace").rstrip()
        if text:
            self._output.append(text)
            log.info("%s: %s", self.interface, text, extra={"interface": self.interface, "pid": pid})

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        if not self._stopping:
            log.warning("userspace WireGuard for %s (pid %d) exited with status %s; the next converge restarts it",
                        self.interface, proc.pid, rc, extra={"interface": self.interface, "pid": proc.pid})
            if self.on_exit is not None:
                self.on_exit(rc)

    def _adopt(self) -> None:
        self._adopt_tried = True
        pid = find_serving_process(self.uapi.path, self.interface)
        if pid is None:
            log.warning("the WireGuard device %s answers on %s but its process is not ours to find (another "
                        "implementation, or another namespace): plexd configures it but will not stop it",
                        self.interface, self.uapi.path)
            return
        self._adopted = pid
        self._follow_output(pid, from_end=True)
        log.info("adopted %s for %s (pid %d), left running by an earlier plexd: the tunnels stay up",
                 self.implementation, self.interface, pid, extra={"interface": self.interface, "pid": pid})

    async def _stop_adopted(self) -> None:
        pid, self._adopted = self._adopted, None
        if pid is None or not _alive(pid):
            return
        self._stopping = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_TIMEOUT
        while _alive(pid) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def _stop_process(self) -> None:
        await self._stop_adopted()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._stopping = True
        if proc.returncode is None:
            signal_child(proc, signal.SIGTERM)
            try:
                async with asyncio.timeout(STOP_TIMEOUT):  # not wait_for: it can swallow a cancel on 3.11
                    await proc.wait()
            except TimeoutError:
                signal_child(proc, signal.SIGKILL)
                await proc.wait()
        if self._reader is not None:
            # asyncio.wait neither raises the reader's own error nor hides a cancel aimed at us.
            await asyncio.wait({self._reader}, timeout=1.0)
            if self._reader.done() and not self._reader.cancelled():
                self._reader.exception()  # retrieved, so asyncio does not warn about it later
            self._reader = None

    async def delete_device(self) -> None:
        """Stop our process (SIGTERM: wireguard-go removes its TUN and socket and exits 0)."""
        await self._stop_process()

    async def close(self) -> None:
        await self._stop_process()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive (an adopted process is not our child, so it is reaped by init soon anyway)
    stat = process_stat(pid)
    return stat is not None and stat.alive


def find_serving_process(socket_path: str, interface: str, proc_dir: str = "/proc") -> int | None:
    """The pid of the process listening on the UAPI socket `socket_path`, or None.

    /proc/net/unix belongs to this network namespace (every lab node has its own /run/wireguard/plexd0.sock) and
    gives the listening socket's inode; the process holding a descriptor to that inode is the one serving the
    device. Processes whose command line ends in the interface name are looked at first."""
    inodes = set()
    wanted = os.path.realpath(socket_path)
    try:
        with open(f"{proc_dir}/net/unix") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                # the path as bound (/var/run/... for wireguard-go) may differ from ours (/run/...) by a symlink
                if len(fields) >= 8 and fields[5] == "01" and os.path.realpath(fields[-1]) == wanted:  # listening
                    inodes.add(f"socket:[{fields[6]}]")
    except OSError:
        return None
    if not inodes:
        return None
    pids = [e for e in os.listdir(proc_dir) if e.isdigit() and int(e) != os.getpid()]

    def named(pid: str) -> bool:
        try:
            with open(f"{proc_dir}/{pid}/cmdline", "rb") as f:
                return f.read().rstrip(b"\0").split(b"\0")[-1] == interface.encode()
        except OSError:
            return False

    for pid in sorted(pids, key=lambda p: not named(p)):
        try:
            fds = os.listdir(f"{proc_dir}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{proc_dir}/{pid}/fd/{fd}") in inodes:
                    return int(pid)
            except OSError:
                continue
    return None
