"""The sessions domain: the access proxy's listeners and live sessions, converged to the desired sessions block
(docs/protocol.md §A1).

Desired: `desired.sessions`, the block of the last state pull, with the session events applied on it, and
persisted with the rest of the model (a revoked session's token stays refused across a restart). Observed: the
listeners this daemon runs and whether the kernel still lists each one's socket as listening (/proc/net/tcp).
The plan, each change also its drift line:

    SessionOpened      session_started             a session in the block, not expired, without a listener
    SessionClosed      session_closed              a listener whose session left the block or expired
    SessionReplaced    session_replaced            a listener serving other terms than the block's entry now
                                                   names (target, allowed commands, expiry, idle), or on an old
                                                   mesh IP: its connections end (revoked), a new one is reported
    ListenerRestarted  session_listener_restarted  a listener the kernel no longer lists: a new one, reported
    ListenerRebound    session_listener_rebound    a listener limited to a mesh interface since recreated: moved
                                                   to the new one, in place (its port and connections stay)
    SessionUnenforced  session_closed              a listener while the policy is not enforced (nftables
                                                   unusable, or no table in place), or a TCP session's while
                                                   policy.enabled is false: closed, none opens meanwhile

A session that ended by itself (its idle timeout, its `expires_at`) is not reopened while its entry stays as it
was; a changed entry (a later `expires_at`) opens it again.

A hold (`plexd reconcile hold`) does not stop this domain (`acts_while_held`): a hold must never keep a revoked
or expired session admitting. A session opened while the firewall is held stays unreachable until the firewall
admits its mark (the default deny). A device kept as it is until the first state pull (a restart with it up)
does keep this domain planning only: no session is served from the mirror before the control plane's word.
Every listener binds the node's mesh IP (port chosen by the kernel) and takes connections arriving on the mesh
interface only (`plexd.base.serving.mesh_listener`: kernel-enforced, in every policy mode, so nothing reaches a
session around the firewall), and its socket carries the session's mark (`socket_marks`), which the firewall's
session rules match: who may connect is the policy's say, from the same block (`plexd.firewall.ruleset`). While
the policy cannot be enforced at all (nftables unusable), no session is open (`unenforced`: fail closed).
Activity (§A1.4) goes to `hooks.report`, the durable uplink.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from nacl.signing import VerifyKey

from plexd.access.activity import Audit, RecordCommand, Report
from plexd.access.k8s import ApiServer, K8sSession
from plexd.access.ssh_host_key import HostKeyError, load_or_create_host_key
from plexd.access.ssh_limits import auth_failure_limiter
from plexd.access.tcp import TcpSession
from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.state.desired import DesiredState
from plexd.state.sessions_block import Session, Sessions, socket_marks

log = logging.getLogger(__name__)

PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"


@dataclass(frozen=True)
class SessionOpened(Change):
    correction_type: ClassVar[str] = "session_started"
    session_id: str
    kind: str

    @property
    def detail(self) -> str:
        return f"session {self.session_id} ({self.kind}): no listener"


@dataclass(frozen=True)
class SessionClosed(Change):
    correction_type: ClassVar[str] = "session_closed"
    session_id: str
    reason: str  # operator_revoke (left the block) or ttl_expired

    @property
    def detail(self) -> str:
        why = "expired" if self.reason == "ttl_expired" else "no longer granted"
        return f"session {self.session_id}: {why}, its listener still open"


@dataclass(frozen=True)
class SessionReplaced(Change):
    correction_type: ClassVar[str] = "session_replaced"
    session_id: str
    endpoint: str

    @property
    def detail(self) -> str:
        return f"session {self.session_id}: listener {self.endpoint} serves terms its entry no longer names"


@dataclass(frozen=True)
class SessionUnenforced(Change):
    correction_type: ClassVar[str] = "session_closed"
    session_id: str
    why: str

    @property
    def detail(self) -> str:
        return f"session {self.session_id}: closed: who may reach it cannot be enforced ({self.why})"


@dataclass(frozen=True)
class ListenerRebound(Change):
    correction_type: ClassVar[str] = "session_listener_rebound"
    session_id: str
    endpoint: str

    @property
    def detail(self) -> str:
        return (f"session {self.session_id}: listener {self.endpoint} took connections from a mesh interface since "
                "recreated")


@dataclass(frozen=True)
class ListenerRestarted(Change):
    correction_type: ClassVar[str] = "session_listener_restarted"
    session_id: str
    endpoint: str

    @property
    def detail(self) -> str:
        return f"session {self.session_id}: listener {self.endpoint} is no longer listening"


@dataclass
class AccessHooks:
    """What the sessions need from the daemon, as callables (built by plexd.node.access)."""

    keys: Callable[[], Iterable[VerifyKey]]  # the control plane's signing keys trusted now
    report: Report  # §A1.4 activity, durable
    record_command: RecordCommand  # an exec runs only once this returned True
    audit: Audit
    k8s_api: Callable[[], ApiServer | None] = lambda: None
    now: Callable[[], float] = time.time


class Listener(Protocol):
    session: Session
    bind_host: str
    port: int
    closed: str | None
    device_index: int  # the interface the listener takes connections from (`plexd.base.serving.mesh_listener`)

    @property
    def listener_endpoint(self) -> str: ...

    async def start(self) -> int: ...

    async def close(self, reason: str) -> None: ...

    def listening_sockets(self) -> list[Any]: ...

    def rebind(self, index: int) -> None: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Seen:
    endpoint: str
    closed: str | None  # it ended by itself (ttl_expired, idle_timeout)
    listening: bool
    session: Session | None = None  # the entry it serves
    bind_host: str = ""
    rebind: bool = False  # limited to an interface index the mesh interface no longer has (it was recreated)


@dataclass
class _Muted:
    """A replaced listener's reports stop: the session did not end, only its socket was replaced."""

    on: bool = False
    sent: list[str] = field(default_factory=list)


