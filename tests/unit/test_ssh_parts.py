"""The pure parts of SSH sessions: admission (token, liveness, user, rate limit), the login environment, exit
statuses, the host key file, and what the server refuses to be built with."""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nacl.signing import SigningKey

from plexd.access.ssh import SshSessionServer, _ack_at_once
from plexd.access.ssh_host_key import HOST_KEY_NAME, HostKeyError, fingerprint, load_or_create_host_key
from plexd.access.ssh_limits import auth_failure_limiter
from plexd.access.ssh_process import SAFE_PATH, LocalUser, UserRefused, exit_status, login_environment, resolve_user
from plexd.access.token import sign_session_token
from plexd.state.sessions_block import Session, SshTarget, TcpTarget

NOW = 1_800_000_000.0
KEY = SigningKey.generate()


@pytest.fixture(scope="module")
def host_key(tmp_path_factory):
    return load_or_create_host_key(tmp_path_factory.mktemp("hostkey"))


def server(host_key, *, live=True, allowed=(), clock=None, limiter=None) -> SshSessionServer:
    session = Session("ses_1", "ssh", SshTarget("deploy", tuple(allowed)), NOW + 600)
    return SshSessionServer(session, "127.0.0.1", host_key=host_key, keys=lambda: [KEY.verify_key],
                            is_live=lambda sid: live and sid == "ses_1", record_command=lambda s, c: True,
                            now=clock or (lambda: NOW), auth_limiter=limiter)


def token(key=KEY, **overrides) -> str:
    claims = {"jti": "ses_1", "kind": "ssh", "target": {"kind": "ssh", "user": "deploy"}, "nbf": NOW - 1,
              "exp": NOW + 600}
    claims.update(overrides)
    return sign_session_token(key, claims)


def test_a_valid_token_of_a_live_session_admits_its_user(host_key):
    assert server(host_key).check_password("deploy", token(), "10.100.0.2") is None


@pytest.mark.parametrize("user, password, reason", [
    ("root", token(), "user"),
    ("deploy", token(exp=NOW), "expired"),
    ("deploy", token(nbf=NOW + 31), "not_yet_valid"),
    ("deploy", token(jti="ses_2"), "session"),
    ("deploy", token(kind="tcp"), "kind"),
    ("deploy", token(target={"kind": "ssh", "user": "other"}), "target"),
    ("deploy", token(target={"kind": "ssh", "user": "deploy", "allowed_commands": ["id"]}), "target"),
    ("deploy", token(key=SigningKey.generate()), "signature"),
    ("deploy", "x" * 65536, "malformed"),
    ("deploy", "", "malformed"),
])
def test_every_refusal_names_its_reason(host_key, user, password, reason):
    assert server(host_key).check_password(user, password, "10.100.0.2") == reason


def test_a_token_within_the_skew_is_admitted(host_key):
    assert server(host_key).check_password("deploy", token(nbf=NOW + 29), "10.100.0.2") is None


def test_a_revoked_session_refuses_a_valid_token(host_key):
    assert server(host_key, live=False).check_password("deploy", token(), "10.100.0.2") == "revoked"


def test_a_token_naming_the_sessions_allowed_commands_is_admitted(host_key):
    t = token(target={"kind": "ssh", "user": "deploy", "allowed_commands": ["id"]})
    assert server(host_key, allowed=["id"]).check_password("deploy", t, "10.100.0.2") is None


def test_failures_are_limited_per_source_address_and_other_addresses_keep_working(host_key):
    clock = [0.0]
    limiter = auth_failure_limiter(clock=lambda: clock[0])
    srv = server(host_key, limiter=limiter)
    for _ in range(10):
        assert srv.check_password("deploy", token(key=SigningKey.generate()), "10.100.0.9") == "signature"
        limiter.allow("10.100.0.9")  # what the connection does with each failure
    assert srv.check_password("deploy", token(), "10.100.0.9") == "rate_limited"
    assert srv.check_password("deploy", token(), "10.100.0.3") is None
    clock[0] += 6.0  # one failure's worth refilled
    assert srv.check_password("deploy", token(), "10.100.0.9") is None


