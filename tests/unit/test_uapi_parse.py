"""UAPI text protocol: request encoding, `get=1` parsing (handshake, counters, zero keys), errno handling."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plexd.machine.wireguard import DeviceUpdate, PeerCounters, PeerUpdate, UapiError, WireGuardError
from plexd.machine.wireguard.uapi import (
    describe_update,
    encode_set,
    hex_to_b64,
    parse_counter_rows,
    parse_counters,
    parse_errno,
    parse_get,
)

K1 = base64.b64encode(bytes(range(32))).decode()
K2 = base64.b64encode(bytes(range(32, 64))).decode()
H1 = bytes(range(32)).hex()
H2 = bytes(range(32, 64)).hex()

GET_REPLY = f"""private_key={H1}
listen_port=51821
public_key={H2}
preshared_key={"00" * 32}
protocol_version=1
endpoint=10.250.1.1:51820
last_handshake_time_sec=1795299633
last_handshake_time_nsec=903067696
tx_bytes=476
rx_bytes=532
persistent_keepalive_interval=25
allowed_ip=10.99.0.1/32
allowed_ip=10.98.0.5/24
public_key={H1}
preshared_key={H2}
endpoint=[fd00::1]:51820
last_handshake_time_sec=0
last_handshake_time_nsec=0
tx_bytes=0
rx_bytes=0
persistent_keepalive_interval=0
errno=0

