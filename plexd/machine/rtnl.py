"""The mesh link's netlink, raw: reading links, addresses, routes and rules, and writing them, over rtnetlink,
without pyroute2 (whose import alone is ~11 MiB of the daemon's memory, and whose message objects were most of the
cost of each read and write).

pyroute2 0.9 decodes every route of a dump into a full message object: ~40 µs a route, so 40 ms for each dump
of a machine with 1,000 mesh routes, four dumps at every reconcile. What the mesh link needs of a route is four
numbers, its destination and its gateways; decoding just those from the raw dump takes ~1.5 ms for the same
1,000 routes. Opening a pyroute2 `IPRoute` alone costs ~1.5 ms (it starts an event loop of its own), which the
machine's addresses, read before every state pull, paid each time. Writes likewise: pyroute2 spent ~0.5 ms on
each route a joining peer brings; here a batch of writes is one send and its acknowledgements (~20 µs a route).
The kernel WireGuard device's generic netlink is packed and read the same way (plexd.machine.wireguard.genl), on this
module's plumbing; pyroute2 only creates that device.

    dump_routes(family, netns)   every route of one address family, all tables: [Route(table, dst, oif, ...)]
    dump_addresses(netns)        every address: [Address(index, family, prefixlen, scope, address)]
    dump_links(netns)            every link: [Link(index, name, kind, mtu, up)]
    dump_rules(family, netns)    every routing rule of one family: [Rule(table, priority, action)]
                                 (each dump's `netns` may be a socket `session(netns)` opened for several)
    write(messages, netns)       requests in order, in batches of one send each: the errno of each (0: done),
                                 made by route_write, link_set, link_delete, address_write, rule_write
    open_socket, session, dump_on, write_on, split_messages, attributes, attribute: the netlink plumbing, shared
                                 with the kernel WireGuard device's generic netlink (plexd.machine.wireguard.genl)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import ipaddress
import itertools
import os
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from plexd.base.errors import PlexdError

_NETLINK_ROUTE = 0
_CLONE_NEWNET = 0x40000000
_RTM_NEWLINK, _RTM_DELLINK, _RTM_GETLINK = 16, 17, 18
_RTM_NEWADDR, _RTM_DELADDR, _RTM_GETADDR = 20, 21, 22
_RTM_NEWROUTE, _RTM_DELROUTE, _RTM_GETROUTE = 24, 25, 26
_RTM_NEWRULE, _RTM_DELRULE, _RTM_GETRULE = 32, 33, 34
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP, _NLM_F_DUMP_INTR = 0x1, 0x4, 0x300, 0x10
_NLM_F_REPLACE, _NLM_F_EXCL, _NLM_F_CREATE = 0x100, 0x200, 0x400
_IFF_UP = 0x1
_IFA_F_NODAD = 0x02  # IPv6: no duplicate address detection (it would keep the address tentative for ~2 s)
_FR_ACT_TO_TBL = 1
_RTPROT_STATIC, _RTN_UNICAST, _RT_SCOPE_UNIVERSE, _RT_SCOPE_NOWHERE = 4, 1, 0, 255
_BATCH = 256  # route writes sent at once: their acknowledgements fit the socket's receive buffer
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_RTA_DST, _RTA_OIF, _RTA_GATEWAY, _RTA_MULTIPATH, _RTA_TABLE = 1, 4, 5, 9, 15
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_IFLA_IFNAME, _IFLA_MTU, _IFLA_LINKINFO, _IFLA_INFO_KIND = 3, 4, 18, 1
_FRA_PRIORITY, _FRA_TABLE = 6, 15
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_IFINFOMSG = struct.Struct("=BBHiII")  # family, pad, type, index, flags, change
_FIB_RULE_HDR = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, res1, res2, action, flags
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
class Link:
    index: int
    name: str
    kind: str  # IFLA_INFO_KIND: "wireguard", "veth", ... ("" for a TUN device without one)
    mtu: int
    up: bool


@dataclass(frozen=True)
class Rule:
    table: int
    priority: int
    action: int  # FR_ACT_*: 1 is "look up a table"


@dataclass(frozen=True)
class Message:
    """One write request: a message type, its flags besides REQUEST|ACK, and its body."""

    kind: int
    flags: int
    body: bytes


class RouteDumpError(PlexdError, OSError):
    pass


# Where a dump runs: a named network namespace, None for this one, or a socket `session` opened there.
Where = str | socket.socket | None
_SEQUENCE = itertools.count(1)


def write(messages: Sequence[Message], netns: str | None = None) -> list[int]:
    """Send `messages` in order, in batches of one send each (the kernel handles them one after the other); the
    errno of each (0: done), in the same order."""
    out: list[int] = []
    with open_socket(netns) as sock:
        sock.bind((0, 0))
        for start in range(0, len(messages), _BATCH):
            out += write_on(sock, messages[start:start + _BATCH])
    return out


def route_write(replace: bool, dst: str, oif: int, table: int) -> Message:
    """Put a route in place (`ip route replace`: protocol static, scope universe, unicast, as pyroute2 did) or
    delete it (any scope). `dst` is a network ("10.100.0.2/32"); ValueError when it is not one."""
    family, prefixlen, packed = _parsed_network(dst)
    body = _RTMSG.pack(family, prefixlen, 0, 0, table if table < 256 else 0,
                       _RTPROT_STATIC if replace else 0, _RT_SCOPE_UNIVERSE if replace else _RT_SCOPE_NOWHERE,
                       _RTN_UNICAST if replace else 0, 0)
    body += attribute(_RTA_TABLE, _U32.pack(table)) + attribute(_RTA_DST, packed)
    body += attribute(_RTA_OIF, _U32.pack(oif))
    return Message(_RTM_NEWROUTE, _NLM_F_CREATE | _NLM_F_REPLACE, body) if replace else Message(_RTM_DELROUTE, 0,
                                                                                                   body)


def link_set(index: int, *, mtu: int | None = None, up: bool = False) -> Message:
    body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, index, _IFF_UP if up else 0, _IFF_UP if up else 0)
    if mtu is not None:
        body += attribute(_IFLA_MTU, _U32.pack(mtu))
    return Message(_RTM_NEWLINK, 0, body)


def link_delete(index: int) -> Message:
    return Message(_RTM_DELLINK, 0, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, index, 0, 0))


def address_write(add: bool, index: int, cidr: str) -> Message:
    """Add (EEXIST when it is there) or delete an address, "10.100.0.1/16". ValueError when it is not one."""
    iface = ipaddress.ip_interface(cidr)
    flags = _IFA_F_NODAD if iface.version == 6 and add else 0
    body = _IFADDRMSG.pack(_family(iface.version), iface.network.prefixlen, flags, 0, index)
    body += attribute(_IFA_LOCAL, iface.ip.packed) + attribute(_IFA_ADDRESS, iface.ip.packed)
    return Message(_RTM_NEWADDR, _NLM_F_CREATE | _NLM_F_EXCL, body) if add else Message(_RTM_DELADDR, 0, body)


def rule_write(add: bool, version: int, table: int, priority: int) -> Message:
    """The rule "look up `table` at `priority`" of one address family: add (EEXIST when there) or delete."""
    body = _FIB_RULE_HDR.pack(_family(version), 0, 0, 0, table if table < 256 else 0, 0, 0, _FR_ACT_TO_TBL, 0)
    body += attribute(_FRA_TABLE, _U32.pack(table)) + attribute(_FRA_PRIORITY, _U32.pack(priority))
    return Message(_RTM_NEWRULE, _NLM_F_CREATE | _NLM_F_EXCL, body) if add else Message(_RTM_DELRULE, 0, body)


def _parsed_network(dst: str) -> tuple[int, int, bytes]:
    """"10.100.0.2/32" as (family, prefix length, network address packed), host bits cleared as
    `ip_network(strict=False)` does. ValueError when it is not a network. `inet_pton` rather than `ipaddress`: a
    full apply writes a route per peer, and parsing them was most of the cost (4.6 µs each here, now 1)."""
    address, slash, length = dst.partition("/")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        packed = socket.inet_pton(family, address)
    except (OSError, ValueError):  # ValueError: a NUL in the text
        raise ValueError(f"{dst!r} is not an IP network") from None
    bits = len(packed) * 8
    if not slash:
        return family, bits, packed
    if not (length.isascii() and length.isdigit()) or int(length) > bits:  # no sign, no spaces, no "¹"
        raise ValueError(f"{dst!r} is not an IP network: bad prefix length {length!r}")
    prefixlen = int(length)
    host = bits - prefixlen
    if host:
        packed = ((int.from_bytes(packed, "big") >> host) << host).to_bytes(len(packed), "big")
    return family, prefixlen, packed


def _family(version: int) -> int:
    return socket.AF_INET if version == 4 else socket.AF_INET6


def write_on(sock: socket.socket, messages: Sequence[Message]) -> list[int]:
    """`messages` in one write on a bound socket, then their acknowledgements: the errno of each (0: done)."""
    request = bytearray()
    for seq, m in enumerate(messages, 1):
        request += _HEADER.pack(_HEADER.size + len(m.body), m.kind, _NLM_F_REQUEST | _NLM_F_ACK | m.flags, seq, 0)
        request += m.body
    sock.sendall(request)
    results: dict[int, int] = {}
    while len(results) < len(messages):
        data = sock.recv(1 << 20)
        if not data:
            raise RouteDumpError("the writes ended without all their acknowledgements")
        for kind, _, body, seq in split_messages(data):
            if kind == _NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", body)
                results[seq] = -code
    return [results.get(seq, 0) for seq in range(1, len(messages) + 1)]


def attribute(kind: int, value: bytes) -> bytes:
    length = _ATTR.size + len(value)
    return _ATTR.pack(length, kind) + value + b"\0" * (-length % 4)


def dump_routes(family: int, netns: Where = None) -> list[Route]:
    """Every route of `family` (socket.AF_INET / AF_INET6) in every table, in `netns` (None: this one)."""
    return _dump(netns, _RTM_GETROUTE, _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0), _RTM_NEWROUTE, _route,
                 "routing table")


def dump_addresses(netns: Where = None) -> list[Address]:
    """Every address of every link, both families, in `netns` (None: this one)."""
    return [a for a in _dump(netns, _RTM_GETADDR, _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0), _RTM_NEWADDR,
                             _address, "address list") if a is not None]


def dump_links(netns: Where = None) -> list[Link]:
    """Every link, in `netns` (None: this one)."""
    return _dump(netns, _RTM_GETLINK, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0, 0), _RTM_NEWLINK, _link,
                 "link list")


def link_names(netns: Where = None) -> dict[int, str]:
    """Every link's name by its index."""
    return {link.index: link.name for link in dump_links(netns)}


