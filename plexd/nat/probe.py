"""Asking one STUN server from the WireGuard listen port, so the mapping found is the one peers will use.

Two transports, because the port is free only until the device binds it:

- `BoundTransport`: an ordinary UDP socket bound to the listen port. Used at start, before the WireGuard device
  exists (the assembly binds it first and hands it over; the device waits until it is closed).
- `RawTransport`: while the device holds the port (wireguard-go's socket, or the kernel module's — neither can
  share it: no SO_REUSEPORT), the request is sent from a raw IPPROTO_UDP socket with the listen port as its UDP
  source port, and the answer is read from the same raw socket, which gets a copy of every UDP datagram the
  machine receives. A classic BPF filter keeps only datagrams to the listen port that carry the STUN magic
  cookie, so WireGuard traffic is not copied. The device also receives the answer and drops it as an invalid
  message; nothing in the tunnel is disturbed. Needs CAP_NET_RAW, which plexd has (it runs as root).

Both go through the same conntrack entry and NAT mapping as the tunnel's packets: source address and port are the
device's. The measurements that led here are in the README (NAT traversal).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
import struct
from dataclasses import dataclass
from typing import Protocol

from plexd.nat.stun import (
    MAGIC_COOKIE,
    Mapped,
    NotOurs,
    StunError,
    binding_request,
    new_transaction_id,
    parse_binding_response,
)

SO_ATTACH_FILTER = 26
RETRANSMIT = (0.5, 1.0, 2.0)  # seconds after the first send, then after each resend (RFC 5389 §7.2.1, shortened)
RECV_SIZE = 2048


class Transport(Protocol):
    local_port: int

    def send(self, data: bytes, ip: str, port: int) -> None: ...

    async def recv(self) -> tuple[str, int, bytes]: ...  # (source ip, source port, UDP payload)

    def close(self) -> None: ...


@dataclass(frozen=True)
class Answer:
    mapped: Mapped
    local: Mapped  # the machine's own address towards the server, and the listen port
    ignored: int  # datagrams that were not this server's answer to this request


def source_address(ip: str, port: int) -> str:
    """The local address the kernel would send from to reach ip:port (a connected UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))
        except OSError as exc:
            raise StunError(f"no route to {ip}: {exc.strerror or exc}") from None
        return str(s.getsockname()[0])


async def ask(transport: Transport, ip: str, port: int, timeout: float) -> Answer:
    """One Binding request to ip:port (resent on the RETRANSMIT schedule) and its answer; StunError otherwise."""
    local = Mapped(source_address(ip, port), transport.local_port)
    txid = new_transaction_id()
    request = binding_request(txid)
    loop = asyncio.get_running_loop()
    start = loop.time()
    resend_at = [start + sum(RETRANSMIT[: i + 1]) for i in range(len(RETRANSMIT))]
    ignored = 0
    _send(transport, request, ip, port)
    while True:
        now = loop.time()
        if now >= start + timeout:
            extra = f" ({ignored} unrelated datagram(s) ignored)" if ignored else ""
            raise StunError(f"no answer within {timeout:g}s{extra}")
        while resend_at and resend_at[0] <= now:
            resend_at.pop(0)
            _send(transport, request, ip, port)
        wake = min([start + timeout, *resend_at[:1]])
        try:
            async with asyncio.timeout(max(0.0, wake - now)):
                src_ip, src_port, payload = await transport.recv()
        except TimeoutError:
            continue
        except OSError as exc:  # the socket went away (the hand-over deadline closed it)
            raise StunError(f"receiving failed: {exc.strerror or exc}") from None
        if (src_ip, src_port) != (ip, port):
            ignored += 1
            continue
        try:
            return Answer(parse_binding_response(payload, txid), local, ignored)
        except NotOurs:
            ignored += 1


def _send(transport: Transport, data: bytes, ip: str, port: int) -> None:
    try:
        transport.send(data, ip, port)
    except OSError as exc:
        raise StunError(f"cannot send to {ip}:{port}: {exc.strerror or exc}") from None


