"""The sessions domain through the real engine, with real listeners on loopback (the mesh IP is 127.0.0.1 here):
a session in the block is opened and reported, its socket marked for the firewall; a listener the kernel no
longer lists is drift, restarted and reported anew; a session that leaves the block is closed; one that ended by
itself is not reopened; an expired one is never opened. The firewall side is in tests/e2e/test_access_lab.py."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import pytest
from engine_helpers import converge
from waiting import wait_for

from plexd.access.sessions_domain import AccessHooks, SessionsDomain, kernel_listeners
from plexd.converge.engine import Mode
from plexd.state.desired import DesiredState
from plexd.state.model import State
from plexd.state.sessions_block import socket_marks

FAR = "2999-01-01T00:00:00Z"

pytestmark = pytest.mark.root  # SO_MARK needs CAP_NET_ADMIN


def tcp(sid: str, port: int, expires: str = FAR, idle: int = 0) -> dict:
    return {"session_id": sid, "jti": sid, "kind": "tcp", "target": {"tcp": {"host": "127.0.0.1", "port": port}},
            "expires_at": expires, "idle_timeout_seconds": idle}


def model(*sessions: dict) -> DesiredState:
    # the mesh interface is loopback here: the listeners take connections arriving on it only
    base = DesiredState.initial(interface="lo", listen_port=51820, mtu=1420, private_key="", mesh_ip="127.0.0.1")
    return base.with_state(State.from_wire({"sessions": list(sessions)}))


@pytest.fixture
async def echo():
    async def serve(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


@pytest.fixture
async def sessions(tmp_path):
    reports: list[tuple[str, dict]] = []
    domain = SessionsDomain(tmp_path, AccessHooks(keys=list, report=lambda sid, body: reports.append((sid, body)),
                                                  record_command=lambda sid, cmd: False, audit=lambda e, f: None))
    domain.reports = reports
    yield domain
    await domain.teardown()


def phases(reports, sid):
    return [(b["tcp"]["phase"], b["tcp"].get("listener_endpoint") or b["tcp"].get("terminated_by"))
            for s, b in reports if s == sid]


async def roundtrip(endpoint: str, text: bytes = b"ping") -> bytes:
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(text)
    await writer.drain()
    writer.write_eof()
    got = await reader.read()
    writer.close()
    return got


async def test_a_session_is_opened_marked_restarted_when_its_listener_dies_and_closed_when_revoked(sessions, echo):
    desired = model(tcp("ses_a", echo))
    opened = await converge(sessions, desired)
    assert [str(c.correction()) for c in opened.changes] == ["session_started: session ses_a (tcp): no listener"]
    [live] = sessions.status()["live"]
    first = live["listener_endpoint"]
    assert phases(sessions.reports, "ses_a") == [("session_started", first)]
    assert await roundtrip(first) == b"ping"
    listener = sessions._live["ses_a"]
    [sock] = listener.listening_sockets()
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK) == socket_marks(["ses_a"])["ses_a"]
    assert (await converge(sessions, desired)).changes == ()  # nothing to do: nothing reported

    sock.shutdown(socket.SHUT_RDWR)  # the listener dies: the kernel stops listening on it
    assert ("127.0.0.1", int(first.rsplit(":", 1)[1])) not in kernel_listeners()
    repaired = await converge(sessions, desired)
    assert [c.correction().type for c in repaired.changes] == ["session_listener_restarted"]
    assert first in repaired.changes[0].detail
    second = sessions.status()["live"][0]["listener_endpoint"]
    assert second != first and await roundtrip(second, b"again") == b"again"
    assert phases(sessions.reports, "ses_a") == [("session_started", first), ("session_started", second)]

    revoked = await sessions.apply_delta(model(), None)  # the event path: gone from the block
    assert [str(c.correction()) for c in revoked.changes] == [
        "session_closed: session ses_a: no longer granted, its listener still open"]
    assert phases(sessions.reports, "ses_a")[-1] == ("session_ended", "operator_revoke")
    with pytest.raises(OSError):
        await roundtrip(second)


async def test_a_session_that_ended_by_itself_stays_ended_and_an_expired_one_never_opens(sessions, echo):
    desired = model(tcp("ses_idle", echo, idle=1), tcp("ses_old", echo, expires="2001-01-01T00:00:00Z"))
    opened = await converge(sessions, desired)
    assert [c.session_id for c in opened.changes] == ["ses_idle"]  # the expired one is not opened
    await wait_for(lambda: sessions._live["ses_idle"].closed == "idle_timeout", 10, "the idle timeout")
    assert (await converge(sessions, desired)).changes == ()  # not reopened while it stays in the block
    assert sessions.status()["ended"] == {"ses_idle": "idle_timeout"}
    assert phases(sessions.reports, "ses_idle")[-1] == ("session_ended", "idle_timeout")
    await converge(sessions, model())
    assert sessions.status()["ended"] == {}  # forgotten once it left the block


async def test_a_changed_entry_replaces_its_listener_and_a_later_expiry_reopens_an_ended_one(sessions, echo):
    other = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)  # a second target: closes at once
    other_port = other.sockets[0].getsockname()[1]
    try:
        await converge(sessions, model(tcp("ses_a", echo)))
        first = sessions.status()["live"][0]["listener_endpoint"]
        assert await roundtrip(first) == b"ping"
        moved = await converge(sessions, model(tcp("ses_a", other_port)))  # the entry now names another target
        assert [c.correction().type for c in moved.changes] == ["session_replaced"]
        second = sessions.status()["live"][0]["listener_endpoint"]
        assert second != first and await roundtrip(second) == b""  # forwards to the new target only
        with pytest.raises(OSError):
            await roundtrip(first)
        assert phases(sessions.reports, "ses_a") == [("session_started", first), ("session_started", second)]
    finally:
        other.close()

    await converge(sessions, model(tcp("ses_b", echo, idle=1)))
    await wait_for(lambda: sessions._live["ses_b"].closed == "idle_timeout", 10, "the idle timeout")
    assert (await converge(sessions, model(tcp("ses_b", echo, idle=1)))).changes == ()
    extended = await converge(sessions, model(tcp("ses_b", echo, idle=30)))  # its entry changed: served again
    assert [c.correction().type for c in extended.changes] == ["session_started"]


async def test_a_hold_does_not_keep_a_revoked_session_admitting(sessions, echo):
    from plexd.converge.engine import Engine
    from plexd.converge.hold import ReconcileHold
    from plexd.node.mesh import MeshHandle

    hold = ReconcileHold()
    mesh = MeshHandle(Engine([sessions]), model(tcp("ses_a", echo)), hold=hold)
    await mesh.gate.converge()
    endpoint = sessions.status()["live"][0]["listener_endpoint"]
    assert sessions.granted("ses_a")
    hold.set(3600, "debugging the firewall")
    mesh.store.replace(model())  # revoked by an event while held
    await mesh.gate.apply_events()
    assert not sessions.granted("ses_a") and sessions.status()["live"] == []
    with pytest.raises(OSError):
        await roundtrip(endpoint)
    hold.release()


async def test_a_refused_entry_is_named_and_the_others_are_served(sessions, echo, caplog):
    desired = model(tcp("ses_ok", echo), {"session_id": "ses_bad", "kind": "tcp", "expires_at": FAR,
                                          "target": {"tcp": {"host": "127.0.0.1", "port": 0}}})
    await converge(sessions, desired)
    status = sessions.status()
    assert [s["session_id"] for s in status["live"]] == ["ses_ok"]
    assert [r["session_id"] for r in status["refused"]] == ["ses_bad"] and "port" in status["refused"][0]["reason"]
    assert "session ses_bad refused" in caplog.text


async def test_a_kubernetes_session_without_an_api_server_is_an_error_line_not_a_crash(sessions, echo):
    k8s = {"session_id": "ses_k", "jti": "ses_k", "kind": "k8s", "target": {"k8s": {"user": "alice"}},
           "expires_at": FAR}
    result = await converge(sessions, model(k8s, tcp("ses_t", echo)))
    assert [c.session_id for c in result.changes] == ["ses_t"]
    assert any("ses_k" in e and "Kubernetes API server" in e for e in result.errors), result.errors


def test_kernel_listeners_reads_both_families():
    with socket.socket() as four, socket.socket(socket.AF_INET6) as six:
        four.bind(("127.0.0.1", 0))
        four.listen()
        six.bind(("::1", 0))
        six.listen()
        found = kernel_listeners()
        assert ("127.0.0.1", four.getsockname()[1]) in found and ("::1", six.getsockname()[1]) in found


async def test_a_device_kept_until_the_first_state_pull_serves_no_session_from_the_mirror(sessions, echo):
    # A restart with the device up keeps the machine as it is until the control plane's state arrives: a session
    # revoked while plexd was down must not be served from the mirror meanwhile (an operator's hold, unlike this,
    # still applies revocations: see the test above).
    from plexd.converge.engine import Engine

    engine = Engine([sessions])
    kept = await engine.converge(model(tcp("ses_a", echo)), Mode.KEPT)
    assert kept.mode is Mode.KEPT and [c.correction().type for c in kept.changes] == ["session_started"]
    assert sessions.status() is None or sessions.status()["live"] == []
    await engine.converge(model(tcp("ses_a", echo)))  # the state arrived
    assert [s["session_id"] for s in sessions.status()["live"]] == ["ses_a"]


async def test_no_session_is_open_while_the_policy_cannot_be_enforced(sessions, echo):
    """Fail closed: while the firewall says the policy cannot be enforced (nftables unusable), a live session is
    closed and none opens; `plexd sessions` says why; once it can again, the session opens anew."""
    desired = model(tcp("ses_a", echo))
    await converge(sessions, desired)
    first = sessions.status()["live"][0]["listener_endpoint"]
    assert await roundtrip(first) == b"ping"

    sessions.unenforced = lambda: "policy enforcement unavailable: nftables missing"
    closed = await converge(sessions, desired)
    assert [str(c.correction()) for c in closed.changes] == [
        "session_closed: session ses_a: closed: who may reach it cannot be enforced "
        "(policy enforcement unavailable: nftables missing)"]
    assert closed.errors == ("sessions: session ses_a: not opened: who may reach it cannot be enforced "
                             "(policy enforcement unavailable: nftables missing)",)
    with pytest.raises(OSError):
        await roundtrip(first)
    assert (await converge(sessions, desired)).changes == ()  # nothing opens meanwhile, an event neither
    assert (await sessions.apply_delta(desired, None)).changes == ()
    assert sessions.status()["live"] == [] and sessions.status()["refused"] == [
        {"session_id": "ses_a", "reason": "not opened: who may reach it cannot be enforced "
                                          "(policy enforcement unavailable: nftables missing)"}]
    assert phases(sessions.reports, "ses_a")[-1] == ("session_ended", "plexd_close")

    sessions.unenforced = lambda: ""
    reopened = await converge(sessions, desired)
    assert [c.correction().type for c in reopened.changes] == ["session_started"]
    assert await roundtrip(sessions.status()["live"][0]["listener_endpoint"]) == b"ping"


def test_a_listener_takes_connections_arriving_on_its_mesh_interface_only():
    """`mesh_listener`: a filter on the interface each packet came in on. A program on this machine connecting to
    the mesh address comes in on loopback, not the mesh interface (a veth link here): it does not get through,
    while the same address without the filter answers."""
    from plexd.base.serving import mesh_listener

    link, address = "pxtmesh0", "10.254.77.1"
    subprocess.run(["ip", "link", "add", link, "type", "veth", "peer", "name", "pxtmesh1"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", link], check=True)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        bound, index = mesh_listener(address, link)
        unbound, _ = mesh_listener(address, None)
        with bound, unbound:
            assert index == socket.if_nametoindex(link)
            socket.create_connection(unbound.getsockname(), timeout=2).close()  # the address answers locally
            with pytest.raises(OSError):
                socket.create_connection(bound.getsockname(), timeout=1)
        with pytest.raises(OSError, match="cannot limit the listener to the mesh interface pxtnone0"):
            mesh_listener(address, "pxtnone0")
    finally:
        subprocess.run(["ip", "link", "del", link], check=False)


async def test_a_listener_limited_to_a_recreated_mesh_interface_is_moved_in_place(sessions, echo):
    """The filter names the interface by index: a mesh interface deleted and created again (a restarted
    wireguard-go, a link deleted by hand) has a new one. The listener and its connections are moved to it in place:
    the port stays, and so does a live connection. Loopback cannot be recreated here: the listener is made to look
    limited to an index that is gone."""
    desired = model(tcp("ses_a", echo))
    await converge(sessions, desired)
    listener = sessions._live["ses_a"]
    endpoint = sessions.status()["live"][0]["listener_endpoint"]
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))  # a live connection across the move
    listener.device_index = 999_999
    moved = await converge(sessions, desired)
    assert [str(c.correction()) for c in moved.changes] == [
        f"session_listener_rebound: session ses_a: listener {endpoint} took connections from a mesh interface "
        "since recreated"]
    assert sessions._live["ses_a"] is listener and listener.device_index == socket.if_nametoindex("lo")
    assert sessions.status()["live"][0]["listener_endpoint"] == endpoint
    writer.write(b"still here")
    await writer.drain()
    writer.write_eof()
    assert await reader.read() == b"still here"
    writer.close()
    assert (await converge(sessions, desired)).changes == ()


async def test_a_tcp_session_is_not_opened_while_no_policy_says_who_may_reach_it(tmp_path, echo):
    """policy.enabled false: nothing filters the mesh, and a TCP session has no token of its own, so any mesh peer
    would reach its target: it is not opened (an SSH session, which checks its token, is not this rule's)."""
    reports: list[tuple[str, dict]] = []
    domain = SessionsDomain(tmp_path, AccessHooks(keys=list, report=lambda sid, body: reports.append((sid, body)),
                                                  record_command=lambda sid, cmd: False, audit=lambda e, f: None),
                            policy_enabled=False)
    try:
        result = await converge(domain, model(tcp("ses_t", echo)))
        assert result.changes == () and result.errors == (
            "sessions: session ses_t: not opened: who may reach it cannot be enforced (a TCP session has no token, "
            "and with policy.enabled false nothing says who may reach it)",)
        assert domain.status()["live"] == [] and domain.status()["refused"][0]["session_id"] == "ses_t"
    finally:
        await domain.teardown()