def test_the_server_refuses_all_interfaces_and_other_kinds(host_key):
    ssh = Session("s", "ssh", SshTarget("deploy"), NOW + 60)
    for everywhere in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="never on all interfaces"):
            SshSessionServer(ssh, everywhere, host_key=host_key, keys=list, is_live=bool,
                             record_command=lambda s, c: True)
    tcp = Session("s", "tcp", TcpTarget("127.0.0.1", 22), NOW + 60)
    with pytest.raises(ValueError, match="not ssh"):
        SshSessionServer(tcp, "127.0.0.1", host_key=host_key, keys=list, is_live=bool,
                         record_command=lambda s, c: True)


def test_the_login_environment_holds_only_the_login_variables():
    user = LocalUser("deploy", 1001, 1001, (1001, 27), "/home/deploy", "/bin/bash")
    assert login_environment(user, "xterm-256color") == {
        "HOME": "/home/deploy", "USER": "deploy", "LOGNAME": "deploy", "SHELL": "/bin/bash", "PATH": SAFE_PATH,
        "TERM": "xterm-256color"}
    assert login_environment(user, None)["TERM"] == "dumb"


def test_exit_statuses_of_signal_deaths_are_128_plus_the_signal():
    assert [exit_status(rc) for rc in (0, 1, 255, -9, -15, -1)] == [0, 1, 255, 137, 143, 129]


def test_an_unknown_user_is_refused_and_root_resolves_with_its_groups():
    with pytest.raises(UserRefused, match="no local user"):
        resolve_user("plexd-no-such-user")
    if os.geteuid() == 0:
        root = resolve_user("root")
        assert (root.uid, root.gid, root.home) == (0, 0, "/root") and 0 in root.groups


def test_the_host_key_is_made_once_0600_and_reused(tmp_path):
    first = load_or_create_host_key(tmp_path)
    path = tmp_path / HOST_KEY_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_host_key(tmp_path)
    assert fingerprint(first) == fingerprint(again) and fingerprint(first).startswith("SHA256:")
    assert first.algorithm == b"ssh-ed25519"


def test_a_host_key_readable_by_others_or_not_a_key_is_refused(tmp_path):
    load_or_create_host_key(tmp_path)
    path = tmp_path / HOST_KEY_NAME
    path.chmod(0o644)
    with pytest.raises(HostKeyError, match="readable by others"):
        load_or_create_host_key(tmp_path)
    path.write_bytes(b"not a key")
    path.chmod(0o600)
    with pytest.raises(HostKeyError, match="not a usable private key") as exc:
        load_or_create_host_key(tmp_path)
    assert "not a key" not in str(exc.value)


def test_the_auth_limiter_is_per_address():
    limiter = auth_failure_limiter(clock=time.monotonic)
    for _ in range(10):
        limiter.allow("a")
    assert limiter.blocked("a") and not limiter.blocked("b")


