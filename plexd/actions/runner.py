"""Run one hook: exec'd directly (no shell, no arguments), stdin from /dev/null, cwd ``/``, in a new session so
that it and everything it forks form one process group that can be killed as a whole.

Stdout and stderr are read concurrently and kept separately up to `cap` bytes each; what comes after the cap is
read and discarded (the hook is never blocked on a full pipe), and ``\\n...[truncated]`` is appended (§7.4).

Ending: the hook's own exit; the deadline (status ``timeout``); or `cancel` being set (``cancelled``, the daemon
is shutting down). On deadline or cancel the group gets SIGTERM, then SIGKILL after `kill_grace`. Once the hook
itself has exited, what it left running in its group may hold the pipes open: after `DRAIN` seconds the rest of
the group is killed — an action leaves nothing running behind. (A child that starts its own session escapes the
group; containing that needs a cgroup: under systemd, KillMode=mixed kills what is left in the unit's once plexd
exits.)

A hook is executed from the descriptor of its image (`exec_fd`: the sealed memfd whose bytes were hashed), never
by its path, so a file swapped after the hash cannot run in its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from plexd.actions.request import CANCELLED, ERROR, FAILED, SUCCESS, TIMEOUT

log = logging.getLogger(__name__)

TRUNCATED = "\n...[truncated]"
DRAIN = 1.0  # after the hook exits, how long its leftovers may keep the pipes open
READ_CHUNK = 65536

OnOutput = Callable[[str, bytes], None]  # ("stdout" | "stderr", bytes kept): for streaming to a local caller


@dataclass
class Outcome:
    status: str
    exit_code: int
    stdout: str
    stderr: str
    duration: float
    signal: int = 0  # the signal that ended the hook, if one did
    detail: str = ""  # for the log: why the status is what it is
    deferred: bool = False  # a built-in's result that is sent later (Output.deferred)


class Capture:
    def __init__(self, name: str, cap: int, on_output: OnOutput | None) -> None:
        self.name = name
        self.cap = cap
        self.kept = bytearray()
        self.discarded = 0
        self._on_output = on_output

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.kept)
        keep = chunk[:room] if room > 0 else b""
        if keep:
            self.kept += keep
            if self._on_output is not None:
                self._on_output(self.name, bytes(keep))
        self.discarded += len(chunk) - len(keep)

    def text(self) -> str:
        text = self.kept.decode("utf-8", errors="replace")
        return text + TRUNCATED if self.discarded else text


async def run_process(path: str, env: dict[str, str], *, timeout: float, cap: int, kill_grace: float,
                      cancel: asyncio.Event | None = None, on_output: OnOutput | None = None,
                      exec_fd: int | None = None) -> Outcome:
    """Run `path` (its argv[0]); with `exec_fd`, what is executed is that descriptor (a hook's
    `plexd.trust.integrity.HookImage`), never the path: it is passed to the child, which execs /proc/self/fd/N."""
    started = time.monotonic()
    executable, keep = (f"/proc/self/fd/{exec_fd}", (exec_fd,)) if exec_fd is not None else (path, ())
    try:
        # Popen, not asyncio's subprocess: its wait() returns only once the pipes close, which a leftover child
        # may hold open; a pidfd says when the hook itself has exited.
        proc = subprocess.Popen([path], executable=executable, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd="/", start_new_session=True, close_fds=True,
                                pass_fds=keep)
    except OSError as exc:
        return Outcome(ERROR, 1, "", f"cannot execute {path}: {exc.strerror or exc}\n", time.monotonic() - started,
                       detail=f"exec failed: {exc.strerror or exc}")
    out, err = Capture("stdout", cap, on_output), Capture("stderr", cap, on_output)
    assert proc.stdout is not None and proc.stderr is not None
    pipes = [await _open_pipe(proc.stdout), await _open_pipe(proc.stderr)]
    readers = [asyncio.ensure_future(_pump(reader, capture))
               for (reader, _), capture in zip(pipes, (out, err), strict=True)]
    exited = _exit_of(proc)
    cancelled = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
    status = ""
    try:
        waiting = {exited} | ({cancelled} if cancelled is not None else set())
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if exited not in done:
            status = CANCELLED if cancelled is not None and cancelled in done else TIMEOUT
            await _stop_group(proc.pid, exited, kill_grace)
        # The hook is gone; its leftovers get DRAIN seconds to close the pipes, then the group is killed.
        _, pending = await asyncio.wait(readers, timeout=DRAIN)
        if pending:
            _kill_group(proc.pid, signal.SIGKILL)
            _, pending = await asyncio.wait(readers, timeout=DRAIN)
            for task in pending:  # a process that left the group holds the pipe: stop reading it
                task.cancel()
        if not exited.done():
            await exited
    except BaseException:
        # Our own task was cancelled (a bug or a hard stop): leave no process behind.
        _kill_group(proc.pid, signal.SIGKILL)
        for task in (*readers, exited):
            task.cancel()
        raise
    finally:
        if cancelled is not None:
            cancelled.cancel()
        for _, transport in pipes:
            transport.close()
    _kill_group(proc.pid, signal.SIGKILL)  # anything still in the group after the hook ended
    duration = time.monotonic() - started
    code = proc.wait()  # already exited: reaps at once
    sig = -code if code < 0 else 0
    exit_code = -1 if code < 0 else code  # Go's ExitCode(): -1 when a signal ended the process
    if not status:
        status = SUCCESS if exit_code == 0 else FAILED
    detail = {TIMEOUT: f"timed out after {timeout:g}s", CANCELLED: "cancelled (plexd is shutting down)"}.get(
        status, f"killed by signal {sig}" if sig else f"exit status {exit_code}")
    return Outcome(status, exit_code, out.text(), err.text(), duration, sig, detail)


async def _open_pipe(pipe: IO[bytes]) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_CHUNK, loop=loop)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    return reader, transport


def _exit_of(proc: subprocess.Popen[bytes]) -> asyncio.Future[None]:
    """Resolves when `proc` exits (its pidfd becomes readable), without reaping it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        done.set_result(None)
        return done

    def fired() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not done.done():
            done.set_result(None)

    def cleanup(fut: asyncio.Future[None]) -> None:
        if fut.cancelled():  # never fired: stop watching
            loop.remove_reader(pidfd)
            os.close(pidfd)

    loop.add_reader(pidfd, fired)
    done.add_done_callback(cleanup)
    return done


async def _pump(stream: asyncio.StreamReader, capture: Capture) -> None:
    while chunk := await stream.read(READ_CHUNK):
        capture.add(chunk)


async def _stop_group(pgid: int, exited: asyncio.Future[None], grace: float) -> None:
    _kill_group(pgid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(exited), grace)
    _kill_group(pgid, signal.SIGKILL)  # the whole group, including children that ignore SIGTERM
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(exited), 5)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
