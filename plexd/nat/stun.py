"""The STUN Binding exchange of docs/protocol.md §10: a 20-byte request, and a bounded parser for the answer.

Why not aiostun's codec: it cannot send through the raw socket the refresh needs (`plexd.nat.probe`), and it
cannot say what was wrong with an answer — a wrong magic cookie is read as a classic RFC 3489 message, a wrong
transaction id or garbage all come back as an empty dict (and garbage raises inside its protocol callback, so the
caller waits out the timeout), an unknown address family raises UnboundLocalError. Each case here is a
`StunError` whose message names the problem, so the log can name the server and what it sent.

The request is plain: type 0x0001, length 0, the magic cookie, a random 12-byte transaction id, no attributes.
An answer is accepted only with the cookie, our transaction id and type 0x0101; XOR-MAPPED-ADDRESS (0x0020) is
preferred, MAPPED-ADDRESS (0x0001) is the fallback, and only IPv4 is used.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass

from plexd.base.errors import PlexdError

MAGIC_COOKIE = 0x2112A442
BINDING_REQUEST = 0x0001
BINDING_SUCCESS = 0x0101
BINDING_ERROR = 0x0111
ATTR_MAPPED_ADDRESS = 0x0001
ATTR_ERROR_CODE = 0x0009
ATTR_XOR_MAPPED_ADDRESS = 0x0020
HEADER = struct.Struct("!HHI12s")
MAX_MESSAGE = 1500  # a STUN answer in one Ethernet frame; anything longer is not one we asked for


class StunError(PlexdError):
    """An answer that cannot be used; the message says why (the caller adds which server sent it)."""


class NotOurs(StunError):
    """A well-formed STUN message for another transaction: ignored while waiting for ours."""


@dataclass(frozen=True)
class Mapped:
    """The address and port the server saw the request come from."""

    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}"


def new_transaction_id() -> bytes:
    return os.urandom(12)


def binding_request(transaction_id: bytes) -> bytes:
    if len(transaction_id) != 12:
        raise ValueError("a STUN transaction id is 12 bytes")
    return HEADER.pack(BINDING_REQUEST, 0, MAGIC_COOKIE, transaction_id)


def looks_like_stun(data: bytes) -> bool:
    """Cheap pre-filter: long enough, top two bits zero, our magic cookie."""
    return len(data) >= HEADER.size and data[0] & 0xC0 == 0 and data[4:8] == MAGIC_COOKIE.to_bytes(4, "big")


def parse_binding_response(data: bytes, transaction_id: bytes) -> Mapped:
    """The mapped IPv4 address in `data`, an answer to `transaction_id`; StunError (NotOurs) naming the problem."""
    if len(data) < HEADER.size:
        raise StunError(f"{len(data)} bytes is shorter than a STUN header (20 bytes)")
    if len(data) > MAX_MESSAGE:
        raise StunError(f"{len(data)} bytes is longer than any STUN answer plexd accepts ({MAX_MESSAGE})")
    msg_type, length, cookie, txid = HEADER.unpack_from(data)
    if msg_type & 0xC000:
        raise StunError(f"not a STUN message (first byte 0x{data[0]:02x})")
    if cookie != MAGIC_COOKIE:
        raise StunError(f"wrong magic cookie 0x{cookie:08x} (want 0x{MAGIC_COOKIE:08x})")
    if length % 4 or HEADER.size + length != len(data):
        raise StunError(f"header length {length} does not match the {len(data) - HEADER.size} bytes of attributes")
    if txid != transaction_id:
        raise NotOurs("transaction id does not match the request")
    attrs = _attributes(data[HEADER.size:])
    if msg_type == BINDING_ERROR:
        raise StunError(f"error response{_error_text(attrs.get(ATTR_ERROR_CODE))}")
    if msg_type != BINDING_SUCCESS:
        raise StunError(f"message type 0x{msg_type:04x} is not a Binding success response (0x0101)")
    if ATTR_XOR_MAPPED_ADDRESS in attrs:
        return _address(attrs[ATTR_XOR_MAPPED_ADDRESS], xor=True)
    if ATTR_MAPPED_ADDRESS in attrs:
        return _address(attrs[ATTR_MAPPED_ADDRESS], xor=False)
    raise StunError("success response without XOR-MAPPED-ADDRESS or MAPPED-ADDRESS")


def _attributes(body: bytes) -> dict[int, bytes]:
    """type -> value of the first attribute of each type (values padded to 4 bytes, RFC 5389 §15)."""
    out: dict[int, bytes] = {}
    pos = 0
    while pos < len(body):
        if len(body) - pos < 4:
            raise StunError(f"attribute header cut short at byte {pos}")
        attr_type, attr_len = struct.unpack_from("!HH", body, pos)
        start, end = pos + 4, pos + 4 + attr_len
        if end > len(body):
            raise StunError(f"attribute 0x{attr_type:04x} claims {attr_len} bytes, only {len(body) - start} left")
        out.setdefault(attr_type, body[start:end])
        pos = end + (-attr_len % 4)
    return out


def _address(value: bytes, *, xor: bool) -> Mapped:
    name = "XOR-MAPPED-ADDRESS" if xor else "MAPPED-ADDRESS"
    if len(value) < 4:
        raise StunError(f"{name} is {len(value)} bytes, too short")
    family, port = value[1], struct.unpack_from("!H", value, 2)[0]
    if family == 0x02:
        raise StunError(f"{name} is an IPv6 address; plexd discovers IPv4 endpoints only")
    if family != 0x01:
        raise StunError(f"{name} has unknown address family 0x{family:02x}")
    if len(value) != 8:
        raise StunError(f"{name} for IPv4 is {len(value)} bytes, not 8")
    raw = int.from_bytes(value[4:8], "big")
    if xor:
        port ^= MAGIC_COOKIE >> 16
        raw ^= MAGIC_COOKIE
    ip = ipaddress.IPv4Address(raw)
    if port == 0 or ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise StunError(f"{name} {ip}:{port} is not an address peers can send to")
    return Mapped(str(ip), port)


def _error_text(value: bytes | None) -> str:
    if value is None or len(value) < 4:
        return ""
    code = (value[2] & 0x07) * 100 + value[3]
    reason = value[4:128].decode("utf-8", "replace").strip()
    return f" {code} {''.join(c if c.isprintable() else '?' for c in reason)}".rstrip()


def binding_response(transaction_id: bytes, ip: str, port: int, *, xor: bool = True) -> bytes:
    """A success answer (for tests and the fake servers of the bad-input tests)."""
    raw = int(ipaddress.IPv4Address(ip))
    if xor:
        value = struct.pack("!BBHI", 0, 1, port ^ (MAGIC_COOKIE >> 16), raw ^ MAGIC_COOKIE)
        attr = struct.pack("!HH", ATTR_XOR_MAPPED_ADDRESS, 8) + value
    else:
        attr = struct.pack("!HH", ATTR_MAPPED_ADDRESS, 8) + struct.pack("!BBHI", 0, 1, port, raw)
    return HEADER.pack(BINDING_SUCCESS, len(attr), MAGIC_COOKIE, transaction_id) + attr