class SessionsDomain:
    name = "sessions"
    touches_machine = True
    acts_while_held = True  # a hold never keeps a revoked session open (see the module's docstring)

    def __init__(self, data_dir: str | Path, hooks: AccessHooks, unenforced: Callable[[], str] = lambda: "",
                 policy_enabled: bool = True) -> None:
        """`unenforced`: why the policy is not enforced now ("" when it is, or when there is none to enforce): the
        firewall's word, asked at each plan (the firewall applies first, so it speaks of this converge). While it
        says why, no session is open (fail closed). `policy_enabled` false: no policy says who may reach a
        session, so a TCP session, which has no token, is not opened either."""
        self.data_dir = Path(data_dir)
        self.hooks = hooks
        self.unenforced = unenforced
        self.policy_enabled = policy_enabled
        self._unenforced_now: dict[str, str] = {}  # the sessions the last plan did not open, and why
        self._live: dict[str, Listener] = {}
        self._muted: dict[str, _Muted] = {}
        self._ended: dict[str, tuple[str, Session]] = {}  # ended by themselves, still in the block -> why, entry
        self._granted: Sessions | None = None  # the block the last apply served: tokens admit only these
        self._auth_limiter = auth_failure_limiter()  # shared by every session: failures count per source
        self._logged_refusals: set[tuple[str, str]] = set()

    # -- the domain --------------------------------------------------------------------------------------------

    async def observe(self, desired: DesiredState) -> dict[str, Seen]:
        listening = await asyncio.to_thread(kernel_listeners) if self._live else set()
        index = _interface_index(desired.interface) if self._live else 0
        return {sid: _seen(lst, (_normal(lst.bind_host), lst.port) in listening, index)
                for sid, lst in self._live.items()}

    def plan(self, desired: DesiredState, observed: dict[str, Seen]) -> DomainResult:
        want = desired.sessions.by_id if desired.sessions is not None else {}
        now = self.hooks.now()
        enforced = self.unenforced()
        self._unenforced_now = {sid: why for sid, s in want.items() if (why := self._unenforceable(s, enforced))}
        changes: list[Change] = []
        for sid, seen in sorted(observed.items()):
            if seen.closed is not None:
                continue
            session = want.get(sid)
            if sid in self._unenforced_now:  # fail closed
                changes.append(SessionUnenforced(sid, self._unenforced_now[sid]))
                continue
            if session is None:  # gone from the block; an expired one may have been dropped as such
                expired = seen.session is not None and seen.session.expired(now)
                changes.append(SessionClosed(sid, "ttl_expired" if expired else "operator_revoke"))
            elif session.expired(now):
                changes.append(SessionClosed(sid, "ttl_expired"))
            elif seen.session is not None and (seen.session != session or seen.bind_host != desired.mesh_ip):
                changes.append(SessionReplaced(sid, seen.endpoint))
            elif not seen.listening:
                changes.append(ListenerRestarted(sid, seen.endpoint))
            elif seen.rebind:
                changes.append(ListenerRebound(sid, seen.endpoint))
        for sid, session in sorted(want.items()):
            ended = self._ended.get(sid)
            if (sid not in observed and (ended is None or ended[1] != session) and not session.expired(now)
                    and sid not in self._unenforced_now):
                changes.append(SessionOpened(sid, session.kind))
        return DomainResult(tuple(changes), tuple(f"sessions: session {sid}: not opened: who may reach it cannot be "
                                                  f"enforced ({why})" for sid, why in self._unenforced_now.items()))

    def _unenforceable(self, session: Session, unenforced: str) -> str:
        if unenforced:
            return unenforced
        if session.kind == "tcp" and not self.policy_enabled:
            return "a TCP session has no token, and with policy.enabled false nothing says who may reach it"
        return ""

    async def apply(self, desired: DesiredState, planned: DomainResult, observed: Any) -> DomainResult:
        self._granted = desired.sessions  # first: a revoked token is refused before its listener closes
        self._note_refusals(desired.sessions)
        want = desired.sessions.by_id if desired.sessions is not None else {}
        applied: list[Change] = []
        errors: list[str] = []
        for change in planned.changes:
            sid = getattr(change, "session_id", "")
            try:
                if isinstance(change, SessionClosed):
                    await self._close(sid, change.reason)
                elif isinstance(change, SessionUnenforced):
                    await self._close(sid, "plexd_close")
                elif isinstance(change, ListenerRebound):  # in place: the port and the connections stay
                    self._live[sid].rebind(_interface_index(desired.interface))
                elif isinstance(change, ListenerRestarted):
                    self._muted[sid].on = True
                    await self._close(sid, "plexd_close")
                    await self._open(want[sid], desired)
                elif isinstance(change, SessionReplaced):
                    # The old terms are revoked for whoever holds them; the session itself goes on, reported anew.
                    self._muted[sid].on = True
                    await self._close(sid, "operator_revoke")
                    await self._open(want[sid], desired)
                elif isinstance(change, SessionOpened):
                    await self._open(want[sid], desired)
                applied.append(change)
            except (OSError, ValueError, HostKeyError) as exc:
                errors.append(f"sessions: session {sid}: {exc}")
        self._forget(want)
        errors += self._mark(want)
        return DomainResult(tuple(applied), tuple(errors))

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        # No machine read: the listeners are this process's own. A dead socket is found by the next full converge.
        seen = {sid: _seen(lst, True) for sid, lst in self._live.items()}
        return await self.apply(desired, self.plan(desired, seen), seen)

    async def teardown(self) -> None:
        await self.close_all("plexd_close")

    def status(self) -> dict[str, Any] | None:
        if not self._live and not self._ended and self._granted is None:
            return None
        refused = [{"session_id": sid, "reason": why}
                   for sid, why in (self._granted.rejected if self._granted is not None else ())]
        refused += [{"session_id": sid, "reason": f"not opened: who may reach it cannot be enforced ({why})"}
                    for sid, why in sorted(self._unenforced_now.items())]
        return {"live": [lst.status() for _, lst in sorted(self._live.items())],
                "ended": {sid: why for sid, (why, _) in sorted(self._ended.items())},
                "refused": refused}

    # -- the listeners -----------------------------------------------------------------------------------------

    async def close_all(self, reason: str) -> None:
        """Every session closed with `reason` (the daemon stops: clients are told, processes hung up)."""
        self._granted = None
        await asyncio.gather(*(self._close(sid, reason) for sid in list(self._live)), return_exceptions=True)

    def granted(self, session_id: str) -> bool:
        return self._granted is not None and session_id in self._granted.by_id

    async def _close(self, sid: str, reason: str) -> None:
        listener = self._live.pop(sid, None)
        if listener is not None:
            await listener.close(reason)

    async def _open(self, session: Session, desired: DesiredState) -> None:
        if not desired.mesh_ip:
            raise ValueError("this node has no mesh IP yet to listen on")
        muted = self._muted[session.session_id] = _Muted()
        listener = self._listener(session, desired.mesh_ip, desired.interface, self._reporter(muted))
        await listener.start()
        self._live[session.session_id] = listener

    def _listener(self, session: Session, mesh_ip: str, interface: str, report: Report) -> Listener:
        """A listener on the mesh IP that takes connections arriving on the mesh interface only
        (`plexd.base.serving.mesh_listener`)."""
        hooks = self.hooks
        if session.kind == "ssh":
            # Lazily: asyncssh is ~20 MiB a node without SSH sessions never needs (plexd's RSS goal is 50 MiB).
            from plexd.access.ssh import SshSessionServer

            return SshSessionServer(session, mesh_ip, host_key=load_or_create_host_key(self.data_dir),
                                    keys=hooks.keys, is_live=self.granted, record_command=hooks.record_command,
                                    audit=hooks.audit, report=report, now=hooks.now,
                                    auth_limiter=self._auth_limiter, device=interface)
        if session.kind == "tcp":
            return TcpSession(session, mesh_ip, report=report, now=hooks.now, device=interface)
        api = hooks.k8s_api()
        if api is None:
            raise ValueError("no Kubernetes API server to proxy to (set access.kubernetes.url, or run in a cluster)")
        from plexd.access.certificate import load_or_create  # lazily, as SSH: cryptography's x509 for k8s only

        tls = load_or_create(self.data_dir, [mesh_ip]).server_context()
        return K8sSession(session, mesh_ip, api, tls=tls, keys=hooks.keys, is_live=self.granted, report=report,
                          now=hooks.now, device=interface)

    def _reporter(self, muted: _Muted) -> Report:
        async def report(session_id: str, body: dict[str, Any]) -> None:
            if not muted.on:
                result = self.hooks.report(session_id, body)
                if isinstance(result, Awaitable):
                    await result
        return report

    def _forget(self, want: dict[str, Session]) -> None:
        """Listeners that ended by themselves leave `_live`; sessions gone from the block leave `_ended`."""
        for sid, listener in list(self._live.items()):
            if listener.closed is not None:
                self._ended[sid] = (listener.closed, listener.session)
                del self._live[sid]
        self._ended = {sid: ended for sid, ended in self._ended.items() if sid in want}
        self._muted = {sid: m for sid, m in self._muted.items() if sid in self._live}

    def _mark(self, want: dict[str, Session]) -> list[str]:
        """Each listener's socket gets its session's mark (marks are a function of the whole block, so a session
        coming or going can move another's on a hash collision: all are set every time)."""
        marks = socket_marks(want)
        errors = []
        for sid, listener in self._live.items():
            try:
                for sock in listener.listening_sockets():
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, marks[sid])
            except OSError as exc:
                errors.append(f"sessions: session {sid}: cannot mark its listener for the firewall ({exc.strerror}); "
                              "while the policy is enforced nobody can reach it")
        return errors

    def _note_refusals(self, sessions: Sessions | None) -> None:
        for sid, why in sessions.rejected if sessions is not None else ():
            if (sid, why) not in self._logged_refusals:
                self._logged_refusals.add((sid, why))
                log.error("session %s refused: %s", sid, why)


def _seen(listener: Listener, listening: bool, interface_index: int = 0) -> Seen:
    """`interface_index`: the mesh interface's now (0: gone, or not read: a listener is not rebound then)."""
    rebind = bool(interface_index and listener.device_index and listener.device_index != interface_index)
    return Seen(listener.listener_endpoint, listener.closed, listening, listener.session, listener.bind_host, rebind)


def _interface_index(name: str) -> int:
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return 0


def kernel_listeners(paths: Iterable[str] = PROC_TCP) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the kernel lists as listening in this network namespace."""
    out: set[tuple[str, int]] = set()
    for path in paths:
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != _LISTEN:
                continue
            address, _, port = fields[1].partition(":")
            out.add((_address(address), int(port, 16)))
    return out


def _normal(address: str) -> str:
    return str(ipaddress.ip_address(address))


def _address(hex_text: str) -> str:
    """/proc/net/tcp prints an address as 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)
