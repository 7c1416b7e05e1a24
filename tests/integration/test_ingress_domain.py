"""The ingress domain through the real engine, on loopback (no namespace: 127.0.0.0/8 stands in for the mesh
range): a rule's port forwards to its target, a listener that dies is drift (listening again, reported), a rule
withdrawn closes its port, and a source outside `allowed_sources` is closed at once. The bridge lab
(tests/e2e/test_bridge_interfaces_lab.py) runs the same domain in a daemon, across a real mesh."""

from __future__ import annotations

import asyncio
import socket

from engine_helpers import converge

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
