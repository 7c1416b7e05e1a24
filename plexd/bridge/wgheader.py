"""What a NAT cannot rewrite in a WireGuard packet: its message type and session indices.

Layouts (WireGuard whitepaper §5.4): byte 0 type, bytes 1-3 reserved zero, then little-endian u32 indices.
  1 initiation   148 bytes  sender at 4
  2 response      92 bytes  sender at 4, receiver at 8
  3 cookie reply  64 bytes  receiver at 4
  4 transport   >= 32 bytes, receiver at 4 (padded to 16 bytes, except a packet at the tunnel's MTU when the
                 MTU is not a multiple of 16: 1420 gives 1452-byte datagrams, so the length is not checked)
Total: any bytes give a `WgHeader` or None (not WireGuard), never an exception.
"""

from __future__ import annotations

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
