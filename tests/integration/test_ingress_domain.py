"""The ingress domain through the real engine, on loopback (no namespace: 127.0.0.0/8 stands in for the mesh
range): a rule's port forwards to its target, a listener that dies is drift (listening again, reported), a rule
withdrawn closes its port, a source outside `allowed_sources` is closed at once, silent or idle clients cannot
hold the port, a source (an IPv6 /64 is one) gets its share of a full port, and a server that speaks first keeps
its quiet client. The bridge lab
(tests/e2e/test_bridge_interfaces_lab.py) runs the same domain in a daemon, across a real mesh."""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import time

import pytest
from engine_helpers import converge

from plexd.bridge import ingress_port
from plexd.bridge.ingress import IngressDomain
from plexd.config.settings import load
from plexd.node.domain_list import build_engine
from plexd.state.desired import DesiredState
from plexd.state.model import State


def model(rules: list[dict] | None) -> DesiredState:
    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="127.0.0.9")
    return base.with_state(State.from_wire({"peers": [], "bridge": {"ingress": None if rules is None else {
        "enabled": True, "rules": rules}}}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def echo_server() -> tuple[asyncio.Server, int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read(100)
        writer.write(b"echo:" + data)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.2", 0)
    return server, server.sockets[0].getsockname()[1]


async def ask(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hi")
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(100), 5)
    finally:
        writer.close()


async def test_a_port_forwards_a_dead_listener_is_drift_and_a_withdrawn_rule_closes_it(tmp_path):
    server, target = await echo_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))
    rules = [{"rule_id": "web", "listen_port": port, "target_addr": f"127.0.0.2:{target}", "mode": "tcp"}]
    try:
        first = await converge(domain, model(rules))
        assert [str(c.correction()) for c in first.changes] == [
            f"ingress_listener_started: ingress port {port}: not listening yet",
            f"ingress_rule_updated: ingress rule web: port {port} to 127.0.0.2:{target} (tcp); added"]
        assert await ask(port) == b"echo:hi"
        assert (await converge(domain, model(rules))).changes == ()  # nothing to do

        domain._ports[port]._listener.close()  # the listener dies under it
        fixed = await converge(domain, model(rules))
        assert [str(c.correction()) for c in fixed.changes] == [
            f"ingress_listener_started: ingress port {port}: its listener is gone; listening again"]
        assert await ask(port) == b"echo:hi"
        assert domain.status()["ports"][0]["accepted"] == 1  # the new listener's own count

        gone = await converge(domain, model(None))
        assert [c.correction().type for c in gone.changes] == ["ingress_listener_stopped", "ingress_rule_updated"]
        try:
            await ask(port)
        except OSError:
            pass
        else:
            raise AssertionError(f"port {port} still answers after its rule was withdrawn")
    finally:
        await domain.teardown()
        server.close()


async def test_a_source_outside_allowed_sources_is_closed_and_counted(tmp_path):
    server, target = await echo_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",),
                           allowed_sources=("192.0.2.0/24",))
    try:
        await converge(domain, model([{"rule_id": "web", "listen_port": port,
                                       "target_addr": f"127.0.0.2:{target}"}]))
        assert await ask(port) == b""  # closed without a byte: loopback is not an allowed source
        [shown] = domain.status()["ports"]
        assert shown["refused_source"] == 1 and shown["accepted"] == 0, shown
    finally:
        await domain.teardown()
        server.close()


