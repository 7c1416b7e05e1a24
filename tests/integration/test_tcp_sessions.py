"""TCP sessions on real loopback sockets: a listener of the session's own forwards to its target only, spliced
in the kernel; connections are capped; revocation, idleness and expiry end it with the §A1.4 reports."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
from waiting import wait_for

from plexd.access.tcp import TcpSession
from plexd.state.sessions_block import Session, TcpTarget

pytestmark = pytest.mark.timeout(60)


class Target:
    """The session's target: echoes everything it reads, after the client's FIN if `after_eof` (to show the
    half-close passes through), and counts its connections."""

    def __init__(self, after_eof: bool = False) -> None:
        self.after_eof = after_eof
        self.accepted = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> Target:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            if self.after_eof:
                writer.write(await reader.read())
            else:
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def session(port: int, *, ttl: float = 600.0, idle: float = 0.0, sid: str = "ses_t") -> Session:
    return Session(sid, "tcp", TcpTarget("127.0.0.1", port), time.time() + ttl, idle)


class Reports:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.ended = asyncio.Event()

    def __call__(self, session_id: str, body: dict) -> None:
        self.bodies.append(body)
        if body["tcp"]["phase"] == "session_ended":
            self.ended.set()


async def test_a_megabyte_each_way_is_forwarded_counted_and_reported_and_revocation_closes_the_listener():
    reports = Reports()
    async with Target() as target:
        tcp = TcpSession(session(target.port), "127.0.0.1", report=reports)
        port = await tcp.start()
        assert reports.bodies[0] == {"tcp": {"phase": "session_started", "target_host": "127.0.0.1",
                                             "target_port": target.port, "listener_endpoint": f"127.0.0.1:{port}"}}
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = os.urandom(1 << 20)
        writer.write(payload)
        await writer.drain()
        echoed = await reader.readexactly(len(payload))
        assert echoed == payload
        writer.close()
        await wait_for(lambda: tcp.live_connections == 0, what="the connection to end")
        await tcp.close("operator_revoke")
        assert reports.bodies[-1] == {"tcp": {"phase": "session_ended", "bytes_in": 1 << 20, "bytes_out": 1 << 20,
                                              "terminated_by": "operator_revoke"}}
        assert target.accepted == 1
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)


async def test_a_half_close_reaches_the_target_and_its_answer_still_comes_back():
    async with Target(after_eof=True) as target:
        tcp = TcpSession(session(target.port), "127.0.0.1")
        port = await tcp.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"question")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b"question"
        await tcp.close("plexd_close")


async def test_connections_past_the_cap_are_closed_at_once_and_counted():
    async with Target() as target:
        tcp = TcpSession(session(target.port), "127.0.0.1", max_connections=2)
        port = await tcp.start()
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for r, w in held:  # both really forwarded before the third arrives
            w.write(b"x")
            assert await asyncio.wait_for(r.readexactly(1), 10) == b"x"
        r3, w3 = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(r3.read(), 10) == b""
        assert tcp.counters.refused_over_cap == 1 and tcp.live_connections == 2
        for _r, w in (*held, (r3, w3)):
            w.close()
        await tcp.close("plexd_close")


async def test_revocation_ends_a_live_connection_within_a_second():
    reports = Reports()
    async with Target() as target:
        tcp = TcpSession(session(target.port), "127.0.0.1", report=reports)
        port = await tcp.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"hello"
        started = time.monotonic()
        await tcp.close("operator_revoke")
        rest = await asyncio.wait_for(reader.read(), 1.0)
        assert rest == b"" and time.monotonic() - started < 1.0
        assert reports.bodies[-1]["tcp"]["terminated_by"] == "operator_revoke"
        writer.close()


@pytest.mark.parametrize("ttl, idle, reason", [(0.5, 0.0, "ttl_expired"), (600.0, 0.3, "idle_timeout")])
async def test_expiry_and_idleness_close_the_session_by_themselves(ttl, idle, reason):
    reports = Reports()
    async with Target() as target:
        tcp = TcpSession(session(target.port, ttl=ttl, idle=idle), "127.0.0.1", report=reports)
        port = await tcp.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(reports.ended.wait(), 10)
        assert tcp.closed == reason and reports.bodies[-1]["tcp"]["terminated_by"] == reason
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_an_unreachable_target_closes_the_client_and_the_session_stays_up():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead_port = unused.getsockname()[1]  # bound, never listening: connections to it are refused
        tcp = TcpSession(session(dead_port), "127.0.0.1")
        port = await tcp.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 15) == b""
        assert tcp.counters.dial_failures == 1 and tcp.closed is None
        writer.close()
        await tcp.close("plexd_close")


def test_a_session_of_another_kind_is_refused():
    from plexd.state.sessions_block import SshTarget

    with pytest.raises(ValueError, match="not tcp"):
        TcpSession(Session("s", "ssh", SshTarget("deploy"), time.time() + 60), "127.0.0.1")


async def test_an_accept_that_fails_for_want_of_descriptors_is_retried_and_the_listener_serves_on(caplog):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with Target() as target:
        tcp = TcpSession(session(target.port), "127.0.0.1")
        port = await tcp.start()
        client = socket.socket()  # made before the descriptors run out; connecting needs none
        client.settimeout(10)
        hog: list[int] = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
        try:
            with pytest.raises(OSError):
                while True:
                    hog.append(os.open("/dev/null", os.O_RDONLY))
            client.connect(("127.0.0.1", port))  # into the backlog: accepting it fails with EMFILE
            await asyncio.sleep(0.3)
        finally:
            for fd in hog:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert not tcp._accepting.done()  # the accept loop lived through it
        client.sendall(b"ping")
        assert await asyncio.to_thread(client.recv, 16) == b"ping"  # accepted on a later try, forwarded
        client.close()
        assert "cannot accept a connection" in caplog.text
        await tcp.close("plexd_close")


async def test_silent_connections_from_one_source_leave_room_for_another():
    # No token in a TCP session: the firewall admits only the peers the policy allows, and among those one source
    # holding all the slots gives one up to another source's newcomer. Before, nine silent connects from one peer
    # took all eight.
    from waiting import scaled

    from plexd.access.tcp import MAX_CONNECTIONS

    async with Target() as target:
        tcp = TcpSession(session(target.port), "127.0.0.1")
        port = await tcp.start()
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS + 1)]
        await wait_for(lambda: target.accepted + tcp.counters.refused_over_cap + tcp.counters.__dict__.get(
            "refused_per_source", 0) == MAX_CONNECTIONS + 1, what="every silent connect to be served or refused")
        started = time.monotonic()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.2", 0)), scaled(1.0))  # another source address
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), scaled(1.0)) == b"hello"
        assert time.monotonic() - started < scaled(1.0)
        assert (tcp.counters.refused_per_source, tcp.counters.dropped_over_share) == (1, 1)
        writer.close()
        for _, w in silent:
            w.close()
        await tcp.close("plexd_close")


async def test_a_source_holds_more_than_its_share_while_there_is_room():
    # A browser opens 6 connections to a host, and a WebSocket or a preconnect besides: at most 6 of 8 per source
    # broke it with 2 slots free. The share counts once all 8 are taken.
    from plexd.access.tcp import MAX_CONNECTIONS, MAX_PER_SOURCE

    async def talk(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(b"hi")
        return reader, writer

    async with Target() as target:
        tcp = TcpSession(session(target.port), "127.0.0.1")
        port = await tcp.start()
        browser = [await talk("127.0.0.1") for _ in range(MAX_PER_SOURCE + 1)]  # 6 and a WebSocket
        other = await talk("127.0.0.2")  # the eighth
        for reader, _ in [*browser, other]:
            assert await asyncio.wait_for(reader.readexactly(2), 5) == b"hi"
        assert tcp.live_connections == MAX_CONNECTIONS and tcp.counters.refused_per_source == 0
        third = await talk("127.0.0.3")  # all taken: the browser, over its share, gives up its newest
        assert await asyncio.wait_for(third[0].readexactly(2), 5) == b"hi"
        assert await asyncio.wait_for(browser[-1][0].read(), 5) == b""
        late = await talk("127.0.0.2")  # all taken again, and nobody over its share: refused
        assert await asyncio.wait_for(late[0].read(), 5) == b""
        assert (tcp.counters.dropped_over_share, tcp.counters.refused_over_cap) == (1, 1)
        assert not any(reader.at_eof() for reader, _ in [*browser[:-1], other, third])
        for _, writer in [*browser, other, third, late]:
            writer.close()
        await tcp.close("plexd_close")


async def test_a_connection_displaced_before_its_task_ran_is_closed():
    # A burst in the backlog is accepted without a yield: a newcomer can displace a connection whose task never
    # ran, and a task cancelled then never runs its `finally`: its socket was left to the garbage collector.
    import warnings

    from plexd.access.tcp import MAX_CONNECTIONS

    loop = asyncio.get_running_loop()
    async with Target() as target:
        tcp = TcpSession(session(target.port), "127.0.0.1")
        port = await tcp.start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            burst = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{1 + (i // 8)}", 0))
                     for i in range(MAX_CONNECTIONS + 1)]  # 8 from one source, then one from another: no yield
            for client in burst:
                client.setblocking(False)
            assert await asyncio.wait_for(loop.sock_recv(burst[-2], 1), 5) == b""  # the first source's newest
        assert tcp.counters.dropped_over_share == 1
        assert not [w for w in caught if f"laddr=('127.0.0.1', {port})" in str(w.message)]  # closed, not collected
        for client in burst:
            client.close()
        await tcp.close("plexd_close")


async def test_a_connection_idle_past_its_window_is_closed_and_a_busy_one_is_not():
    async with Target() as target:
        tcp = TcpSession(session(target.port), "127.0.0.1", connection_idle=0.4)
        port = await tcp.start()
        r_idle, w_idle = await asyncio.open_connection("127.0.0.1", port)
        r_busy, w_busy = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        for _ in range(10):  # 1 s of traffic, more than twice the window
            w_busy.write(b"x")
            assert await asyncio.wait_for(r_busy.readexactly(1), 5) == b"x"
            await asyncio.sleep(0.1)
        assert await asyncio.wait_for(r_idle.read(), 5) == b""
        assert time.monotonic() - started < 5
        w_busy.write(b"y")
        assert await asyncio.wait_for(r_busy.readexactly(1), 5) == b"y"
        assert tcp.closed is None and tcp.counters.idle_closed == 1
        for w in (w_idle, w_busy):
            w.close()
        await tcp.close("plexd_close")


def fake_resolver(monkeypatch, answers: list[str]):
    """The loop's resolver answers `db.example` with the next of `answers` each time it is asked."""
    loop = asyncio.get_running_loop()
    real, calls = loop.getaddrinfo, []

    async def getaddrinfo(host, port, *args, **kwargs):
        if host != "db.example":
            return await real(host, port, *args, **kwargs)
        address = answers[min(len(calls), len(answers) - 1)]
        calls.append(address)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, port, 0, 0) if ":" in address else (address, port))]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return calls


