"""Ingress, its pure parts: the rules of either contract with their limits and refusals, the SNI reader (a real
ClientHello from Python's TLS stack, and fuzzed bytes), the domain's own refusals (targets outside the mesh or on
the bridge itself, certificates that do not load) and the status reports published only when they change.
The listeners are tested for real in tests/e2e/test_bridge_interfaces_lab.py."""

from __future__ import annotations

import json
import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexd.bridge.ingress import IngressDomain
from plexd.bridge.sni import record_length, server_name
from plexd.services.status_reports import MAX_PAYLOAD, StatusReports, bounded
from plexd.state.bridge_blocks import MAX_INGRESS_RULES, parse_ingress
from plexd.state.desired import DesiredState
from plexd.state.model import State


def client_hello(name: str | None) -> bytes:
    """The first record Python's TLS client sends (no network: memory BIOs)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_the_server_name_of_a_real_client_hello_is_read_and_a_missing_one_is_empty():
    hello = client_hello("App1.Example")
    assert record_length(hello) == len(hello)
    assert server_name(hello) == "app1.example"
    assert server_name(client_hello(None)) == ""
    for bad, why in ((b"GET / HTTP/1.1\r\n", "not a TLS handshake"), (b"\x16\x03", "fewer than 5 bytes"),
                     (hello[:5] + b"\x02" + hello[6:], "not a ClientHello")):
        with pytest.raises(ValueError, match=why):
            server_name(bad)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 400))
def test_any_bytes_give_a_name_or_a_value_error_never_anything_else(noise, cut):
    hello = client_hello("app.example")
    for data in (noise, b"\x16\x03\x01" + noise, hello[:cut] + noise, hello[:cut]):
        try:
            name = server_name(data)
        except ValueError:
            continue
        assert isinstance(name, str) and len(name) <= 253


def rule(i: int, **over) -> dict:
    return {"rule_id": f"ing_{i}", "listen_port": 8000 + i, "target_addr": f"10.100.0.{i % 200 + 2}:443",
            "mode": "tcp", **over}


def test_rules_of_both_contracts_the_21st_and_clashing_ports_are_refused_by_index():
    rules = [rule(i) for i in range(MAX_INGRESS_RULES + 1)]
    rules += [rule(0), rule(30, mode="acme", hostname="a.example"), rule(31, mode="quic"),
              rule(32, listen_port=8001), rule(33, mode="terminate"), rule(34, target_addr="app:443")]
    ingress = parse_ingress({"ingress_config": {"enabled": True, "rules": rules}})
    assert len(ingress.rules) == MAX_INGRESS_RULES
    assert parse_ingress({"bridge": {"ingress": {"rules": rules}}}).rules == ingress.rules  # errors name the path
    text = "\n".join(ingress.refused)
    assert f"limit of {MAX_INGRESS_RULES} ingress rules" in text and "duplicate rule_id 'ing_0'" in text
    assert "'acme' is not supported" in text and "'quic' is not a mode" in text
    assert "listen_port 8001 is rule 'ing_1''s" in text and "must be PEM text" in text
    assert "'app' is not an IP address" in text
    shared = parse_ingress({"bridge": {"ingress": {"rules": [rule(1, listen_port=443, hostname="a.example"),
                                                              rule(2, listen_port=443, hostname="B.example.")]}}})
    assert [r.hostname for r in shared.rules] == ["a.example", "b.example"] and not shared.refused


def desired_with(rules: list[dict]) -> DesiredState:
    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420,
                                private_key="AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", mesh_ip="10.100.0.1")
    return base.with_state(State.from_wire({"peers": [], "bridge": {"ingress": {"rules": rules}}}))


async def test_the_domain_refuses_targets_outside_the_mesh_or_on_itself_and_certificates_that_do_not_load(tmp_path):
    domain = IngressDomain(str(tmp_path), mesh_range=("10.100.0.0/16",))
    desired = desired_with([rule(1), rule(2, target_addr="127.0.0.1:22"), rule(3, target_addr="10.100.0.1:22"),
                            rule(4, mode="terminate", cert_pem="-----BEGIN CERTIFICATE-----\nnope\n",
                                 key_pem="-----BEGIN PRIVATE KEY-----\nnope\n")])
    planned = domain.plan(desired, await domain.observe(desired))
    assert [c.detail for c in planned.changes] == [
        "ingress port 8001: not listening yet", "ingress rule ing_1: port 8001 to 10.100.0.3:443 (tcp); added"]
    text = "\n".join(planned.errors)
    assert "ing_2: refused: target 127.0.0.1 is outside the mesh (10.100.0.0/16)" in text
    assert "ing_3: refused: target 10.100.0.1 is this bridge itself" in text
    assert "ing_4: refused: its certificate and key do not load" in text
    assert list((tmp_path / "bridge").glob("*.pem")) == []  # a key is on disk only while it loads


class Store:
    def __init__(self) -> None:
        self.entries: dict = {}
        self.puts = 0

    def get(self, key):
        return self.entries.get(key)

    async def put(self, key, content_type, payload, if_match):
        self.puts += 1
        self.entries[key] = type("Entry", (), {"payload": payload})()


async def test_status_reports_are_written_only_when_they_change_and_stay_under_4_kib():
    sample = {"status.bridge": {"enabled": True, "active_relay_sessions": 1}}
    store = Store()
    reports = StatusReports(store, lambda: sample, 30)  # type: ignore[arg-type]
    assert await reports.publish() == ["status.bridge"]
    assert await reports.publish() == [] and store.puts == 1
    sample["status.bridge"] = {"enabled": True, "active_relay_sessions": 2}
    assert await reports.publish() == ["status.bridge"]
    big = bounded({"enabled": True, "tunnels": [{"tunnel_id": f"t{i}", "public_key": "k" * 44} for i in range(200)]})
    assert len(json.dumps(big, separators=(",", ":"))) <= MAX_PAYLOAD and big["truncated"] is True
    assert 0 < len(big["tunnels"]) < 200


async def test_a_client_that_sent_part_of_its_hello_costs_no_wake_ups_until_the_rest_comes():
    # A peek leaves the bytes in the socket, so without a receive low-water mark the partial record kept the
    # socket readable and the loop woke every 10 ms per such client until the hello timeout.
    import asyncio
    import socket

    from plexd.bridge.ingress_port import _peek_record

    class CountingSocket(socket.socket):
        peeks = 0

        def recv(self, *args):  # type: ignore[override]
            CountingSocket.peeks += 1
            return super().recv(*args)

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    server_side = CountingSocket(fileno=accepted.detach())
    server_side.setblocking(False)
    hello = bytes([22, 3, 1, 0, 40]) + bytes(40)  # a 45-byte TLS record
    try:
        client.sendall(hello[:3])
        peek = asyncio.create_task(_peek_record(server_side))
        await asyncio.sleep(0.5)
        assert not peek.done() and CountingSocket.peeks <= 1
        client.sendall(hello[3:])
        assert await asyncio.wait_for(peek, 5) == hello
        assert server_side.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1  # back for the splice
        assert server_side.recv(100) == hello  # peeked, not consumed
    finally:
        for s in (client, server_side, listener):
            s.close()


async def test_a_wildcard_rule_serves_one_more_label_and_an_exact_rule_wins():
    import socket

    from plexd.bridge.ingress_port import IngressPort

    parsed = parse_ingress({"bridge": {"ingress": {"rules": [
        rule(1, listen_port=443, hostname="*.example.com"), rule(2, listen_port=443, hostname="a.example.com"),
        rule(3, listen_port=444, hostname="*.com"), rule(4, listen_port=445, hostname="a.*.example.com")]}}})
    assert [r.rule_id for r in parsed.rules] == ["ing_1", "ing_2"]
    assert sum("is not a host name" in why for why in parsed.refused) == 2
    port = IngressPort("127.0.0.1", 0, tls_context=lambda r: None)  # type: ignore[arg-type,return-value]
    port.set_rules(parsed.rules)
    listener = socket.create_server(("127.0.0.1", 0))

    async def picked(name: str) -> str | None:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        accepted.setblocking(False)
        try:
            client.sendall(client_hello(name))
            chosen = await port._pick(accepted)
            return chosen.rule_id if chosen is not None else None
        finally:
            client.close()
            accepted.close()

    try:
        assert await picked("b.example.com") == "ing_1"
        assert await picked("a.example.com") == "ing_2"
        assert await picked("x.b.example.com") is None and await picked("example.com") is None
    finally:
        listener.close()