async def test_a_live_connection_ends_when_its_rule_is_revoked_or_retargeted(tmp_path):
    # The port stays (another rule, or the same one moved): the connections let in under the old rule must not.
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # a long-lived connection (a database session)
        writer.close()

    old = await asyncio.start_server(hold, "127.0.0.2", 0)
    new, _ = await echo_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))

    def rules(target: asyncio.Server) -> list[dict]:
        return [{"rule_id": "db", "listen_port": port, "mode": "tcp",
                 "target_addr": f"127.0.0.2:{target.sockets[0].getsockname()[1]}"}]

    try:
        await converge(domain, model(rules(old)))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        await writer.drain()
        await asyncio.sleep(0.2)  # forwarded: the connection is live on the old target
        await converge(domain, model(rules(new)))  # retargeted on the same port
        assert await asyncio.wait_for(reader.read(), 5) == b""  # ended, not left on the old target
        writer.close()
        assert await ask(port) == b"echo:hi"  # a new connection goes to the new target
    finally:
        await domain.teardown()
        old.close()
        new.close()


async def hold_server() -> tuple[asyncio.Server, int]:
    """A target that takes what it is sent and never answers (a database waiting for its client)."""
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.2", 0)
    return server, server.sockets[0].getsockname()[1]


async def until(check, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.02)


async def test_silent_connections_from_one_address_never_keep_a_client_out(tmp_path, monkeypatch):
    # Until its first byte a connection holds one of its address's few waiting slots; one more closes that
    # address's oldest silent one. (A smaller cap than 256 keeps the test's descriptors few; the same code.)
    monkeypatch.setattr(ingress_port, "MAX_CONNECTIONS", 32)
    server, target = await echo_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))
    silent = []
    try:
        await converge(domain, model([{"rule_id": "web", "listen_port": port, "mode": "tcp",
                                       "target_addr": f"127.0.0.2:{target}"}]))
        for _ in range(33):
            silent.append(await asyncio.open_connection("127.0.0.1", port))
        shown = lambda: domain.status()["ports"][0]  # noqa: E731
        await until(lambda: shown()["accepted"] + shown()["refused_over_cap"] == 33)
        started = time.monotonic()
        assert await ask(port) == b"echo:hi"  # a client that talks, from the same address
        took = time.monotonic() - started
        assert took < 1.0 and shown()["refused_over_cap"] == 0, (took, shown())
        await asyncio.wait_for(silent[0][0].read(), 5)  # the oldest silent ones were closed to make room
        assert silent[0][0].at_eof()
    finally:
        for _, w in silent:
            w.close()
        await domain.teardown()
        server.close()


async def test_a_silent_connection_ends_at_its_deadline_and_a_quiet_one_when_idle(tmp_path, monkeypatch):
    monkeypatch.setattr(ingress_port, "HELLO_TIMEOUT", 0.5)
    server, target = await hold_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",), idle_timeout=1.5)
    try:
        await converge(domain, model([{"rule_id": "db", "listen_port": port, "mode": "tcp",
                                       "target_addr": f"127.0.0.2:{target}"}]))
        silent, _ = await asyncio.open_connection("127.0.0.1", port)
        quiet, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")  # it spoke once, then says nothing more
        await writer.drain()
        started = time.monotonic()
        assert await asyncio.wait_for(silent.read(), 5) == b""  # never said a word: closed at the deadline
        assert not quiet.at_eof()
        assert await asyncio.wait_for(quiet.read(), 5) == b""  # idle: closed too
        assert time.monotonic() - started >= 1.0
        writer.close()
    finally:
        await domain.teardown()
        server.close()