def dump_rules(family: int, netns: Where = None) -> list[Rule]:
    """Every routing rule of `family`, in `netns` (None: this one)."""
    return _dump(netns, _RTM_GETRULE, _FIB_RULE_HDR.pack(family, 0, 0, 0, 0, 0, 0, 0, 0), _RTM_NEWRULE, _rule,
                 "rule list")


def _dump(where: Where, request_type: int, request: bytes, reply_type: int,
          decode: Callable[[memoryview], T], what: str) -> list[T]:
    if isinstance(where, socket.socket):
        return dump_on(where, request_type, request, reply_type, decode, what)
    with session(where) as sock:
        return dump_on(sock, request_type, request, reply_type, decode, what)


@contextlib.contextmanager
def session(netns: str | None, protocol: int = _NETLINK_ROUTE) -> Iterator[socket.socket]:
    """One bound netlink socket in `netns` for several dumps: each socket opened in a named namespace costs a
    pair of namespace switches, and a mesh link's read is seven dumps."""
    with open_socket(netns, protocol) as sock:
        sock.bind((0, 0))
        yield sock


def dump_on(sock: socket.socket, request_type: int, request: bytes, reply_type: int,
            decode: Callable[[memoryview], T], what: str) -> list[T]:
    """The decoded `reply_type` messages of one dump on a bound socket, read again (at most three times) while the
    kernel marks it interrupted (what it lists changed under it): RouteDumpError, with the kernel's errno when it
    refused the dump or failed part-way."""
    for _ in range(_ATTEMPTS):
        items, interrupted = _dump_once(sock, request_type, request, reply_type, decode)
        if not interrupted:
            return items
    raise RouteDumpError(errno.EINTR, f"the {what} kept changing during {_ATTEMPTS} dumps")