"""


def test_parse_get_reads_device_peers_handshake_and_counters() -> None:
    dev = parse_get(GET_REPLY)
    assert dev.private_key == K1 and dev.listen_port == 51821
    p = dev.peers[K2]
    assert p.endpoint == "10.250.1.1:51820"
    assert p.allowed_ips == frozenset({"10.99.0.1/32", "10.98.0.0/24"})  # normalised like the kernel masks it
    assert p.psk == ""  # all-zero key means none
    assert p.last_handshake == pytest.approx(1795299633.903067696)
    assert (p.rx, p.tx, p.persistent_keepalive) == (532, 476, 25)
    q = dev.peers[K1]
    assert q.psk == K2 and q.endpoint == "[fd00::1]:51820" and q.allowed_ips == frozenset() and q.last_handshake == 0


def test_parse_counters_reads_what_parse_get_reads_of_each_peer() -> None:
    assert parse_counters(GET_REPLY) == {K2: PeerCounters(pytest.approx(1795299633.903067696), 532, 476),
                                         K1: PeerCounters(0.0, 0, 0)}
    for key, p in parse_get(GET_REPLY).peers.items():
        assert parse_counters(GET_REPLY)[key] == (p.last_handshake, p.rx, p.tx)
    assert parse_counters("private_key=00\nlisten_port=1\nerrno=0\n\n") == {}  # no peers


def test_parse_counters_errors() -> None:
    with pytest.raises(WireGuardError, match="no errno"):
        parse_counters(f"public_key={H1}\nrx_bytes=1\n")  # cut short
    with pytest.raises(UapiError):
        parse_counters("errno=-19\n\n")
    with pytest.raises(WireGuardError, match="malformed UAPI get reply"):
        parse_counters(f"public_key={H1}\nrx_bytes=many\nerrno=0\n\n")
    with pytest.raises(WireGuardError, match="malformed UAPI get reply"):
        parse_counters("public_key=zz\nerrno=0\n\n")
    with pytest.raises(WireGuardError, match="malformed UAPI get reply: public_key="):  # hex with spaces in it
        parse_counters(f"public_key={H1[:62]}  \nerrno=0\n\n")


def test_counter_rows_are_the_counters_as_the_device_wrote_them_in_any_order() -> None:
    rows = [(H2, "1795299633", "903067696", "476", "532"), (H1, "0", "0", "0", "0")]
    assert parse_counter_rows(GET_REPLY) == rows
    # Another implementation may write a block's lines in another order: read block by block, the same rows.
    reordered = GET_REPLY.replace("tx_bytes=476\nrx_bytes=532\n", "rx_bytes=532\ntx_bytes=476\n")
    assert parse_counter_rows(reordered) == rows
    # A block without its counters: 0, and the next peer's counters are not taken for it.
    assert parse_counter_rows(f"public_key={H2}\npublic_key={H1}\ntx_bytes=1\nrx_bytes=2\nerrno=0\n\n") == [
        (H2, "0", "0", "0", "0"), (H1, "0", "0", "1", "2")]
    # Another implementation's upper-case key is the same key.
    assert parse_counter_rows(reordered.replace(H2, H2.upper())) == rows
    # The digits go into JSON texts as they are: a leading zero (not JSON) is dropped.
    assert parse_counter_rows(GET_REPLY.replace("tx_bytes=476", "tx_bytes=0476")) == rows


@pytest.mark.parametrize("bad", ["rx_bytes=-1", "tx_bytes=" + "9" * 21, "rx_bytes=", "rx_bytes=١٢", "tx_bytes=1e3"])
def test_a_counter_that_is_not_up_to_20_digits_is_a_clear_error(bad) -> None:
    with pytest.raises(WireGuardError, match="malformed UAPI get reply"):
        parse_counter_rows(f"public_key={H1}\nlast_handshake_time_sec=0\n{bad}\nerrno=0\n\n")


_PEER = st.tuples(st.binary(min_size=32, max_size=32), st.integers(0, 2**40), st.integers(0, 999_999_999),
                  st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.booleans(),
                  st.lists(st.sampled_from(["10.0.0.1/32", "fd00::/64"]), max_size=3))


@given(peers=st.lists(_PEER, max_size=8, unique_by=lambda p: p[0]), shuffled=st.randoms())
def test_counter_rows_read_what_parse_get_reads_whatever_the_line_order(peers, shuffled) -> None:
    def reply(order) -> str:
        out = [f"private_key={H1}", "listen_port=51820"]
        for key, sec, nsec, tx, rx, endpoint, allowed in peers:
            lines = [f"preshared_key={'00' * 32}", "protocol_version=1",
                     *(["endpoint=10.1.2.3:51820"] if endpoint else []),
                     f"last_handshake_time_sec={sec}", f"last_handshake_time_nsec={nsec}", f"tx_bytes={tx}",
                     f"rx_bytes={rx}", "persistent_keepalive_interval=25", *(f"allowed_ip={a}" for a in allowed)]
            out += [f"public_key={key.hex()}", *order(lines)]
        return "\n".join(out) + "\nerrno=0\n\n"

    expected = [(key.hex(), str(sec), str(nsec), str(tx), str(rx)) for key, sec, nsec, tx, rx, _, _ in peers]
    as_written, any_order = reply(list), reply(lambda lines: shuffled.sample(lines, len(lines)))
    assert parse_counter_rows(as_written) == parse_counter_rows(any_order) == expected
    device = parse_get(any_order)
    assert parse_counters(any_order) == {k: (p.last_handshake, p.rx, p.tx) for k, p in device.peers.items()}


def test_parse_get_errors() -> None:
    with pytest.raises(WireGuardError, match="no errno"):
        parse_get("private_key=00\n\n")
    with pytest.raises(WireGuardError, match="line 1"):
        parse_get("garbage\nerrno=0\n\n")
    with pytest.raises(WireGuardError, match="listen_port"):
        parse_get("listen_port=abc\nerrno=0\n\n")
    with pytest.raises(UapiError):
        parse_get("errno=-5\n\n")
    with pytest.raises(WireGuardError, match="no errno line"):
        parse_errno("")  # wireguard-go closes the socket on an unknown operation


def test_encode_set_full_and_minimal() -> None:
    text = encode_set(DeviceUpdate(private_key=K1, listen_port=51820, peers=(
        PeerUpdate(public_key=K2, remove=True),
        PeerUpdate(public_key=K1, endpoint="1.2.3.4:5", allowed_ips=frozenset({"10.0.0.2/32", "10.0.1.0/24"}),
                   psk="", persistent_keepalive=25),
        PeerUpdate(public_key=K2, update_only=True, endpoint="[fd00::1]:7"),
    )))
    assert text == (
        f"set=1\nprivate_key={H1}\nlisten_port=51820\n"
        f"public_key={H2}\nremove=true\n"
        f"public_key={H1}\npreshared_key={'00' * 32}\nendpoint=1.2.3.4:5\npersistent_keepalive_interval=25\n"
        "replace_allowed_ips=true\nallowed_ip=10.0.0.2/32\nallowed_ip=10.0.1.0/24\n"
        f"public_key={H2}\nupdate_only=true\nendpoint=[fd00::1]:7\n\n"
    )


def test_describe_update_names_the_peer_without_key_material() -> None:
    text = describe_update(DeviceUpdate(private_key=K1, peers=(
        PeerUpdate(public_key=K2, allowed_ips=frozenset({"10.0.0.2/32"})),)), "wg0")
    assert text == f"the private key, peer {K2[:8]}… (allowed_ips=10.0.0.2/32) on wg0"
    assert K1 not in text
    assert str(UapiError(-22, text)).startswith("WireGuard refused the private key, peer ")


@given(st.binary(min_size=32, max_size=32), st.integers(0, 65535), st.integers(0, 2**63))
def test_key_and_number_round_trip(raw: bytes, port: int, counter: int) -> None:
    reply = f"private_key={raw.hex()}\nlisten_port={port}\npublic_key={raw.hex()}\nrx_bytes={counter}\nerrno=0\n\n"
    dev = parse_get(reply)
    key = base64.b64encode(raw).decode()
    assert dev.listen_port == port and dev.peers[key].rx == counter
    assert dev.private_key == ("" if raw == bytes(32) else key)
    assert hex_to_b64(raw.hex()) == key
    assert parse_counters(reply) == {key: (0.0, counter, 0)}
