"""What a NAT cannot rewrite in a WireGuard packet: its message type and session indices, and a handshake's mac1.

Layouts (WireGuard whitepaper §5.4): byte 0 type, bytes 1-3 reserved zero, then little-endian u32 indices.
  1 initiation   148 bytes  sender at 4
  2 response      92 bytes  sender at 4, receiver at 8
  3 cookie reply  64 bytes  receiver at 4
  4 transport   >= 32 bytes, receiver at 4 (padded to 16 bytes, except a packet at the tunnel's MTU when the
                 MTU is not a multiple of 16: 1420 gives 1452-byte datagrams, so the length is not checked)
Total: any bytes give a `WgHeader` or None (not WireGuard), never an exception.

mac1 (whitepaper §5.4.4; wireguard-go's cookie.go): the 16 bytes before a handshake message's last 16 (mac2),
BLAKE2s-128 keyed with BLAKE2s-256("mac1----" || the receiver's static public key) over everything before it:
an initiation's is keyed by its responder's key, a response's by its initiator's. Public keys alone check it.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

INITIATION, RESPONSE, COOKIE_REPLY, TRANSPORT = 1, 2, 3, 4
_FIXED_LENGTH = {INITIATION: 148, RESPONSE: 92, COOKIE_REPLY: 64}
_MIN_TRANSPORT = 32


@dataclass(frozen=True, slots=True)
class WgHeader:
    kind: int
    sender: int | None
    receiver: int | None


def parse(data: bytes) -> WgHeader | None:
    if len(data) < 4 or data[1] or data[2] or data[3]:
        return None
    kind = data[0]
    if kind in _FIXED_LENGTH:
        if len(data) != _FIXED_LENGTH[kind]:
            return None
    elif kind == TRANSPORT:
        if len(data) < _MIN_TRANSPORT:
            return None
    else:
        return None
    first = int.from_bytes(data[4:8], "little")
    if kind == INITIATION:
        return WgHeader(kind, first, None)
    if kind == RESPONSE:
        return WgHeader(kind, first, int.from_bytes(data[8:12], "little"))
    return WgHeader(kind, None, first)


def mac1_key(public_key: bytes) -> bytes:
    """The key a handshake message for the holder of `public_key` is mac1'd with."""
    return hashlib.blake2s(b"mac1----" + public_key).digest()


def mac1_ok(data: bytes, key: bytes) -> bool:
    """Whether handshake message `data` (an initiation or a response `parse` accepted) carries the mac1 of `key`."""
    at = len(data) - 32  # mac1, then mac2: the last 32 bytes of both messages
    return hmac.compare_digest(hashlib.blake2s(data[:at], key=key, digest_size=16).digest(), data[at:at + 16])