async def test_a_source_holds_more_than_its_share_until_the_port_is_full(tmp_path, monkeypatch):
    # An office behind one NAT is one address: refused past its share while the port had room, it was cut off
    # for nobody's benefit. Its share counts once the port is full: a newcomer from another source then takes the
    # newest of the busiest source's connections, if that source is over its share.
    monkeypatch.setattr(ingress_port, "MAX_CONNECTIONS", 3)
    server, target = await hold_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",), max_per_source=1)
    talking = []
    shown = lambda: domain.status()["ports"][0]  # noqa: E731

    async def connect(source: str) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(b"hello")  # a client that talks: forwarding, not waiting
        await writer.drain()
        talking.append((reader, writer))
        await until(lambda: shown()["accepted"] + shown()["refused_per_source"] == len(talking)
                    and shown()["waiting"] == 0)

    try:
        await converge(domain, model([{"rule_id": "db", "listen_port": port, "mode": "tcp",
                                       "target_addr": f"127.0.0.2:{target}"}]))
        for source in ("127.0.0.1", "127.0.0.1", "127.0.0.1"):
            await connect(source)
        assert (shown()["connections"], shown()["refused_per_source"]) == (3, 0), shown()  # room: all of them
        await connect("127.0.0.3")  # the port full: the busiest source's newest goes
        assert await asyncio.wait_for(talking[2][0].read(), 5) == b""
        await connect("127.0.0.1")  # over its share already: refused
        assert await asyncio.wait_for(talking[4][0].read(), 5) == b"" and shown()["refused_per_source"] == 1
        await connect("127.0.0.4")
        assert await asyncio.wait_for(talking[1][0].read(), 5) == b""
        assert not talking[0][0].at_eof() and not talking[3][0].at_eof() and not talking[5][0].at_eof()
        assert (shown()["connections"], shown()["dropped_over_share"]) == (3, 2), shown()
    finally:
        for _, w in talking:
            w.close()
        await domain.teardown()
        server.close()


async def test_an_ipv6_64_is_one_source_and_an_ipv4_client_its_own(tmp_path, monkeypatch):
    # A host picks addresses from its /64 at will: counted by address, each had a waiting budget of its own. An
    # IPv4 client of a dual-stack listener comes as ::ffff:a.b.c.d, and all of IPv4 is in one /64 of those.
    real = ingress_port.accept_forever
    addresses = iter([*(f"2001:db8:1:2::{i:x}" for i in range(1, 11)), "2001:db8:1:3::1",
                      *(f"::ffff:192.0.2.{i}" for i in range(1, 11))])

    async def from_addresses(listener, name):  # real connections over loopback, as if from `addresses`
        async for client, address in real(listener, name):
            yield client, (next(addresses), *address[1:])

    monkeypatch.setattr(ingress_port, "accept_forever", from_addresses)
    server, target = await echo_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))
    silent = []
    try:
        await converge(domain, model([{"rule_id": "web", "listen_port": port, "mode": "tcp",
                                       "target_addr": f"127.0.0.2:{target}"}]))
        for _ in range(21):
            silent.append(await asyncio.open_connection("127.0.0.1", port))
        shown = lambda: domain.status()["ports"][0]  # noqa: E731
        await until(lambda: shown()["accepted"] == 21)
        # The first /64's ten within its budget of 8 (its two oldest closed); the next /64 and each IPv4 address
        # a source of its own.
        assert (shown()["waiting"], shown()["dropped_waiting"]) == (8 + 1 + 10, 2), shown()
        for reader, _ in silent[:2]:
            assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        for _, w in silent:
            w.close()
        await domain.teardown()
        server.close()