def open_socket(netns: str | None, protocol: int = _NETLINK_ROUTE) -> socket.socket:
    """A netlink socket of `protocol` (rtnetlink; generic netlink for plexd.machine.wireguard.genl) in `netns`."""
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
    # A named namespace (tests, benches): this thread enters it for the socket's creation only (the socket stays
    # there), by descriptors of its own, so threads doing the same at once never restore each other's namespace.
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        there = os.open(f"/run/netns/{netns}", os.O_RDONLY)  # never created here: a wrong name is an error
        try:
            _setns(there)
            try:
                return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
            finally:
                _setns(here)
        finally:
            os.close(there)
    finally:
        os.close(here)


def _setns(fd: int) -> None:
    """Move this thread into the network namespace open at `fd` (os.setns from Python 3.12 on)."""
    if hasattr(os, "setns"):
        os.setns(fd, _CLONE_NEWNET)
        return
    if _libc().setns(fd, _CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _dump_once(sock: socket.socket, request_type: int, request: bytes, reply_type: int,
               decode: Callable[[memoryview], T]) -> tuple[list[T], bool]:
    seq = next(_SEQUENCE)  # a dump left half-read on this socket (a decode that raised) is not read as this one
    sock.send(_HEADER.pack(_HEADER.size + len(request), request_type, _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0)
              + request)
    items: list[T] = []
    interrupted = False
    while True:
        data = sock.recv(1 << 20)
        if not data:
            raise RouteDumpError(errno.EPROTO, "the dump ended without its last message")
        for kind, flags, body, got in split_messages(data):
            if got != seq:
                continue
            if kind == _NLMSG_DONE:
                if len(body) >= 4 and (code := struct.unpack_from("=i", body)[0]) < 0:  # failed part-way
                    raise RouteDumpError(-code, os.strerror(-code))
                return items, interrupted
            if kind == _NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", body)
                raise RouteDumpError(-code, os.strerror(-code))
            interrupted |= bool(flags & _NLM_F_DUMP_INTR)
            if kind == reply_type:
                items.append(decode(body))


def split_messages(data: bytes) -> Iterator[tuple[int, int, memoryview, int]]:
    """(type, flags, body, sequence number) of each netlink message in one datagram."""
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
    for attr, value in attributes(body[_RTMSG.size:]):
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
    for attr, value in attributes(body[_IFADDRMSG.size:]):
        if attr == _IFA_ADDRESS and family in (socket.AF_INET, socket.AF_INET6):
            return Address(index, family, prefixlen, scope, socket.inet_ntop(family, value))
    return None  # no address attribute: nothing to protect


def _link(body: memoryview) -> Link:
    _, _, _, index, flags, _ = _IFINFOMSG.unpack_from(body)
    name, kind, mtu = "", "", 0
    for attr, value in attributes(body[_IFINFOMSG.size:]):
        if attr == _IFLA_IFNAME:
            name = _string(value)
        elif attr == _IFLA_MTU and len(value) == 4:
            (mtu,) = _U32.unpack(value)
        elif attr == _IFLA_LINKINFO:
            kind = next((_string(v) for a, v in attributes(value) if a == _IFLA_INFO_KIND), "")
    return Link(index, name, kind, mtu, bool(flags & _IFF_UP))


def _rule(body: memoryview) -> Rule:
    _, _, _, _, table, _, _, action, _ = _FIB_RULE_HDR.unpack_from(body)
    priority = 0
    for attr, value in attributes(body[_FIB_RULE_HDR.size:]):
        if attr == _FRA_TABLE and len(value) == 4:
            (table,) = _U32.unpack(value)  # tables past 255 are only here
        elif attr == _FRA_PRIORITY and len(value) == 4:
            (priority,) = _U32.unpack(value)
    return Rule(table, priority, action)


def _string(value: memoryview) -> str:
    return bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")


def attributes(data: memoryview) -> Iterator[tuple[int, memoryview]]:
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
                     for attr, value in attributes(data[at + _NEXTHOP.size:at + length]) if attr == _RTA_GATEWAY]
        at += (length + 3) & ~3
    return gateways


def _network(family: int, dst: bytes | None, length: int) -> str:
    if family == socket.AF_INET:
        return f"{socket.inet_ntop(socket.AF_INET, dst) if dst else '0.0.0.0'}/{length}"
    address = ipaddress.IPv6Address(dst) if dst else ipaddress.IPv6Address(0)  # the text ipaddress writes
    return f"{address}/{length}"
