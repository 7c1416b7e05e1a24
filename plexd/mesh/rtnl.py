"""Reading the routing tables, addresses and link names, and writing routes, over rtnetlink, without pyroute2's
message objects.

pyroute2 0.9 decodes every route of a dump into a full message object: ~40 µs a route, so 40 ms for each dump
of a machine with 1,000 mesh routes, four dumps at every reconcile. What the mesh link needs of a route is four
numbers, its destination and its gateways; decoding just those from the raw dump takes ~1.5 ms for the same
1,000 routes. Opening a pyroute2 `IPRoute` alone costs ~1.5 ms (it starts an event loop of its own), which the
machine's addresses, read before every state pull, paid each time. Route writes likewise: pyroute2 spent ~0.5 ms
on each route a joining peer brings; here a batch of them is one send and its acknowledgements (~20 µs a route).
Links, addresses and rules are still written with pyroute2 (plexd.mesh.links): a few at start-up.

    dump_routes(family, netns)   every route of one address family, all tables: [Route(table, dst, oif, ...)]
    dump_addresses(netns)        every address: [Address(index, family, prefixlen, scope, address)]
    dump_links(netns)            every link's name by index
    write_routes(writes, netns)  replace or delete routes in one batch: the errno of each (0: done)
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pyroute2.netns import setns

_NETLINK_ROUTE = 0
_RTM_NEWLINK, _RTM_GETLINK = 16, 18
_RTM_NEWADDR, _RTM_GETADDR = 20, 22
_RTM_NEWROUTE, _RTM_DELROUTE, _RTM_GETROUTE = 24, 25, 26
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP, _NLM_F_DUMP_INTR = 0x1, 0x4, 0x300, 0x10
_NLM_F_REPLACE, _NLM_F_CREATE = 0x100, 0x400
_RTPROT_STATIC, _RTN_UNICAST, _RT_SCOPE_UNIVERSE, _RT_SCOPE_NOWHERE = 4, 1, 0, 255
_BATCH = 256  # route writes sent at once: their acknowledgements fit the socket's receive buffer
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_RTA_DST, _RTA_OIF, _RTA_GATEWAY, _RTA_MULTIPATH, _RTA_TABLE = 1, 4, 5, 9, 15
_IFA_ADDRESS = 1
_IFLA_IFNAME = 3
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_IFINFOMSG = struct.Struct("=BBHiII")  # family, pad, type, index, flags, change
_ATTR = struct.Struct("=HH")
_NEXTHOP = struct.Struct("=HBBi")  # rtnexthop: length, flags, hops, ifindex; its own attributes follow
_U32 = struct.Struct("=I")
_ATTEMPTS = 3  # a dump the kernel marks interrupted (the table changed under it) is read again
T = TypeVar("T")


@dataclass(frozen=True)
class Route:
    table: int
    dst: str  # the destination network, "10.100.0.2/32"
    oif: int | None
    protocol: int  # RTPROT_*: 2 is the kernel's own
    type: int  # RTN_*: 1 is unicast
    gateways: tuple[str, ...] = ()  # the route's gateway, or each of its multipath hops'

    @property
    def default(self) -> bool:
        return self.dst.endswith("/0")


@dataclass(frozen=True)
class Address:
    index: int  # the link's
    family: int
    prefixlen: int
    scope: int  # RT_SCOPE_*: 253 is link-local
    address: str  # IFA_ADDRESS (for a point-to-point IPv4 link, the peer's end, as pyroute2 shows it)


@dataclass(frozen=True)
class RouteWrite:
    """One route to put in place (`replace`, what `ip route replace` does) or to delete (any scope)."""

    replace: bool
    dst: str  # "10.100.0.2/32"
    oif: int
    table: int


class RouteDumpError(OSError):
    pass


def write_routes(writes: Sequence[RouteWrite], netns: str | None = None) -> list[int]:
    """Apply `writes` in order, in batches of one send each; the errno of each (0: done), in the same order.
    Routes go in as pyroute2 put them: protocol static, scope universe, unicast."""
    out: list[int] = []
    with _open(netns) as sock:
        sock.bind((0, 0))
        for start in range(0, len(writes), _BATCH):
            out += _write_batch(sock, writes[start:start + _BATCH])
    return out


def _write_batch(sock: socket.socket, writes: Sequence[RouteWrite]) -> list[int]:
    request = bytearray()
    for seq, w in enumerate(writes, 1):
        network = ipaddress.ip_network(w.dst, strict=False)
        family = socket.AF_INET if network.version == 4 else socket.AF_INET6
        body = _RTMSG.pack(family, network.prefixlen, 0, 0, w.table if w.table < 256 else 0,
                           _RTPROT_STATIC if w.replace else 0,
                           _RT_SCOPE_UNIVERSE if w.replace else _RT_SCOPE_NOWHERE,
                           _RTN_UNICAST if w.replace else 0, 0)
        body += _attr(_RTA_TABLE, _U32.pack(w.table)) + _attr(_RTA_DST, network.network_address.packed)
        body += _attr(_RTA_OIF, _U32.pack(w.oif))
        kind, flags = ((_RTM_NEWROUTE, _NLM_F_CREATE | _NLM_F_REPLACE) if w.replace else (_RTM_DELROUTE, 0))
        request += _HEADER.pack(_HEADER.size + len(body), kind, _NLM_F_REQUEST | _NLM_F_ACK | flags, seq, 0) + body
    sock.sendall(request)
    results: dict[int, int] = {}
    while len(results) < len(writes):
        data = sock.recv(1 << 20)
        if not data:
            raise RouteDumpError("the route writes ended without all their acknowledgements")
        for kind, _, body, seq in _messages_with_seq(data):
            if kind == _NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", body)
                results[seq] = -code
    return [results.get(seq, 0) for seq in range(1, len(writes) + 1)]


def _attr(kind: int, value: bytes) -> bytes:
    length = _ATTR.size + len(value)
    return _ATTR.pack(length, kind) + value + b"\0" * (-length % 4)


def dump_routes(family: int, netns: str | None = None) -> list[Route]:
    """Every route of `family` (socket.AF_INET / AF_INET6) in every table, in `netns` (None: this one)."""
    return _dump(netns, _RTM_GETROUTE, _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0), _RTM_NEWROUTE, _route,
                 "routing table")


def dump_addresses(netns: str | None = None) -> list[Address]:
    """Every address of every link, both families, in `netns` (None: this one)."""
    return [a for a in _dump(netns, _RTM_GETADDR, _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0), _RTM_NEWADDR,
                             _address, "address list") if a is not None]


def dump_links(netns: str | None = None) -> dict[int, str]:
    """Every link's name by its index, in `netns` (None: this one)."""
    return dict(_dump(netns, _RTM_GETLINK, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0, 0), _RTM_NEWLINK, _link,
                      "link list"))


