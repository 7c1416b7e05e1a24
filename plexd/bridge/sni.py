"""The server name a TLS client asks for (SNI), read from its ClientHello without terminating TLS.

Bounded and strict: one TLS record (at most 16 KiB + its header), every length checked against what is left;
anything malformed raises ValueError naming what was wrong. A ClientHello split over several records (rare, and
never from a ClientHello under 16 KiB) counts as having no name.
"""

from __future__ import annotations

RECORD_HEADER = 5
MAX_RECORD = 16384
HANDSHAKE = 22
CLIENT_HELLO = 1
SERVER_NAME = 0
HOST_NAME = 0


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise ValueError(f"the ClientHello is cut short in its {what}")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def number(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def vector(self, size: int, what: str) -> bytes:
        return self.take(self.number(size, what), what)


def record_length(head: bytes) -> int:
    """How many bytes the first TLS record needs in all (header included); ValueError when it is not TLS."""
    if len(head) < RECORD_HEADER:
        raise ValueError("fewer than 5 bytes: no TLS record header yet")
    if head[0] != HANDSHAKE or head[1] != 3:
        raise ValueError("not a TLS handshake record")
    length = int.from_bytes(head[3:5], "big")
    if not 0 < length <= MAX_RECORD:
        raise ValueError(f"a TLS record of {length} bytes")
    return RECORD_HEADER + length


def server_name(record: bytes) -> str:
    """The lower-case host name of the ClientHello in `record` (one whole TLS record), "" when it names none."""
    body = _Reader(record[RECORD_HEADER:record_length(record)])
    if body.number(1, "handshake type") != CLIENT_HELLO:
        raise ValueError("the first handshake message is not a ClientHello")
    declared = body.number(3, "handshake length")
    if declared > len(body.data) - body.at:
        return ""  # continued in the next record: no name read from this one
    hello = _Reader(body.take(declared, "handshake"))
    hello.take(2 + 32, "version and random")
    hello.vector(1, "session id")
    hello.vector(2, "cipher suites")
    hello.vector(1, "compression methods")
    if hello.at == len(hello.data):
        return ""  # no extensions at all
    extensions = _Reader(hello.vector(2, "extensions"))
    while extensions.at < len(extensions.data):
        kind = extensions.number(2, "extension type")
        data = extensions.vector(2, "extension")
        if kind != SERVER_NAME:
            continue
        names = _Reader(_Reader(data).vector(2, "server name list"))
        while names.at < len(names.data):
            name_type = names.number(1, "server name type")
            name = names.vector(2, "server name")
            if name_type == HOST_NAME:
                if not name or len(name) > 253 or not name.isascii():
                    raise ValueError("the server name is empty, too long or not ASCII")
                return name.decode("ascii").lower().rstrip(".")
        return ""
    return ""
