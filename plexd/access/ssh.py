"""SSH sessions (docs/protocol.md §A1.3, `kind: ssh`): one asyncssh listener per session on the node's
mesh IP, password authentication with the session token, the session's process run as its target user.

    server = SshSessionServer(session, mesh_ip, host_key=load_or_create_host_key(data_dir),
                              keys=current_verify_keys, is_live=lambda sid: sid in desired_sessions,
                              record_command=post_command_started, audit=audit_line)
    port = await server.start()          # listener_endpoint = server.listener_endpoint
    ...
    await server.close("operator_revoke")  # or ttl_expired / idle_timeout / plexd_close (deregistration)

Admission: user = `target.ssh.user`, password = the session token, checked by `verify_session_token` against
`keys()` (the trusted control-plane signing keys, read at each attempt) at `now()`, AND `is_live(session_id)`
(the session is still in the desired block): a token alone never admits. Public-key, keyboard-interactive and
`none` are refused; 3 tries per connection; a source address with too many failures is refused without a check.

Limits: 4 logged-in connections per session; connections not logged in yet have their own budget, 4 per source
address and 16 per session, where one more closes a waiting one: its address's oldest over the address's budget,
else the oldest of the address holding the most (its own when that holds as many), so a client without a token
cannot keep one with a token out, from one address or several; login grace 10 s from the TCP accept (handshake
and authentication, never renewed); 10 session channels per connection, commands <= 1,024 bytes. Only `session`
channels: no subsystem (sftp), agent or X11 forwarding, direct-tcpip or tcpip-forward; an `env` request is
acknowledged by asyncssh but its variables are never applied (the environment is built here).

Each channel runs one process as the target user (uid, gid, supplementary groups, home, login shell), with the
scrubbed environment of `ssh_process.login_environment`, in a session of its own, on a pty when one was asked
for. An exec without a pty becomes the user in setpriv (`ssh_process.switch_user_argv`: no fork of the
daemon). With `allowed_commands`, `shell` is refused and `exec` must be an exact member, asked for without a pty
(pagers and other interactive programs offer shell escapes on a terminal), and runs with pagers set to `cat` and
less's and systemd's secure modes (`ssh_process.RESTRICTED_ENV`); an exec runs only after
`record_command(session_id, command)` returned True within 15 s (the control plane recorded it). A hang-up sends
SIGHUP to the process group, then SIGKILL 2 s later.

The session ends by itself at `expires_at` (`ttl_expired`) and after `idle_timeout` without a byte either way
(`idle_timeout`); `close(reason)` ends it for the caller. Every connection is then disconnected with the reason,
which OpenSSH prints ("Received disconnect ...: session closed: ...").

Audit (`audit(event, fields)`, never the token): `auth_failed` (reason from TokenRefused, or `revoked`,
`rate_limited`, `user`, `method`), `connection_started`, `connection_ended` (reason, bytes_in, bytes_out),
`command` (command or "shell", exit_code, or `refused` with why).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import grp
import inspect
import logging
import os
import pty
import re
import secrets
import signal
import socket
import struct
import termios
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import asyncssh
from nacl.signing import VerifyKey

from plexd.access.activity import Audit, RecordCommand, Report, emit
from plexd.access.lifetime import watch_lifetime
from plexd.access.ssh_host_key import fingerprint
from plexd.access.ssh_limits import auth_failure_limiter
from plexd.access.ssh_process import (
    LocalUser,
    UserRefused,
    exit_status,
    login_environment,
    resolve_user,
    session_unit_argv,
    switch_user_argv,
)
from plexd.access.ssh_saslprep import install as install_saslprep_fast_path
from plexd.access.token import TokenRefused, verify_session_token
from plexd.base import gojson
from plexd.base.childenv import child_environment
from plexd.base.children import children_held, release_reaping
from plexd.base.ratelimit import RateLimiter
from plexd.base.serving import mesh_listener, only_from
from plexd.state.sessions_block import MAX_COMMAND_BYTES, Session, SshTarget
from plexd.system import systemd

log = logging.getLogger(__name__)
install_saslprep_fast_path()

MAX_CONNECTIONS = 4  # logged in, per session
# Not logged in yet: a budget of their own, per source address and per session. One more closes a waiting one of its
# address, or of the busiest address: a client that connects and says nothing keeps nobody out, however often.
MAX_WAITING_PER_SOURCE = 4
MAX_WAITING = 16
MAX_CHANNELS = 10
MAX_AUTH_TRIES = 3
LOGIN_GRACE = 10.0
RECORD_TIMEOUT = 15.0
HANGUP_GRACE = 2.0
CLOSE_SLACK = 3.0  # past HANGUP_GRACE, how long close() waits for connections to finish ending
_EARLY_INPUT_MAX = 1 << 20
_STDIN_BUFFER_MAX = 1 << 20
NOT_RECORDED = "the control plane did not record this command; it was not run"
NO_TERMINAL = "this session runs its allowed commands without a terminal; run ssh without -t"
TERMINATIONS = ("ttl_expired", "idle_timeout", "plexd_close", "operator_revoke")
_CLOSE_TEXT = {"ttl_expired": "the session expired", "idle_timeout": "the session was idle too long",
               "plexd_close": "the node is leaving the mesh", "operator_revoke": "the session was revoked"}

Keys = Callable[[], Iterable[VerifyKey]]
@dataclass
class SshCounters:
    connections: int = 0
    refused_over_cap: int = 0
    dropped_waiting: int = 0  # closed before logging in, to make room for a newer connection
    auth_failures: int = 0
    bytes_in: int = 0  # client -> process
    bytes_out: int = 0  # process -> client


class SshSessionServer:
    """One SSH session's listener and its connections. `start()` binds; `close(reason)` ends everything."""

    def __init__(self, session: Session, bind_host: str, *, host_key: asyncssh.SSHKey, keys: Keys,
                 is_live: Callable[[str], bool], record_command: RecordCommand, audit: Audit | None = None,
                 report: Report | None = None,
                 now: Callable[[], float] = time.time, auth_limiter: RateLimiter | None = None,
                 login_grace: float = LOGIN_GRACE, max_connections: int = MAX_CONNECTIONS,
                 device: str | None = None) -> None:
        """`device`: the mesh interface, the only one the listener takes connections from (`mesh_listener`)."""
        if not isinstance(session.target, SshTarget):
            raise ValueError(f"session {session.session_id} is a {session.kind} session, not ssh")
        if bind_host in ("", "0.0.0.0", "::"):
            raise ValueError("an SSH session listens on the node's mesh IP, never on all interfaces")
        self.session = session
        self.target: SshTarget = session.target
        self.bind_host, self.device = bind_host, device
        self.device_index = 0  # the interface index the listener is bound to, once started
        self.host_key = host_key
        self.host_key_fingerprint = fingerprint(host_key)
        self.keys = keys
        self.is_live = is_live
        self.record_command = record_command
        self.now = now
        self.auth_limiter = auth_limiter or auth_failure_limiter()
        self.login_grace = login_grace
        self.max_connections = max_connections
        self.counters = SshCounters()
        self._audit = audit
        self._report = report
        self._server: asyncssh.SSHAcceptor | None = None
        self._watch: asyncio.Task[None] | None = None
        self.connections: set[_Connection] = set()
        self.waiting: dict[_Connection, None] = {}  # not logged in yet, oldest first
        self.last_activity = now()
        self.port = 0
        self.closed: str | None = None

    @property
    def listener_endpoint(self) -> str:
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind `bind_host`:0 and watch expiry and idleness; the kernel-chosen port."""
        self._server = await asyncssh.create_server(
            lambda: _Connection(self), sock=self._bind(),
            server_host_keys=[self.host_key], login_timeout=self.login_grace, line_editor=False,
            agent_forwarding=False, x11_forwarding=False, allow_pty=True, keepalive_interval=0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._watch = asyncio.create_task(self._watch_lifetime(), name=f"ssh-session-{self.session.session_id}")
        log.info("ssh session %s listening on %s", self.session.session_id, self.listener_endpoint)
        await self.emit({"phase": "session_started", "listener_endpoint": self.listener_endpoint,
                         "host_key_fingerprint": self.host_key_fingerprint})
        return self.port

    def _bind(self) -> socket.socket:
        sock, self.device_index = mesh_listener(self.bind_host, self.device)
        return sock

    async def close(self, reason: str) -> None:
        """Stop listening and disconnect every connection with `reason` (one of TERMINATIONS) told to the client;
        their processes get SIGHUP, then SIGKILL 2 s later."""
        if self.closed is not None:
            return
        self.closed = reason
        if self._server is not None:
            self._server.close()
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        conns = list(self.connections)
        for conn in conns:
            conn.end(reason)
        if conns:
            # Bounded: the converge engine awaits this. Hang-ups kill each process group within HANGUP_GRACE.
            finishing = [asyncio.ensure_future(c.finished()) for c in conns]
            _, late = await asyncio.wait(finishing, timeout=HANGUP_GRACE + CLOSE_SLACK)
            if late:
                log.warning("ssh session %s: %d connections still ending after close; left to end by themselves",
                            self.session.session_id, len(late))
        log.info("ssh session %s closed: %s", self.session.session_id, reason)
        await self.emit({"phase": "session_ended", "terminated_by": reason, "bytes_in": self.counters.bytes_in,
                         "bytes_out": self.counters.bytes_out})

    async def emit(self, activity: dict[str, Any]) -> None:
        """One §A1.4 `ssh` activity report (never raises: see plexd.access.activity)."""
        await emit(self._report, self.session.session_id, "ssh", {"ssh": activity})

    def touch(self) -> None:
        self.last_activity = self.now()

    def audit(self, event: str, **fields: Any) -> None:
        if self._audit is not None:
            try:
                self._audit(event, {"session_id": self.session.session_id, **fields})
            except Exception:  # an audit sink that fails must not break the session
                log.exception("ssh session audit callback failed")

    async def _watch_lifetime(self) -> None:
        await watch_lifetime(self.session, now=self.now, last_activity=lambda: self.last_activity,
                             closed=lambda: self.closed is not None, close=self.close)

    def listening_sockets(self) -> list[Any]:
        """The listener's sockets (the sessions domain marks them for the firewall's session rules)."""
        return list(self._server.sockets) if self._server is not None and self.closed is None else []

    def rebind(self, index: int) -> None:
        """The mesh interface was recreated (index `index`): the listener and its connections take what arrives on
        the new one (`plexd.base.serving.only_from`), keeping the port and the connections. OSError: not done."""
        conns = [c.conn.get_extra_info("socket") for c in self.connections if getattr(c, "conn", None) is not None]
        for sock in [*self.listening_sockets(), *(s for s in conns if s is not None)]:
            only_from(sock, index)
        self.device_index = index

    def status(self) -> dict[str, Any]:
        return {"session_id": self.session.session_id, "kind": "ssh", "listener_endpoint": self.listener_endpoint,
                "user": self.target.user, "host_key_fingerprint": self.host_key_fingerprint,
                "connections": len(self.connections), "waiting": len(self.waiting),
                "accepted": self.counters.connections, "refused_over_cap": self.counters.refused_over_cap,
                "dropped_waiting": self.counters.dropped_waiting, "auth_failures": self.counters.auth_failures,
                "closed": self.closed}

    def logged_in(self) -> int:
        return sum(c.authenticated for c in self.connections)

    def wait_for_login(self, conn: _Connection) -> None:
        """`conn` waits to log in (asyncssh's login timeout, from the accept, never renewed). Over its address's
        budget, that address's oldest waiting connection is closed; over the session's, the oldest of the address
        holding the most waiting ones, `conn`'s own when it holds as many (as `plexd.access.k8s` displaces): the
        session's oldest could be a quiet address's only one."""
        same = [c for c in self.waiting if c.source == conn.source]
        oldest = None
        if len(same) >= MAX_WAITING_PER_SOURCE:
            oldest = same[0]
        elif len(self.waiting) >= MAX_WAITING:
            counts = Counter(c.source for c in self.waiting)
            busiest = max(counts, key=counts.__getitem__)
            if counts[conn.source] >= counts[busiest]:
                busiest = conn.source
            oldest = next(c for c in self.waiting if c.source == busiest)
        if oldest is not None:
            self.counters.dropped_waiting += 1
            oldest.drop("too many connections waiting to log in")
        self.waiting[conn] = None

    # -- admission -------------------------------------------------------------------------------------------

    def check_password(self, username: str, password: str, source: str) -> str | None:
        """None when `password` admits `username`, else the failure reason (never the token)."""
        if self.closed is not None:
            return "closed"
        if self.auth_limiter.blocked(source):
            return "rate_limited"
        try:  # the token's checks first, in the reference's order: a forged token is audited as such
            verify_session_token(password, keys=list(self.keys()), session_id=self.session.session_id,
                                 kind="ssh", target=self.target.to_wire(), now=self.now(), user=self.target.user)
        except TokenRefused as exc:
            return exc.reason
        if username != self.target.user:  # 7: the login user is the session's (its token's, checked above)
            return "user"
        if not self.is_live(self.session.session_id):
            return "revoked"
        if self.session.expired(self.now()):
            return "expired"
        return None


class _Connection(asyncssh.SSHServer):
    def __init__(self, server: SshSessionServer) -> None:
        self.server = server
        self.conn: asyncssh.SSHServerConnection | None = None
        self.source = "?"
        self.failures = 0
        self.authenticated = False
        self.channels: set[_Channel] = set()
        self.ended: str | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self._done = asyncio.get_running_loop().create_future()

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        _ack_at_once(conn)
        peer = conn.get_extra_info("peername") or ("?", 0)
        self.source = str(peer[0])
        server = self.server
        if server.closed is not None or server.logged_in() >= server.max_connections:
            self._done.set_result(None)
            self._refuse_over_cap()
            return
        server.connections.add(self)
        server.counters.connections += 1
        server.wait_for_login(self)

    def _refuse_over_cap(self) -> None:
        self.server.counters.refused_over_cap += 1
        self.drop(f"at most {self.server.max_connections} connections to this session", "refused")

    def drop(self, text: str, reason: str = "dropped") -> None:
        """Close this connection before it logged in, telling the client why."""
        self.server.waiting.pop(self, None)
        self.ended = reason
        if self.conn is not None:  # after asyncssh sent its version line (a disconnect before it is not SSH)
            asyncio.get_running_loop().call_soon(self.conn.disconnect, asyncssh.DISC_TOO_MANY_CONNECTIONS, text)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.server.waiting.pop(self, None)
        if self.authenticated:
            self.server.audit("connection_ended", source=self.source, reason=self.ended or "client_closed",
                              bytes_in=self.bytes_in, bytes_out=self.bytes_out)
        for chan in list(self.channels):
            chan.hang_up()
        if not self._done.done():
            self._done.set_result(None)

    def end(self, reason: str) -> None:
        self.ended = reason
        text = _CLOSE_TEXT.get(reason, reason)
        for chan in list(self.channels):
            chan.notify(f"\r\nplexd: {text}; closing.\r\n")
        if self.conn is not None:
            self.conn.disconnect(asyncssh.DISC_BY_APPLICATION, f"session closed: {text} ({reason})")

    async def finished(self) -> None:
        await self._done
        await asyncio.gather(*(c.done for c in list(self.channels)), return_exceptions=True)

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return True

    def public_key_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def host_based_auth_supported(self) -> bool:
        return False

    def gss_auth_supported(self) -> bool:
        return False

    def validate_password(self, username: str, password: str) -> bool:
        reason = self.server.check_password(username, password, self.source)
        if reason is None and self.ended is not None:  # dropped, its disconnect not yet sent
            return False
        if reason is None and self.server.logged_in() >= self.server.max_connections:  # others got in meanwhile
            self._refuse_over_cap()
            return False
        if reason is None:
            self.authenticated = True
            self.server.waiting.pop(self, None)
            self.server.touch()
            self.server.audit("connection_started", source=self.source, user=username)
            return True
        self.failures += 1
        self.server.counters.auth_failures += 1
        if reason != "rate_limited":
            self.server.auth_limiter.allow(self.source)
        log.info("ssh session %s: login from %s refused (%s)", self.server.session.session_id, self.source, reason)
        self.server.audit("auth_failed", source=self.source, reason=reason)
        if self.failures >= MAX_AUTH_TRIES and self.conn is not None:
            conn = self.conn
            asyncio.get_running_loop().call_soon(
                conn.disconnect, asyncssh.DISC_NO_MORE_AUTH_METHODS_AVAILABLE, "too many authentication failures")
        return False

    def session_requested(self) -> Any:
        if self.ended is not None or len(self.channels) >= MAX_CHANNELS or self.conn is None:
            return False
        chan = self.conn.create_server_channel(encoding=None)
        return chan, _Channel(self)


class _Channel(asyncssh.SSHServerSession):  # type: ignore[type-arg]
    """One session channel: at most one process (shell or exec)."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.server = conn.server
        self.chan: asyncssh.SSHServerChannel | None = None  # type: ignore[type-arg]
        self.pty = False
        self.term: str | None = None  # the client's TERM (OpenSSH sends "" when it has none)
        self.size = (80, 24, 0, 0)
        self.command: str | None = None  # None: shell
        self.refusal: str | None = None
        self.started_at: float | None = None  # when its process was started (none: refused before)
        self.proc: asyncio.subprocess.Process | None = None
        self.unit: str | None = None  # the transient service the process runs in, under systemd
        self._stopping: asyncio.Future[None] | None = None  # its stop, once asked for
        self.master: int | None = None
        self.done = asyncio.get_running_loop().create_future()
        self._writable = asyncio.Event()
        self._writable.set()
        self._task: asyncio.Task[None] | None = None
        self._hung_up = False
        self._early: list[bytes] = []  # what the client sent before the process existed (ssh sends at once)
        self._early_eof = False
        self._stdin_paused: asyncio.Task[None] | None = None
        self._recording: asyncio.Future[Any] | None = None
        self._streams: asyncio.Future[Any] | None = None  # the output's readers (pipes or pty), while they run
        self._streams_stopped = False
        self._ended = False  # its process ended and its output was read: a close after that is the usual end
        self._released = False  # its leader let go to be reaped (once: the pid may be another's after)
        conn.channels.add(self)

    def connection_made(self, chan: Any) -> None:
        self.chan = chan

    def pty_requested(self, term_type: str, term_size: tuple[int, int, int, int], term_modes: Any) -> bool:
        if self._task is not None:  # after the shell or exec (asyncssh allows it): its checks saw no terminal
            return False
        self.pty = True  # a restricted session's command then is refused, with the reason (exec_requested)
        self.term = term_type if term_type and term_type.isprintable() and len(term_type) <= 64 else None
        self.size = term_size
        return True

    def shell_requested(self) -> bool:
        if self.target_commands:
            self.refusal = "this session runs only its listed commands; a shell is not allowed"
        self.command = None
        return True

    def exec_requested(self, command: Any) -> bool:
        raw = command if isinstance(command, bytes) else str(command).encode("utf-8", "surrogateescape")
        if len(raw) > MAX_COMMAND_BYTES:
            self.refusal = f"the command is longer than {MAX_COMMAND_BYTES} bytes"
            self.command = raw[:MAX_COMMAND_BYTES].decode("utf-8", "replace")
            return True
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            self.refusal, self.command = "the command is not UTF-8", raw.decode("utf-8", "replace")
            return True
        self.command = text
        if "\0" in text:
            self.refusal = "the command holds a NUL byte"
        elif self.target_commands and text not in self.target_commands:
            self.refusal = "this command is not one of the session's allowed commands"
        elif self.target_commands and self.pty:
            # On a terminal, pagers and other interactive programs offer shell escapes (less's `!sh`) that nothing
            # records; on pipes they print and exit.
            self.refusal = NO_TERMINAL
        return True

    def subsystem_requested(self, subsystem: str) -> bool:
        return False

    @property
    def target_commands(self) -> tuple[str, ...]:
        return self.server.target.allowed_commands

    def session_started(self) -> None:
        self._task = asyncio.create_task(self._run())

    def data_received(self, data: bytes, datatype: Any) -> None:
        self.server.touch()
        self.conn.bytes_in += len(data)
        self.server.counters.bytes_in += len(data)
        if self.proc is None:
            if sum(map(len, self._early)) < _EARLY_INPUT_MAX:
                self._early.append(data)
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        try:
            if self.master is not None:
                os.write(self.master, data)  # the pty's buffer is large; a full one drops the rest like a tty
            elif self.proc is not None and self.proc.stdin is not None:
                self.proc.stdin.write(data)
                # A process that does not read must not make us buffer without end: stop taking the client's
                # data (its SSH window closes) until the pipe drained.
                if (self.chan is not None and self._stdin_paused is None
                        and self.proc.stdin.transport.get_write_buffer_size() > _STDIN_BUFFER_MAX):
                    self.chan.pause_reading()
                    self._stdin_paused = asyncio.create_task(self._resume_after_drain())
        except (OSError, RuntimeError):
            pass

    async def _resume_after_drain(self) -> None:
        try:
            assert self.proc is not None and self.proc.stdin is not None
            await self.proc.stdin.drain()
        except (OSError, RuntimeError):
            return  # the process closed its stdin: the channel ends with it
        finally:
            self._stdin_paused = None
        if self.chan is not None:
            self.chan.resume_reading()

    def eof_received(self) -> bool:
        if self.proc is None:
            self._early_eof = True
        elif self.master is None and self.proc.stdin is not None:
            self.proc.stdin.close()
        return True  # keep sending the output

    def terminal_size_changed(self, width: int, height: int, pixwidth: int, pixheight: int) -> None:
        self.size = (width, height, pixwidth, pixheight)
        if self.master is not None:
            _set_winsize(self.master, self.size)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.hang_up()

    def notify(self, text: str) -> None:
        if self.chan is not None and self._task is not None:
            try:
                self.chan.write_stderr(text.encode())
            except (OSError, asyncssh.Error, BrokenPipeError):
                pass

    def hang_up(self) -> None:
        """The client went away (or the session was closed) while the command ran: its process group gets
        SIGHUP, SIGKILL 2 s later. After the command's own end (the channel closing as usual) nothing is sent:
        what it left running on purpose (`nohup srv &`) stays, as with sshd."""
        if self._hung_up:
            return
        self._hung_up = True
        self._writable.set()  # nothing waits on a window that will never open again
        if self.proc is not None:
            if not self._ended:
                self._end_process_group()
        elif self._task is None:  # never started (refused before a process): its channel slot is free at once
            self.conn.channels.discard(self)
            if not self.done.done():
                self.done.set_result(None)
        if self._recording is not None:
            self._recording.cancel()

    def _end_process_group(self) -> None:
        assert self.proc is not None
        loop = asyncio.get_running_loop()
        if self.unit is not None:  # every process of the session, wherever it went: its unit's whole cgroup
            self._stopping = asyncio.ensure_future(_stop_unit(self.unit))
        if _signal_session(self.proc, signal.SIGHUP):
            loop.call_later(HANGUP_GRACE, self._kill)
        elif self._streams is not None:  # what holds the pipes left the group (setsid): stop reading them
            loop.call_later(HANGUP_GRACE, self._stop_streams)

    def _kill(self) -> None:
        """The whole group, whether or not its leader is still there (`cmd &` leaves a member behind it); then
        the pipes stop being read, since whatever still holds them left the group (setsid) and cannot be
        waited for."""
        if self.proc is not None:
            _signal_session(self.proc, signal.SIGKILL)
        if self._streams is not None:
            asyncio.get_running_loop().call_later(0.5, self._stop_streams)  # after the killed members' last output

    def _stop_streams(self) -> None:
        if self._streams is not None and not self._streams.done():
            self._streams_stopped = True
            self._streams.cancel()

    async def _send(self, data: bytes, stderr: bool = False) -> None:
        if not data or self.chan is None or self._hung_up:
            return  # nobody to read it: the process goes on to its exit status, which is what is reported
        self.server.touch()
        self.conn.bytes_out += len(data)
        self.server.counters.bytes_out += len(data)
        try:
            if stderr:
                self.chan.write_stderr(data)
            else:
                self.chan.write(data)
        except (BrokenPipeError, OSError, asyncssh.Error):  # the channel closed between hang-up and here
            return
        await self._writable.wait()

    async def _finish(self, status: int, **audit: Any) -> None:
        command = self.command if self.command is not None else "shell"
        self.server.audit("command", command=command, exit_code=status, **audit)
        if self.started_at is not None:  # a process ran: §A1.4 `ssh` activity with its exit code and times
            await self.server.emit({"command": command, "exit_code": status,
                                    "started_at": gojson.format_unix(self.started_at),
                                    "completed_at": gojson.format_unix(time.time())})
        if self.chan is not None:
            try:
                self.chan.exit(status)
            except (OSError, asyncssh.Error):
                pass

    async def _run(self) -> None:
        try:
            await self._run_process()
        except Exception:
            log.exception("ssh session %s: channel failed", self.server.session.session_id)
            await self._finish(1, refused="internal error")
        finally:
            if self.proc is not None:
                self._release(self.proc)  # whatever happened, its leader is not kept a zombie
            self.conn.channels.discard(self)
            if not self.done.done():
                self.done.set_result(None)

    async def _run_process(self) -> None:
        if self.refusal is not None:
            await self._send(f"plexd: {self.refusal}\r\n".encode(), stderr=True)
            await self._finish(1, refused=self.refusal)
            return
        try:
            user = resolve_user(self.server.target.user)
        except UserRefused as exc:
            await self._send(f"plexd: {exc}\r\n".encode(), stderr=True)
            await self._finish(1, refused=str(exc))
            return
        if self.command is not None and not await self._recorded(self.command):
            if self._hung_up:
                return
            await self._send(f"plexd: {NOT_RECORDED}\r\n".encode(), stderr=True)
            await self._finish(1, refused="not recorded")
            return
        if self._hung_up:
            return
        self.started_at = time.time()
        await self._spawn(user)
        # Held from its start (children_held): its group's id stays ours until _pump releases it.
        if self._hung_up:  # the client went while the process was being started: hang-up saw no process
            self._end_process_group()
        for data in self._early:
            self._feed(data)
        self._early.clear()
        if self._early_eof:
            self.eof_received()
        returncode = await self._pump()
        await self._finish(exit_status(returncode))

    async def _recorded(self, command: str) -> bool:
        try:
            result = self.server.record_command(self.server.session.session_id, command)
            if inspect.isawaitable(result):
                self._recording = asyncio.ensure_future(result)  # a hang-up cancels it: nothing is run then
                result = await asyncio.wait_for(self._recording, RECORD_TIMEOUT)
            return result is True and not self._hung_up
        except asyncio.CancelledError:
            if self._hung_up:  # our own cancel; the channel's task goes on to end quietly
                return False
            raise
        except Exception as exc:  # a timeout or a failed report: the command is not run
            log.warning("ssh session %s: command not recorded (%s)", self.server.session.session_id,
                        type(exc).__name__)
            return False

    async def _spawn(self, user: LocalUser) -> None:
        # A shell is a login shell (argv[0] "-bash", as login(1) starts it); an exec is `<shell> -c COMMAND`.
        program = user.shell
        name = os.path.basename(program)
        args = ["-" + name] if self.command is None else [name, "-c", self.command]
        env = login_environment(user, self.term, restricted=bool(self.target_commands))
        ids: dict[str, Any] = {}
        unit = self._unit_argv(user, env)
        if unit is not None:  # systemd starts it, as the user, outside plexd's sandbox (`session_unit_argv`)
            args, program, env = unit, unit[0], child_environment()
        elif os.geteuid() == 0:
            prefix = None if self.pty or self.command is None else switch_user_argv(user)
            if prefix is None:
                ids = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
            else:  # the exec's process becomes the user in setpriv: the daemon is not forked (see there)
                args, program = [*prefix, program, *args[1:]], prefix[0]
        cwd = user.home if os.path.isdir(user.home) else "/"
        if self.pty:
            master, slave = pty.openpty()
            try:
                _set_winsize(master, self.size)
                os.set_blocking(master, False)
                if ids:  # (a session's unit gets a terminal of its own from systemd-run --pty)
                    _give_terminal(slave, user)
                with children_held():
                    self.proc = await asyncio.create_subprocess_exec(
                        *args, executable=program, stdin=slave, stdout=slave, stderr=slave, env=env,
                        cwd=cwd, start_new_session=True, preexec_fn=_take_controlling_tty, **ids)
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            self.master = master
        else:
            with children_held():
                self.proc = await asyncio.create_subprocess_exec(
                    *args, executable=program, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd,
                    start_new_session=True, **ids)

    def _unit_argv(self, user: LocalUser, env: dict[str, str]) -> list[str] | None:
        """Under systemd (plexd a unit, run as root), the command line that starts this channel's process in a
        transient service of its own; None: plexd starts it itself (no systemd: a container, a lab)."""
        if os.geteuid() != 0 or not systemd.in_unit():
            return None
        sid = re.sub(r"[^A-Za-z0-9_-]", "_", self.server.session.session_id)[:40]
        unit = f"plexd-session-{sid}-{secrets.token_hex(4)}.service"
        # a login shell: `-l` (systemd-run cannot set argv[0] to "-bash")
        argv = [user.shell, "-l"] if self.command is None else [user.shell, "-c", self.command]
        found = session_unit_argv(unit, user, env, argv, pty=self.pty, bound_to=systemd.own_unit())
        if found is not None:
            self.unit = unit
        return found

    async def _pump(self) -> int:
        proc = self.proc
        assert proc is not None
        if self.master is not None:
            self._streams = asyncio.ensure_future(self._pump_pty(self.master))  # closes the master when it ends
        else:
            assert proc.stdout is not None and proc.stderr is not None
            self._streams = asyncio.gather(self._pump_stream(proc.stdout, False), self._pump_stream(proc.stderr, True))
        if self._hung_up:  # gone while the process was starting: nobody waits on what its leftovers hold
            asyncio.get_running_loop().call_later(HANGUP_GRACE + 0.5, self._stop_streams)
        try:
            await self._streams
        except asyncio.CancelledError:
            if not self._streams_stopped:
                self._release(proc)
                raise  # our own task is being cancelled, not only the readers
            _close_pipes(proc)
        finally:
            self._streams = None
        if self._hung_up:
            _signal_session(proc, signal.SIGKILL)  # whatever of its group is left (the leader is still held)
        self._release(proc)
        returncode = await proc.wait()
        if not self._hung_up:
            self._ended = True
        return returncode

    def _release(self, proc: asyncio.subprocess.Process) -> None:
        if not self._released:
            self._released = True
            release_reaping(proc.pid)

    async def _pump_stream(self, stream: asyncio.StreamReader, stderr: bool) -> None:
        while data := await stream.read(1 << 16):
            await self._send(data, stderr)

    async def _pump_pty(self, master: int) -> None:
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(master, readable.set)
        try:
            while True:
                await readable.wait()
                readable.clear()
                try:
                    data = os.read(master, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno == errno.EIO:  # every slave closed: the process and its children are gone
                        return
                    raise
                if not data:
                    return
                await self._send(data)
        finally:
            loop.remove_reader(master)
            os.close(master)
            self.master = None


def _ack_at_once(conn: asyncssh.SSHServerConnection) -> None:
    """ACK what arrives at once instead of after the kernel's delayed-ACK timer.

    Once the server has answered a packet, Linux treats the connection as interactive and holds its ACKs for up
    to 40 ms to ride on the next reply. In the handshake OpenSSH writes NEWKEYS and then SERVICE_REQUEST, and
    Nagle keeps the second back until the first is ACKed: 40 of a loopback login's 60 ms went there. Quick-ACK
    mode does not last, so it is set again after every read (one setsockopt beside a decrypt)."""
    sock = conn.get_extra_info("socket")
    quickack = getattr(socket, "TCP_QUICKACK", None)
    if sock is None or quickack is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    received = conn.data_received

    def data_received(data: bytes, datatype: Any = None) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, quickack, 1)
        except OSError:  # the socket is closing: its ACKs no longer matter
            pass
        received(data, datatype)

    conn.data_received = data_received  # type: ignore[method-assign]


def _close_pipes(proc: asyncio.subprocess.Process) -> None:
    """Close the output pipes of a process whose readers were stopped. Not the transport's close(): it poll()s
    the process, which can reap it before the child watcher reads its exit status. (asyncio's Process keeps
    its transport private; the pipe transports are public on it.)"""
    transport = getattr(proc, "_transport", None)
    for fd in (1, 2):
        pipe = transport.get_pipe_transport(fd) if transport is not None else None
        if pipe is not None:
            pipe.close()


def _give_terminal(slave: int, user: LocalUser) -> None:
    """The pty to its user, group tty, 0620, as login(1) and sshd leave it: programs that reopen their terminal
    by name (screen, script, gpg's pinentry) must be able to."""
    try:
        group = grp.getgrnam("tty").gr_gid
        mode = 0o620
    except KeyError:  # no tty group here: the user's own group, not writable by it
        group, mode = user.gid, 0o600
    os.fchown(slave, user.uid, group)
    os.fchmod(slave, mode)


def _take_controlling_tty() -> None:
    """In the child, after setsid: make the pty on stdin its controlling terminal (job control, ^C)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _set_winsize(fd: int, size: tuple[int, int, int, int]) -> None:
    width, height, pixwidth, pixheight = size
    try:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, pixwidth, pixheight))
    except OSError:
        pass


async def _stop_unit(unit: str) -> None:
    """Stop a session's unit: SIGHUP to every process in it, SIGKILL 1.5 s later (`SESSION_UNIT_PROPERTIES`)."""
    try:
        proc = await asyncio.create_subprocess_exec("systemctl", "stop", "--no-block", unit, env=child_environment(),
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
    except OSError as exc:
        log.error("could not stop %s: %s", unit, exc)
        return
    if proc.returncode != 0:
        log.error("could not stop %s: %s", unit, err.decode(errors="replace").strip())


def _signal_session(proc: asyncio.subprocess.Process, sig: int) -> bool:
    """Signal the process group a command leads or led (it was started in a session, and so a group, of its
    own); False when nothing was signalled.

    Only while its leader is not reaped: until then the leader's pid, and with it the group's id, cannot be
    given out again, so killpg reaches this group and no other. The channel holds its leader unreaped from its
    start (`children_held`) until it is done with the group; where that cannot be done (Python 3.12+), a reaped
    leader's group is left alone rather than risk signalling a stranger's that took its id."""
    if proc.returncode is not None:
        return False
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True