def _dump(netns: str | None, request_type: int, request: bytes, reply_type: int,
          decode: Callable[[memoryview], T], what: str) -> list[T]:
    for _ in range(_ATTEMPTS):
        items, interrupted = _dump_once(netns, request_type, request, reply_type, decode)
        if not interrupted:
            return items
    raise RouteDumpError(f"the {what} kept changing during {_ATTEMPTS} dumps")


def _open(netns: str | None) -> socket.socket:
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_ROUTE)
    # A named namespace (tests, benches): this thread enters it for the socket's creation only (the socket stays
    # there), by descriptors of its own, so threads doing the same at once never restore each other's namespace.
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        there = os.open(f"/run/netns/{netns}", os.O_RDONLY)  # never created here: a wrong name is an error
        try:
            setns(there)
            try:
                return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_ROUTE)
            finally:
                setns(here)
        finally:
            os.close(there)
    finally:
        os.close(here)


def _dump_once(netns: str | None, request_type: int, request: bytes, reply_type: int,
               decode: Callable[[memoryview], T]) -> tuple[list[T], bool]:
    with _open(netns) as sock:
        sock.bind((0, 0))
        sock.send(_HEADER.pack(_HEADER.size + len(request), request_type, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
                  + request)
        items: list[T] = []
        interrupted = False
        while True:
            data = sock.recv(1 << 20)
            if not data:
                raise RouteDumpError("the dump ended without its last message")
            for kind, flags, body in _messages(data):
                if kind == _NLMSG_DONE:
                    return items, interrupted
                if kind == _NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", body)
                    raise RouteDumpError(-code, f"dump refused: {os.strerror(-code)}")
                interrupted |= bool(flags & _NLM_F_DUMP_INTR)
                if kind == reply_type:
                    items.append(decode(body))


def _messages(data: bytes) -> Iterator[tuple[int, int, memoryview]]:
    for kind, flags, body, _ in _messages_with_seq(data):
        yield kind, flags, body


def _messages_with_seq(data: bytes) -> Iterator[tuple[int, int, memoryview, int]]:
    view = memoryview(data)
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, flags, seq, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise RouteDumpError(f"malformed netlink message (length {length} at {offset} of {len(data)})")
        yield kind, flags, view[offset + _HEADER.size:offset + length], seq
        offset += (length + 3) & ~3


def _route(body: memoryview) -> Route:
    family, dst_len, _, _, table, protocol, _, kind, _ = _RTMSG.unpack_from(body)
    dst: bytes | None = None
    oif = None
    gateways: list[str] = []
    for attr, value in _attributes(body[_RTMSG.size:]):
        if attr == _RTA_DST:
            dst = bytes(value)
        elif attr == _RTA_OIF and len(value) == 4:
            (oif,) = _U32.unpack(value)
        elif attr == _RTA_TABLE and len(value) == 4:
            (table,) = _U32.unpack(value)  # tables past 255 are only here
        elif attr == _RTA_GATEWAY:
            gateways.append(socket.inet_ntop(family, value))
        elif attr == _RTA_MULTIPATH:
            gateways += _hop_gateways(family, value)
    return Route(table, _network(family, dst, dst_len), oif, protocol, kind, tuple(gateways))


def _address(body: memoryview) -> Address | None:
    family, prefixlen, _, scope, index = _IFADDRMSG.unpack_from(body)
    for attr, value in _attributes(body[_IFADDRMSG.size:]):
        if attr == _IFA_ADDRESS and family in (socket.AF_INET, socket.AF_INET6):
            return Address(index, family, prefixlen, scope, socket.inet_ntop(family, value))
    return None  # no address attribute: nothing to protect


def _link(body: memoryview) -> tuple[int, str]:
    _, _, _, index, _, _ = _IFINFOMSG.unpack_from(body)
    for attr, value in _attributes(body[_IFINFOMSG.size:]):
        if attr == _IFLA_IFNAME:
            return index, bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")
    return index, ""


def _attributes(data: memoryview) -> Iterator[tuple[int, memoryview]]:
    """The (type, value) of each netlink attribute in `data`, up to the first malformed one."""
    at = 0
    while at + _ATTR.size <= len(data):
        length, attr = _ATTR.unpack_from(data, at)
        if length < _ATTR.size:
            return
        yield attr, data[at + _ATTR.size:at + length]
        at += (length + 3) & ~3


def _hop_gateways(family: int, data: memoryview) -> list[str]:
    gateways = []
    at = 0
    while at + _NEXTHOP.size <= len(data):
        (length, _, _, _) = _NEXTHOP.unpack_from(data, at)
        if length < _NEXTHOP.size:
            break
        gateways += [socket.inet_ntop(family, value)
                     for attr, value in _attributes(data[at + _NEXTHOP.size:at + length]) if attr == _RTA_GATEWAY]
        at += (length + 3) & ~3
    return gateways


def _network(family: int, dst: bytes | None, length: int) -> str:
    if family == socket.AF_INET:
        return f"{socket.inet_ntop(socket.AF_INET, dst) if dst else '0.0.0.0'}/{length}"
    address = ipaddress.IPv6Address(dst) if dst else ipaddress.IPv6Address(0)  # the text ipaddress writes
    return f"{address}/{length}"
