"""The parts the SSH session tests and bench share: a throw-away local user, a signing key minting session tokens,
an `SshSessionServer` on loopback with recorded callbacks, and the real OpenSSH client (through sshpass)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from plexd.access.ssh import SshSessionServer
from plexd.access.ssh_host_key import load_or_create_host_key
from plexd.access.token import sign_session_token
from plexd.state.sessions_block import Session, SshTarget


@dataclass(frozen=True)
class LocalAccount:
    name: str
    group: str  # a supplementary group of the account's own


@contextlib.contextmanager
def throwaway_user() -> Iterator[LocalAccount]:
    """A real local user with a home, bash as its shell and one supplementary group; removed afterwards."""
    suffix = secrets.token_hex(3)
    name, group = f"plxssh{suffix}", f"plxsshg{suffix}"
    subprocess.run(["groupadd", group], check=True)
    try:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", "-G", group, name], check=True)
        try:
            yield LocalAccount(name, group)
        finally:
            subprocess.run(["pkill", "-KILL", "-u", name], check=False)  # the user's processes, by uid only
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
    finally:
        subprocess.run(["groupdel", group], check=False)


@dataclass
class Harness:
    """A session, its server on 127.0.0.1 and everything its callbacks saw."""

    user: str
    key_dir: Path
    session_id: str = "ses_test"
    allowed_commands: tuple[str, ...] = ()
    ttl: float = 600.0
    idle: float = 0.0
    signing_key: SigningKey = field(default_factory=SigningKey.generate)
    live: set[str] = field(default_factory=set)
    recorded: list[str] = field(default_factory=list)
    record_answer: bool = True
    record_hangs: bool = False  # the control plane never answers the command-started report
    audit: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    server_options: dict[str, Any] = field(default_factory=dict)
    server: SshSessionServer | None = None

    async def __aenter__(self) -> Harness:
        self.session = Session(self.session_id, "ssh", SshTarget(self.user, self.allowed_commands),
                               time.time() + self.ttl, self.idle)
        self.live.add(self.session_id)
        self.server = SshSessionServer(
            self.session, "127.0.0.1", host_key=load_or_create_host_key(self.key_dir),
            keys=lambda: [self.signing_key.verify_key], is_live=lambda sid: sid in self.live,
            record_command=self._record, audit=lambda event, fields: self.audit.append((event, fields)),
            **self.server_options)
        self.port = await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        await self.server.close("plexd_close")

    async def _record(self, session_id: str, command: str) -> bool:
        self.recorded.append(command)
        if self.record_hangs:
            await asyncio.Event().wait()
        return self.record_answer

    def claims(self, **overrides: Any) -> dict[str, Any]:
        target: dict[str, Any] = {"kind": "ssh", "user": self.user}
        if self.allowed_commands:
            target["allowed_commands"] = list(self.allowed_commands)
        claims: dict[str, Any] = {"jti": self.session_id, "kind": "ssh", "target": target,
                                  "nbf": time.time() - 5, "exp": time.time() + self.ttl}
        claims.update(overrides)
        return claims

    def token(self, key: SigningKey | None = None, **overrides: Any) -> str:
        return sign_session_token(key or self.signing_key, self.claims(**overrides))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [fields for event, fields in self.audit if event == name]

    def ssh_argv(self, token: str, *args: str, user: str | None = None, known_hosts: str | None = None,
                 log_level: str = "ERROR") -> list[str]:
        pinning = (["-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes"] if known_hosts
                   else ["-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no"])
        return ["sshpass", "-p", token, "ssh", *pinning, "-o", "PreferredAuthentications=password",
                "-o", "NumberOfPasswordPrompts=1", "-o", f"LogLevel={log_level}", "-o", "ConnectTimeout=10",
                "-p", str(self.port), f"{user or self.user}@127.0.0.1", *args]

    async def ssh(self, token: str, *args: str, user: str | None = None, stdin: bytes = b"",
                  known_hosts: str | None = None, log_level: str = "ERROR",
                  timeout: float = 20) -> tuple[int, str, str]:
        """Run the real ssh client to the end: (exit status, stdout, stderr)."""
        proc = await asyncio.create_subprocess_exec(
            *self.ssh_argv(token, *args, user=user, known_hosts=known_hosts, log_level=log_level),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=_client_env())
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def open_ssh(self, token: str, *args: str) -> asyncio.subprocess.Process:
        """A running ssh client with its stdin, stdout and stderr as pipes (the test drives and ends it)."""
        return await asyncio.create_subprocess_exec(
            *self.ssh_argv(token, *args), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=_client_env())


def _client_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root")}


async def read_until(stream: asyncio.StreamReader, marker: bytes, timeout: float = 15) -> bytes:
    """What `stream` gave up to and including `marker`; the evidence so far when it does not come in time."""
    seen = b""

    async def scan() -> bytes:
        nonlocal seen
        while marker not in seen:
            chunk = await stream.read(4096)
            if not chunk:
                raise AssertionError(f"stream ended before {marker!r}; got {seen[-500:]!r}")
            seen += chunk
        return seen

    try:
        return await asyncio.wait_for(scan(), timeout)
    except TimeoutError:
        raise AssertionError(f"no {marker!r} within {timeout} s; got {seen[-500:]!r}") from None


async def wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        state = _proc_state(pid)
        if state == "Z":  # a zombie is dead; its parent reaps it
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still alive after {timeout} s (state {state})")
        await asyncio.sleep(0.05)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