class _ConnectionStandIn:
    """The two things `_ack_at_once` uses of asyncssh's connection: its socket (a real one) and data_received."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received: list[tuple[bytes, object]] = []

    def get_extra_info(self, name: str) -> object:
        return self.sock if name == "socket" else None

    def data_received(self, data: bytes, datatype: object = None) -> None:
        self.received.append((data, datatype))


def test_each_read_puts_the_connection_back_in_quick_ack_mode_and_still_reaches_asyncssh():
    """Without it, the kernel holds the ACK of OpenSSH's NEWKEYS for 40 ms while Nagle holds its next packet back
    (bench ssh_sessions: a login took 60 ms on loopback, 16 ms with it)."""
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as client:
        served, _ = listener.accept()
        with served:
            conn = _ConnectionStandIn(served)
            _ack_at_once(conn)  # type: ignore[arg-type]
            client.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            data = served.recv(100)
            # what the kernel does once the server has answered a packet: delayed ("interactive") ACKs. Set just
            # before the read is handed on, so the kernel's 40 ms timer cannot have ended that mode by itself.
            served.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)
            assert served.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 0
            conn.data_received(data)
            assert served.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1
            assert conn.received == [(b"SSH-2.0-OpenSSH_9.2\r\n", None)]
            served.close()
            conn.data_received(b"late")  # a read racing the close still reaches asyncssh, no error
            assert conn.received[-1] == (b"late", None)


@given(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300))
def test_the_saslprep_fast_path_is_asyncssh_s_own_answer_for_printable_ascii(text):
    from asyncssh.saslprep import saslprep as full

    from plexd.access.ssh_saslprep import saslprep

    assert saslprep(text) == full(text) == text


@given(st.text(max_size=40))
def test_the_saslprep_fast_path_gives_anything_else_to_asyncssh(text):
    from asyncssh.saslprep import SASLPrepError
    from asyncssh.saslprep import saslprep as full

    from plexd.access.ssh_saslprep import saslprep

    try:
        expected: object = full(text)
    except SASLPrepError as e:
        expected = type(e)
    try:
        got: object = saslprep(text)
    except SASLPrepError as e:
        got = type(e)
    assert got == expected


def test_asyncssh_s_server_uses_the_fast_path_once_ssh_sessions_are_loaded():
    import asyncssh.auth
    import asyncssh.connection

    from plexd.access.ssh_saslprep import saslprep

    assert asyncssh.auth.saslprep is saslprep and asyncssh.connection.saslprep is saslprep
    assert saslprep("x\u00a0y") == "x y"  # a non-ASCII space: mapped by SASLprep, as asyncssh maps it
    with pytest.raises(asyncssh.saslprep.SASLPrepError):
        saslprep("x\x07y")  # an ASCII control: prohibited


async def test_a_leader_is_kept_unreaped_so_its_group_is_signalled_and_never_a_reused_id(tmp_path):
    # A group's id is its leader's pid; once the leader is reaped the kernel may give the number out again, and a
    # newcomer that starts a session of its own leads a group of that same id. The channel keeps its leader a
    # zombie (children_held) while it signals the group; a reaped leader's group is never signalled.
    import asyncio
    import signal
    from types import SimpleNamespace

    from plexd.access.ssh import _signal_session
    from plexd.base.children import children_held, release_reaping, watch_children_with_pidfds

    assert _signal_session(SimpleNamespace(pid=os.getpid(), returncode=0), 0) is False  # reaped: left alone
    previous = asyncio.get_child_watcher()
    try:
        assert watch_children_with_pidfds()
        pid_file = tmp_path / "member"
        with children_held():
            proc = await asyncio.create_subprocess_exec(
                "sh", "-c", f"sleep 60 & echo $! > {pid_file}; exec sleep 60", start_new_session=True)
        for _ in range(250):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            await asyncio.sleep(0.02)
        member = int(pid_file.read_text())
        os.kill(proc.pid, signal.SIGKILL)  # the leader goes; held, it stays a zombie and keeps the group's id
        for _ in range(250):
            if _state(proc.pid) == "Z":
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert _state(proc.pid) == "Z" and proc.returncode is None
        assert _signal_session(proc, signal.SIGKILL) is True  # killpg: the member goes too
        for _ in range(250):
            if _state(member) in ("", "Z"):
                break
            await asyncio.sleep(0.02)
        assert _state(member) in ("", "Z"), "the group's member was not killed"
        release_reaping(proc.pid)
        assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL  # the exit status still arrives
        assert _signal_session(proc, signal.SIGKILL) is False
    finally:
        asyncio.set_child_watcher(previous)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
