"""The STUN codec (plexd/nat/stun.py) and the server list (plexd/nat/servers.py): every bad answer of the issue's
list is a StunError that names the problem; valid answers round-trip; hypothesis for the parser's properties."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plexd.nat.probe import _udp_in_ipv4, udp_checksum
from plexd.nat.servers import StunServer, parse_server
from plexd.nat.stun import (
    HEADER,
    MAGIC_COOKIE,
    Mapped,
    NotOurs,
    StunError,
    binding_request,
    binding_response,
    looks_like_stun,
    parse_binding_response,
)

TXID = b"0123456789ab"


def test_the_request_is_the_plain_20_bytes_of_section_10() -> None:
    req = binding_request(TXID)
    assert req == b"\x00\x01\x00\x00\x21\x12\xa4\x42" + TXID
    assert looks_like_stun(req)


@pytest.mark.parametrize("xor", [True, False])
def test_a_success_answer_gives_the_mapped_address(xor: bool) -> None:
    assert parse_binding_response(binding_response(TXID, "203.0.113.10", 51820, xor=xor), TXID) == \
        Mapped("203.0.113.10", 51820)


def test_xor_mapped_address_wins_over_mapped_address() -> None:
    xor = binding_response(TXID, "203.0.113.10", 40000)
    plain = binding_response(TXID, "198.51.100.1", 1, xor=False)[HEADER.size:]
    body = plain + xor[HEADER.size:]
    msg = HEADER.pack(0x0101, len(body), MAGIC_COOKIE, TXID) + body
    assert parse_binding_response(msg, TXID) == Mapped("203.0.113.10", 40000)


def _with_attr(attr_type: int, value: bytes, msg_type: int = 0x0101, txid: bytes = TXID) -> bytes:
    attr = struct.pack("!HH", attr_type, len(value)) + value + b"\0" * (-len(value) % 4)
    return HEADER.pack(msg_type, len(attr), MAGIC_COOKIE, txid) + attr


@pytest.mark.parametrize(("data", "problem"), [
    (b"", "shorter than a STUN header"),
    (b"\xff" * 40, "not a STUN message"),
    (HEADER.pack(0x0101, 0, 0xDEADBEEF, TXID), "wrong magic cookie 0xdeadbeef"),
    (HEADER.pack(0x0101, 8, MAGIC_COOKIE, TXID), "header length 8 does not match the 0 bytes"),
    (HEADER.pack(0x0101, 0, MAGIC_COOKIE, TXID), "without XOR-MAPPED-ADDRESS or MAPPED-ADDRESS"),
    (_with_attr(0x0020, b"\x00\x02\x12\x34" + bytes(16)), "IPv6 address; plexd discovers IPv4 endpoints only"),
    (_with_attr(0x0020, b"\x00\x07\x12\x34" + bytes(4)), "unknown address family 0x07"),
    (_with_attr(0x0001, b"\x00\x01\x00\x00" + bytes(4)), "is not an address peers can send to"),
    (_with_attr(0x0001, b"\x00\x01"), "too short"),
    (_with_attr(0x0001, b"\x00\x01\x00\x01\x01\x02\x03\x04\x05"), "for IPv4 is 9 bytes, not 8"),
    (_with_attr(0x0009, b"\x00\x00\x04\x14Unknown Attribute", msg_type=0x0111), "error response 420 Unknown Attribute"),
    (_with_attr(0x0020, b"\x00\x01\x00\x01" + bytes(4), msg_type=0x0001), "type 0x0001 is not a Binding success"),
    (HEADER.pack(0x0101, 4, MAGIC_COOKIE, TXID) + b"\x00\x20\x00\x08", "claims 8 bytes, only 0 left"),
    (b"x" * 2000, "longer than any STUN answer"),
])
def test_every_unusable_answer_names_its_problem(data: bytes, problem: str) -> None:
    with pytest.raises(StunError) as err:
        parse_binding_response(data, TXID)
    assert problem in str(err.value)


def test_an_answer_to_another_transaction_is_not_ours() -> None:
    with pytest.raises(NotOurs):
        parse_binding_response(binding_response(b"x" * 12, "203.0.113.10", 1), TXID)


@given(st.ip_addresses(v=4), st.integers(1, 65535), st.binary(min_size=12, max_size=12), st.booleans())
def test_valid_answers_round_trip(ip, port, txid, xor) -> None:
    if ip.is_unspecified or ip.is_multicast or str(ip) == "255.255.255.255":
        return
    assert parse_binding_response(binding_response(txid, str(ip), port, xor=xor), txid) == Mapped(str(ip), port)


@given(st.binary(min_size=12, max_size=12), st.integers(0, 40), st.data())
def test_a_cut_or_bit_flipped_answer_is_refused_or_still_an_ipv4_mapping(txid, cut, data) -> None:
    good = binding_response(txid, "198.51.100.7", 3478)
    pos = data.draw(st.integers(0, len(good) - 1))
    flipped = good[:pos] + bytes([good[pos] ^ data.draw(st.integers(1, 255))]) + good[pos + 1:]
    for msg in (good[:cut], flipped):
        try:
            mapped = parse_binding_response(msg, txid)
        except StunError:
            continue
        assert 0 < mapped.port < 65536 and mapped.ip.count(".") == 3


@pytest.mark.parametrize(("text", "server"), [
    ("stun.example", StunServer("stun.example", 3478)),
    ("192.0.2.10:3479", StunServer("192.0.2.10", 3479)),
    (" 192.0.2.10 ", StunServer("192.0.2.10", 3478)),
    ("stun_1.internal:3478", StunServer("stun_1.internal", 3478)),  # internal DNS has underscores: still taken
])
def test_server_names(text: str, server: StunServer) -> None:
    assert parse_server(text) == server


@pytest.mark.parametrize(("text", "problem"), [
    ("", "empty"), ("[2001:db8::1]:3478", "IPv6 STUN servers are not used"), ("h:0", "port '0' is not 1-65535"),
    ("h:x", "port 'x'"), (":3478", "is not HOST or HOST:PORT"), ("a b", "is not HOST or HOST:PORT"),
    # names the resolver cannot encode: getaddrinfo's UnicodeError escaped discovery, and the NAT service died
    ("stun..example.net", "is not HOST or HOST:PORT"), ("x" * 64 + ".example.net", "is not HOST or HOST:PORT"),
    ("stun.example.net..", "is not HOST or HOST:PORT"),
])
def test_bad_server_names_say_why(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_server(text)
    assert problem in str(err.value)


def test_a_bad_server_in_the_config_names_the_key(tmp_path) -> None:
    from plexd.base.errors import ConfigError
    from plexd.config.settings import load

    cfg = tmp_path / "config.yaml"
    cfg.write_text("nat_traversal: {stun_servers: ['192.0.2.1:3478', '[::1]:3478']}\n")
    with pytest.raises(ConfigError) as err:
        load(str(cfg), env={})
    assert "nat_traversal.stun_servers" in str(err.value) and "IPv6 STUN servers" in str(err.value)


def test_the_udp_checksum_matches_a_known_datagram() -> None:
    # 192.0.2.1:51820 -> 192.0.2.10:3478 carrying a binding request; a correct checksum sums to 0xffff
    segment = struct.pack("!HHHH", 51820, 3478, 28, 0) + binding_request(TXID)
    csum = udp_checksum("192.0.2.1", "192.0.2.10", segment)
    check = udp_checksum("192.0.2.1", "192.0.2.10", segment[:6] + struct.pack("!H", csum) + segment[8:])
    assert check == 0xFFFF  # the sum over a datagram carrying its checksum is all ones (complement 0 → 0xffff)


def test_the_raw_reader_keeps_only_ipv4_udp_to_the_listen_port() -> None:
    payload = binding_response(TXID, "192.0.2.1", 51820)
    udp = struct.pack("!HHHH", 3478, 51820, 8 + len(payload), 0) + payload
    ip = bytes([0x45, 0, 0, 20 + len(udp), 0, 0, 0, 0, 64, 17, 0, 0, 192, 0, 2, 10, 192, 0, 2, 1])
    assert _udp_in_ipv4(ip + udp, 51820) == ("192.0.2.10", 3478, payload)
    assert _udp_in_ipv4(ip + udp, 51821) is None
    assert _udp_in_ipv4(ip[:9] + b"\x06" + ip[10:] + udp, 51820) is None  # TCP
    assert _udp_in_ipv4(ip[:10], 51820) is None


async def test_a_name_the_resolver_cannot_encode_is_a_stun_error_for_that_server() -> None:
    from plexd.nat.servers import resolve
    from plexd.nat.stun import StunError

    with pytest.raises(StunError, match=r"cannot resolve 'stun\.\.example\.net'"):
        await resolve("stun..example.net")
