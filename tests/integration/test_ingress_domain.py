"""The ingress domain through the real engine, on loopback (no namespace: 127.0.0.0/8 stands in for the mesh
range): a rule's port forwards to its target, a listener that dies is drift (listening again, reported), a rule
withdrawn closes its port, a source outside `allowed_sources` is closed at once, and silent or idle clients
cannot hold the port. The bridge lab
(tests/e2e/test_bridge_interfaces_lab.py) runs the same domain in a daemon, across a real mesh."""

from __future__ import annotations

import asyncio
import socket
import time

from engine_helpers import converge

from plexd.bridge import ingress_port
from plexd.bridge.ingress import IngressDomain
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
    monkeypatch.setattr(ingress_port, "IDLE_TIMEOUT", 1.5, raising=False)
    server, target = await hold_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))
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


async def test_one_address_holds_at_most_its_share_of_the_port(tmp_path, monkeypatch):
    monkeypatch.setattr(ingress_port, "MAX_PER_SOURCE", 2)
    server, target = await hold_server()
    port = free_port()
    domain = IngressDomain(str(tmp_path), host="127.0.0.1", mesh_range=("127.0.0.0/8",))
    talking = []
    try:
        await converge(domain, model([{"rule_id": "db", "listen_port": port, "mode": "tcp",
                                       "target_addr": f"127.0.0.2:{target}"}]))
        for source in ("127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.3"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
            writer.write(b"hello")  # clients that talk: not waiting, yet one address gets only its share
            await writer.drain()
            talking.append((reader, writer))
        shown = lambda: domain.status()["ports"][0]  # noqa: E731
        await until(lambda: shown()["accepted"] + shown()["refused_per_source"] == 4)
        assert (shown()["accepted"], shown()["refused_per_source"]) == (3, 1), shown()
        assert await asyncio.wait_for(talking[2][0].read(), 5) == b"" and not talking[3][0].at_eof()
    finally:
        for _, w in talking:
            w.close()
        await domain.teardown()
        server.close()