class BoundTransport:
    """An ordinary UDP socket on the listen port (the port must be free)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.local_port = int(sock.getsockname()[1])

    @classmethod
    def bind(cls, port: int) -> BoundTransport:
        """OSError (EADDRINUSE) when something, e.g. the WireGuard device, holds the port."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            sock.close()
            raise
        return cls(sock)

    def send(self, data: bytes, ip: str, port: int) -> None:
        self.sock.sendto(data, (ip, port))

    async def recv(self) -> tuple[str, int, bytes]:
        while True:
            try:
                data, (ip, port) = await asyncio.get_running_loop().sock_recvfrom(self.sock, RECV_SIZE)
                return str(ip), int(port), data
            except ConnectionRefusedError:  # an ICMP error for an earlier send: not an answer
                continue

    def close(self) -> None:
        self.sock.close()


class RawTransport:
    """STUN from the listen port while the WireGuard device holds it (see the module doc)."""

    def __init__(self, local_port: int) -> None:
        self.local_port = local_port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
        try:
            self.sock.setblocking(False)
            _attach_stun_filter(self.sock, local_port)
            self._drain()  # datagrams queued before the filter was attached
        except OSError:
            self.sock.close()
            raise
        self._bound_to = ""

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            for _ in range(10_000):
                self.sock.recv(RECV_SIZE)

    def send(self, data: bytes, ip: str, port: int) -> None:
        src = source_address(ip, port)
        if src != self._bound_to:  # the kernel writes the IP header from this address; the checksum covers it
            self.sock.bind((src, 0))
            self._bound_to = src
        length = 8 + len(data)
        header = struct.pack("!HHHH", self.local_port, port, length, 0)
        checksum = udp_checksum(src, ip, header + data)
        self.sock.sendto(struct.pack("!HHHH", self.local_port, port, length, checksum) + data, (ip, 0))

    async def recv(self) -> tuple[str, int, bytes]:
        loop = asyncio.get_running_loop()
        while True:
            packet = await loop.sock_recv(self.sock, RECV_SIZE)
            parsed = _udp_in_ipv4(packet, self.local_port)
            if parsed is not None:
                return parsed

    def close(self) -> None:
        self.sock.close()


def _udp_in_ipv4(packet: bytes, dport: int) -> tuple[str, int, bytes] | None:
    """(source ip, source port, payload) of an IPv4 UDP datagram to `dport`; None for anything else."""
    if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != socket.IPPROTO_UDP:
        return None
    ihl = (packet[0] & 0x0F) * 4
    if ihl < 20 or len(packet) < ihl + 8:
        return None
    sport, to_port, length = struct.unpack_from("!HHH", packet, ihl)
    if to_port != dport or length < 8:
        return None
    payload = packet[ihl + 8: ihl + length]
    return socket.inet_ntoa(packet[12:16]), sport, payload


def udp_checksum(src: str, dst: str, segment: bytes) -> int:
    """The UDP checksum over the IPv4 pseudo-header and `segment` (header with a zero checksum, and payload)."""
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, socket.IPPROTO_UDP, len(segment))
    data = pseudo + segment + (b"\0" if len(segment) % 2 else b"")
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    checksum = ~total & 0xFFFF
    return checksum or 0xFFFF  # 0 means "no checksum" in UDP over IPv4


def _attach_stun_filter(sock: socket.socket, port: int) -> None:
    """Classic BPF on a raw IPv4 UDP socket: keep datagrams to `port` whose payload carries the magic cookie."""
    program = [
        (0xB1, 0, 0, 0),  # ldxb 4*([0]&0xf)   X = IP header length
        (0x48, 0, 0, 2),  # ldh [x+2]          UDP destination port
        (0x15, 0, 3, port),  # jeq #port, next, drop
        (0x40, 0, 0, 12),  # ld [x+12]         payload bytes 4..8: the magic cookie
        (0x15, 0, 1, MAGIC_COOKIE),  # jeq #cookie, accept, drop
        (0x06, 0, 0, 0xFFFF),  # ret #65535      accept
        (0x06, 0, 0, 0),  # ret #0             drop
    ]
    code = b"".join(struct.pack("HBBI", *insn) for insn in program)
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