def client_hello(name: str) -> bytes:
    """The first TLS record a client sends for `name` (no network: memory BIOs)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    tls = ctx.wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(), server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def test_a_full_port_closes_a_waiting_connection_of_the_busiest_source(tmp_path, monkeypatch):
    # The port's oldest silent connection went: one source's flood closed a quieter source's client. A connection
    # that sent part of its ClientHello (heard, not forwarding) could not be closed at all.
    monkeypatch.setattr(ingress_port, "MAX_CONNECTIONS", 6)
    server, target = await echo_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))
    hello = client_hello("a.example")
    held = []
    try:
        await converge(domain, model([{"rule_id": f"web-{name}", "listen_port": port, "mode": "tcp",
                                       "hostname": f"{name}.example", "target_addr": f"127.0.0.2:{target}"}
                                      for name in ("a", "b")]))
        quiet = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))  # the oldest
        held.append(quiet)
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.4", 0))
            writer.write(hello[:3])  # a busier source, each with part of a ClientHello
            await writer.drain()
            held.append((reader, writer))
        shown = lambda: domain.status()["ports"][0]  # noqa: E731
        await until(lambda: shown()["accepted"] == 6)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.5", 0))
        writer.write(hello)
        assert await asyncio.wait_for(reader.read(5), 5) == b"echo:"  # a newcomer to the full port gets in
        writer.close()
        try:  # the busiest source's oldest went (reset: the bytes it sent were never read)
            assert await asyncio.wait_for(held[1][0].read(), 5) == b""
        except ConnectionResetError:
            pass
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(quiet[0].read(), 0.3)  # not the quiet source's, older as it is
        assert (shown()["dropped_waiting"], shown()["refused_over_cap"]) == (1, 0), shown()
    finally:
        for _, w in held:
            w.close()
        await domain.teardown()
        server.close()


async def test_a_server_that_speaks_first_keeps_its_quiet_client(tmp_path, monkeypatch):
    # SMTP, FTP and IMAP servers greet first; a push-only stream never hears from its client. With only the
    # client's bytes counted, such a client was closed at the first-byte deadline.
    monkeypatch.setattr(ingress_port, "HELLO_TIMEOUT", 0.5)

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 ready\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.2", 0)
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))
    try:
        await converge(domain, model([{"rule_id": "smtp", "listen_port": port, "mode": "tcp",
                                       "target_addr": f"127.0.0.2:{server.sockets[0].getsockname()[1]}"}]))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.readline(), 5) == b"220 ready\r\n"
        await asyncio.sleep(1.0)  # twice the deadline, and the client has said nothing
        assert not reader.at_eof() and domain.status()["ports"][0]["dropped_silent"] == 0
        writer.close()
    finally:
        await domain.teardown()
        server.close()


async def test_a_connection_closed_before_its_task_ran_has_its_socket_closed(tmp_path):
    # A burst in the backlog is accepted without a yield: the ninth connection of one source closes the first
    # before that one's task ever ran, and a task cancelled then never runs its `finally` (its socket stayed open
    # until the garbage collector found it).
    server, target = await echo_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))
    loop = asyncio.get_running_loop()
    burst = []
    gc.disable()
    try:
        await converge(domain, model([{"rule_id": "web", "listen_port": port, "mode": "tcp",
                                       "target_addr": f"127.0.0.2:{target}"}]))
        for _ in range(12):  # into the backlog, no yield in between
            burst.append(socket.create_connection(("127.0.0.1", port)))
        for client in burst:
            client.setblocking(False)
        for client in burst[:4]:
            assert await asyncio.wait_for(loop.sock_recv(client, 1), 5) == b""
        assert domain.status()["ports"][0]["dropped_waiting"] == 4
    finally:
        gc.enable()
        for client in burst:
            client.close()
        await domain.teardown()
        server.close()


async def test_the_idle_timeout_and_the_share_are_settings(tmp_path):
    assert (ingress_port.IDLE_TIMEOUT, ingress_port.MAX_PER_SOURCE) == (3600.0, 64)  # the defaults: 1 hour, 64
    env = {"PLEXD_BRIDGE_INGRESS_IDLE_TIMEOUT": "20m", "PLEXD_BRIDGE_INGRESS_MAX_PER_SOURCE": "100",
           "PLEXD_BRIDGE_INGRESS_LISTEN_ADDRESS": "127.0.0.1", "PLEXD_POLICY_MESH_RANGE": "127.0.0.0/8"}
    config = load(None, env=env, flags={"mode": "bridge", "data_dir": str(tmp_path)})
    domain = build_engine(config, cp_reachable=lambda: True).domain("ingress")
    assert isinstance(domain, IngressDomain) and (domain.idle_timeout, domain.max_per_source) == (1200.0, 100)
    port = free_port()
    try:
        await converge(domain, model([{"rule_id": "web", "listen_port": port, "target_addr": "127.0.0.2:9"}]))
        assert (domain._ports[port].idle_timeout, domain._ports[port].max_per_source) == (1200.0, 100)
    finally:
        await domain.teardown()