@pytest.mark.parametrize("address, why", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"), ("0.0.0.0", "unspecified"),
])
async def test_a_host_name_that_resolves_to_this_host_or_its_metadata_service_opens_no_listener(
        monkeypatch, address, why):
    fake_resolver(monkeypatch, [address])
    tcp = TcpSession(Session("ses_n", "tcp", TcpTarget("db.example", 5432), time.time() + 60), "127.0.0.1")
    with pytest.raises(ValueError) as refused:
        await tcp.start()
    assert f"target host 'db.example' resolves to {address} ({why})" in str(refused.value)
    assert tcp.listening_sockets() == []


async def test_a_host_name_is_resolved_once_when_the_session_opens(monkeypatch):
    # DNS rebinding: a name first answered with a routable address, then with the metadata service's.
    calls = fake_resolver(monkeypatch, ["192.0.2.10", "169.254.169.254"])
    loop = asyncio.get_running_loop()
    real_connect, dialed = loop.sock_connect, []

    async def sock_connect(sock, address):
        if address[0] in ("192.0.2.10", "169.254.169.254"):
            dialed.append(address[0])
            raise ConnectionRefusedError(111, "refused (test)")
        return await real_connect(sock, address)

    monkeypatch.setattr(loop, "sock_connect", sock_connect)
    tcp = TcpSession(Session("ses_n", "tcp", TcpTarget("db.example", 5432), time.time() + 60), "127.0.0.1")
    port = await tcp.start()
    for _ in range(2):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    await wait_for(lambda: tcp.counters.dial_failures == 2, what="both dials")
    assert dialed == ["192.0.2.10", "192.0.2.10"] and len(calls) == 1
    await tcp.close("plexd_close")


async def test_literal_loopback_and_metadata_targets_are_the_control_planes_to_name():
    tcp = TcpSession(Session("ses_l", "tcp", TcpTarget("169.254.169.254", 80), time.time() + 60), "127.0.0.1")
    await tcp.start()  # named as a literal: served (the control plane chose it)
    await tcp.close("plexd_close")
