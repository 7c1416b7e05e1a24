"""Round-trip times to peers over the mesh: one ICMP echo to each peer's mesh address, all in flight at once on
one socket, answers matched by identifier and sequence. A peer that does not answer within the timeout (or
cannot be sent to) gets ``-1``, as §1.14's ``latency`` group says.

A raw socket needs CAP_NET_RAW (plexd runs as root); without it the unprivileged ICMP datagram socket is tried
(``net.ipv4.ping_group_range``). Only IPv4 mesh addresses are probed.

A raw ICMP socket receives every ICMP packet the host gets. On a node whose WireGuard sends handshakes to peers
that are gone, that is a port-unreachable per handshake (200 a second at 1,000 such peers), each one read and
dropped by the probe loop: the kernel's ICMP_FILTER (like iputils ping's) passes it echo replies only. The filter
only saves work (the loop matches replies anyway), so a kernel without it costs nothing but that.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import itertools
import os
import socket
import struct
import time

from plexd.base.errors import PlexdError
from plexd.base.mesh_caches import bounded_by_mesh

ECHO_REQUEST, ECHO_REPLY = 8, 0
SOL_RAW, ICMP_FILTER = 255, 1  # <linux/icmp.h>: a mask of the ICMP types (< 32) a raw socket does not get
ONLY_ECHO_REPLIES = struct.pack("I", ~(1 << ECHO_REPLY) & 0xFFFFFFFF)
PAYLOAD = b"plexd-latency-probe"


class ProbeUnavailable(PlexdError, OSError):
    pass


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int) -> bytes:
    header = struct.pack("!BBHHH", ECHO_REQUEST, 0, 0, ident, seq)
    return struct.pack("!BBHHH", ECHO_REQUEST, 0, _checksum(header + PAYLOAD), ident, seq) + PAYLOAD


def _open() -> tuple[socket.socket, bool]:
    """(socket, raw): raw sockets see the IP header and every echo reply of the host."""
    for kind, raw in ((socket.SOCK_RAW, True), (socket.SOCK_DGRAM, False)):
        try:
            sock = socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP)
        except OSError:
            continue
        sock.setblocking(False)
        if raw:
            with contextlib.suppress(OSError):  # an emulated kernel (gVisor): the loop filters replies itself
                sock.setsockopt(SOL_RAW, ICMP_FILTER, ONLY_ECHO_REPLIES)
        return sock, raw
    raise ProbeUnavailable("no ICMP socket: needs CAP_NET_RAW or net.ipv4.ping_group_range")


def _reply(data: bytes, raw: bool) -> tuple[int, int] | None:
    """(identifier, sequence) of an echo reply, else None."""
    if raw:
        data = data[(data[0] & 0x0F) * 4:] if data else b""
    if len(data) < 8 or data[0] != ECHO_REPLY:
        return None
    _, _, _, ident, seq = struct.unpack("!BBHHH", data[:8])
    return ident, seq


async def round_trips(targets: dict[str, str], timeout: float) -> dict[str, int]:
    """Nanoseconds to each target (key → IPv4 address), -1 for those that did not answer in `timeout`."""
    results = {key: -1 for key in targets}
    # One sequence number each, and they are 16 bits (the config caps latency_peers at 65,535; more here would
    # have raised struct.error and ended every metrics collection)
    v4 = dict(itertools.islice(((key, ip) for key, ip in targets.items() if _is_v4(ip)), 0xFFFF))
    if not v4:
        return results
    sock, raw = _open()
    loop = asyncio.get_running_loop()
    ident = int.from_bytes(os.urandom(2), "big")
    sent: dict[int, tuple[str, str, int]] = {}
    try:
        for seq, (key, ip) in enumerate(v4.items()):
            try:
                sock.sendto(echo_request(ident, seq), (ip, 0))
            except OSError:
                continue  # no route, refused by a local firewall: -1
            sent[seq] = (key, ip, time.monotonic_ns())
        deadline = loop.time() + timeout
        while sent and (left := deadline - loop.time()) > 0:
            try:
                async with asyncio.timeout(left):  # not wait_for: on 3.11 it can swallow a stop
                    data, (source, _) = await loop.sock_recvfrom(sock, 2048)
            except TimeoutError:
                break
            received = time.monotonic_ns()
            answer = _reply(data, raw)
            if answer is None or (raw and answer[0] != ident) or sent.get(answer[1], ("", ""))[1] != source:
                continue  # someone else's ping (a raw socket sees them all)
            key, _, started = sent.pop(answer[1])
            results[key] = received - started
    finally:
        sock.close()
    return results


@bounded_by_mesh
@functools.lru_cache(maxsize=4096)  # the same few dozen mesh addresses at every collection
def _is_v4(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).version == 4
    except ValueError:
        return False
