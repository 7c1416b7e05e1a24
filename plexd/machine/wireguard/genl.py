"""The kernel WireGuard device's generic netlink, raw: SET_DEVICE requests packed and GET_DEVICE dumps read with
`struct`, on a netlink socket of our own (plexd.machine.rtnl's plumbing).

pyroute2 builds and decodes every attribute as a message object. At 1,000 peers that cost ~240 ms to encode a
full apply and ~240 ms to decode the dump on the host; on the kernel tier's emulated CPU, a full apply took 7x and
a 1 % change 6x what `wg syncconf` took on the same kernel device (`python -m bench kernel`). A peer is a handful
of fixed-size attributes, so packing and reading them directly costs a few milliseconds for the same peers.
pyroute2 still creates the device (plexd.machine.wireguard.kernel). tests/unit/test_kernel_messages.py holds this
codec to pyroute2's: what one writes, the other reads.

    family_id(sock)                       the `wireguard` family's id (WireGuardError: no module)
    set_requests(interface, update)       SET_DEVICE bodies, the first carrying the device's fields
    iter_set_requests(interface, update)  the same, packed one by one
    get_request(interface)                the GET_DEVICE dump request's body
    request(sock, family, bodies)         the SET_DEVICE messages sent and acknowledged, packing overlapped
    parse_device(bodies)                  the dump's messages merged into one DeviceConfig
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import ipaddress
import os
import queue
import socket
import struct
import threading
from collections.abc import Iterable, Iterator

from plexd.machine.rtnl import Message, attribute, attributes, dump_on, split_messages, write_on
from plexd.machine.wireguard import DeviceConfig, DeviceUpdate, PeerConfig, PeerUpdate, WireGuardError
from plexd.machine.wireguard.kernel_probe import getfamily_request

NETLINK_GENERIC = 16
PEERS_PER_MESSAGE = 64  # peers in one SET_DEVICE at most (as `wg` does) ...
_PEERS_BYTES = 60_000  # ... and bytes: a netlink attribute's length is 16 bits (peers with many allowed IPs)

# include/uapi/linux/wireguard.h
CMD_GET_DEVICE, CMD_SET_DEVICE, GENL_VERSION = 0, 1, 1
DEVICE_IFNAME, DEVICE_PRIVATE_KEY, DEVICE_FLAGS, DEVICE_LISTEN_PORT, DEVICE_FWMARK, DEVICE_PEERS = 2, 3, 5, 6, 7, 8
DEVICE_F_REPLACE_PEERS = 1
(PEER_PUBLIC_KEY, PEER_PRESHARED_KEY, PEER_FLAGS, PEER_ENDPOINT, PEER_KEEPALIVE, PEER_LAST_HANDSHAKE, PEER_RX,
 PEER_TX, PEER_ALLOWEDIPS) = range(1, 10)
PEER_F_REMOVE_ME, PEER_F_REPLACE_ALLOWEDIPS, PEER_F_UPDATE_ONLY = 1, 2, 4
ALLOWEDIP_FAMILY, ALLOWEDIP_IPADDR, ALLOWEDIP_CIDR_MASK = 1, 2, 3

_NLA_F_NESTED = 0x8000
_NLA_TYPE_MASK = 0x3FFF
_CTRL_ATTR_FAMILY_ID = 1
_NLMSG_ERROR = 2
_GENL = struct.Struct("=BBH")  # genlmsghdr: cmd, version, reserved
_U16, _U32, _U64, _I32 = struct.Struct("=H"), struct.Struct("=I"), struct.Struct("=Q"), struct.Struct("=i")
_PORT = struct.Struct("!H")  # a sockaddr's port: network byte order
_TIMESPEC = struct.Struct("=qq")
_ZERO = bytes(32)
_MALFORMED = (struct.error, IndexError, ValueError)
_SOL_NETLINK, _NETLINK_CAP_ACK = 270, 10
_WRITE_BYTES = 1 << 17  # one write at most (netlink refuses one past the socket's send buffer, 208 KiB by default)


def _nest(kind: int, inner: bytes) -> bytes:
    return attribute(kind | _NLA_F_NESTED, inner)


def _key(text: str, what: str) -> bytes:
    try:  # strict: what base64.b64decode(validate=True) refuses, without its per-call overhead
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError, TypeError):
        raw = b""
    if len(raw) != 32:
        raise WireGuardError(f"{what} is not a base64 WireGuard key")
    return raw


# A full apply packs every peer, so the common attributes are packed whole, header and padding included, by one
# precompiled Struct each rather than attribute by attribute (on the kernel tier's emulated CPU the encoding was
# a quarter of what `wg syncconf` takes in all).
_KEY_ATTR = struct.Struct("=HH32s")  # public or preshared key
_U32_ATTR = struct.Struct("=HHI")  # flags, fwmark
_U16_ATTR = struct.Struct("=HHH2x")  # keepalive, listen port
_SOCKADDR_IN = struct.Struct("=HHH2s4s8x")  # attribute header, family, port (network order), address, zero
_ALLOWED_V4 = struct.Struct("=HH" "HHH2x" "HH4s" "HHB3x")  # the nest, family, address, prefix length
_ALLOWED_V6 = struct.Struct("=HH" "HHH2x" "HH16s" "HHB3x")
_NEST_HEADER = struct.Struct("=HH")


def _sockaddr(endpoint: str) -> bytes:
    """The PEER_ENDPOINT attribute (header and sockaddr) of "192.0.2.1:51820" or "[fe80::1%eth0]:51820"."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        port_number = int(port)
        if not 0 < port_number < 65536:
            raise ValueError(port)
        if ":" not in host:  # inet_pton, not ipaddress: a thousand peers are packed on every full apply
            return _SOCKADDR_IN.pack(_SOCKADDR_IN.size, PEER_ENDPOINT, socket.AF_INET, port_number.to_bytes(2, "big"),
                                     socket.inet_pton(socket.AF_INET, host))
        address = ipaddress.IPv6Address(host)
    except (ValueError, OSError):
        raise WireGuardError(f"endpoint {endpoint!r} is not an IP address and port") from None
    try:
        scope = 0 if not address.scope_id else (int(address.scope_id) if address.scope_id.isdigit()
                                                 else socket.if_nametoindex(address.scope_id))
    except OSError:
        raise WireGuardError(f"endpoint {endpoint!r}: no interface {address.scope_id!r} here") from None
    return attribute(PEER_ENDPOINT, _U16.pack(socket.AF_INET6) + _PORT.pack(port_number) + bytes(4)
                     + address.packed + _U32.pack(scope))


def _network(cidr: str) -> tuple[int, bytes, int]:
    """(family, the network's address with the host bits cleared, prefix length) of "10.1.2.0/24"."""
    address, _, length = cidr.partition("/")
    family, bits = (socket.AF_INET6, 128) if ":" in address else (socket.AF_INET, 32)
    try:
        prefix = int(length) if length else bits
        packed = socket.inet_pton(family, address)
    except (ValueError, OSError):
        raise WireGuardError(f"allowed IP {cidr!r} is not an IP network") from None
    if not 0 <= prefix <= bits:
        raise WireGuardError(f"allowed IP {cidr!r} has a prefix length past {bits}")
    if prefix < bits:
        masked = int.from_bytes(packed, "big") & (((1 << bits) - 1) ^ ((1 << (bits - prefix)) - 1))
        packed = masked.to_bytes(bits // 8, "big")
    return family, packed, prefix


def _allowed_ip(cidr: str) -> bytes:
    family, packed, prefix = _network(cidr)
    shape = _ALLOWED_V4 if family == socket.AF_INET else _ALLOWED_V6
    return shape.pack(shape.size, _NLA_F_NESTED, 6, ALLOWEDIP_FAMILY, family, 4 + len(packed), ALLOWEDIP_IPADDR,
                      packed, 5, ALLOWEDIP_CIDR_MASK, prefix)


def _peer(p: PeerUpdate) -> bytes:
    out = _KEY_ATTR.pack(_KEY_ATTR.size, PEER_PUBLIC_KEY, _key(p.public_key, "a peer's public key"))
    if p.remove:
        out += _U32_ATTR.pack(_U32_ATTR.size, PEER_FLAGS, PEER_F_REMOVE_ME)
        return _NEST_HEADER.pack(_NEST_HEADER.size + len(out), _NLA_F_NESTED) + out
    flags = (PEER_F_UPDATE_ONLY if p.update_only else 0) | (
        PEER_F_REPLACE_ALLOWEDIPS if p.allowed_ips is not None else 0)
    parts = [out, _U32_ATTR.pack(_U32_ATTR.size, PEER_FLAGS, flags)]
    if p.psk is not None:  # "" clears it: the zero key
        parts.append(_KEY_ATTR.pack(_KEY_ATTR.size, PEER_PRESHARED_KEY,
                                    _key(p.psk, "a preshared key") if p.psk else _ZERO))
    if p.endpoint:
        parts.append(_sockaddr(p.endpoint))
    if p.persistent_keepalive is not None:
        parts.append(_U16_ATTR.pack(6, PEER_KEEPALIVE, p.persistent_keepalive))
    if p.allowed_ips is not None:
        ips = b"".join([_allowed_ip(ip) for ip in sorted(p.allowed_ips)]) if len(p.allowed_ips) != 1 \
            else _allowed_ip(next(iter(p.allowed_ips)))
        parts.append(_NEST_HEADER.pack(_NEST_HEADER.size + len(ips), PEER_ALLOWEDIPS | _NLA_F_NESTED))
        parts.append(ips)
    body = b"".join(parts)
    return _NEST_HEADER.pack(_NEST_HEADER.size + len(body), _NLA_F_NESTED) + body


def _ifname(interface: str) -> bytes:
    return attribute(DEVICE_IFNAME, interface.encode() + b"\0")


def set_requests(interface: str, update: DeviceUpdate, peers_per_message: int = PEERS_PER_MESSAGE) -> list[bytes]:
    """The SET_DEVICE bodies (generic-netlink header and attributes) of one update, applied in order: none for an
    empty update; the device's fields (and the replace-peers flag) in the first only."""
    return list(iter_set_requests(interface, update, peers_per_message))


def iter_set_requests(interface: str, update: DeviceUpdate,
                      peers_per_message: int = PEERS_PER_MESSAGE) -> Iterator[bytes]:
    """`set_requests`, packed one message at a time, so the first can be sent while the rest are packed."""
    if update.is_empty():
        return
    head = _GENL.pack(CMD_SET_DEVICE, GENL_VERSION, 0) + _ifname(interface)
    first = head
    if update.private_key is not None:
        first += attribute(DEVICE_PRIVATE_KEY, _key(update.private_key, "the private key") if update.private_key
                           else _ZERO)
    if update.listen_port is not None:
        first += attribute(DEVICE_LISTEN_PORT, _U16.pack(update.listen_port))
    if update.fwmark is not None:
        first += attribute(DEVICE_FWMARK, _U32.pack(update.fwmark))
    if update.replace_peers:
        first += attribute(DEVICE_FLAGS, _U32.pack(DEVICE_F_REPLACE_PEERS))
    chunk: list[bytes] = []
    size = 0
    for p in update.peers:
        packed = _peer(p)  # a peer's 1,024 allowed IPs at most are ~29 KiB: one always fits
        if chunk and (len(chunk) == peers_per_message or size + len(packed) > _PEERS_BYTES):
            yield first + _nest(DEVICE_PEERS, b"".join(chunk))
            first, chunk, size = head, [], 0
        chunk.append(packed)
        size += len(packed)
    yield first + _nest(DEVICE_PEERS, b"".join(chunk)) if chunk else first


def get_request(interface: str) -> bytes:
    return _GENL.pack(CMD_GET_DEVICE, GENL_VERSION, 0) + _ifname(interface)


def _text_key(raw: memoryview) -> str:
    raw = bytes(raw)
    return "" if raw == _ZERO else base64.b64encode(raw).decode()


def _endpoint(raw: memoryview) -> str:
    if len(raw) < 4:
        return ""
    (family,), (port,) = _U16.unpack_from(raw), _PORT.unpack_from(raw, 2)
    if not port:
        return ""
    if family == socket.AF_INET and len(raw) >= 8:
        return f"{socket.inet_ntop(socket.AF_INET, raw[4:8])}:{port}"
    if family == socket.AF_INET6 and len(raw) >= 24:
        address = socket.inet_ntop(socket.AF_INET6, raw[8:24])
        (scope,) = _U32.unpack_from(raw, 24) if len(raw) >= 28 else (0,)
        if scope:  # as the desired model writes it: the interface's name, "[fe80::1%eth0]:51820"
            try:
                address += "%" + socket.if_indextoname(scope)
            except OSError:
                address += f"%{scope}"
        return f"[{address}]:{port}"
    return ""


def _allowed_ips(raw: memoryview) -> Iterable[str]:
    for _, item in attributes(raw):
        family, address, mask = 0, b"", 0
        for kind, value in attributes(item):
            kind &= _NLA_TYPE_MASK
            if kind == ALLOWEDIP_FAMILY:
                (family,) = _U16.unpack_from(value)
            elif kind == ALLOWEDIP_IPADDR:
                address = bytes(value)
            elif kind == ALLOWEDIP_CIDR_MASK:
                mask = value[0]
        if family == socket.AF_INET and len(address) == 4 and mask <= 32:
            # the text the desired model holds (ipaddress's), made without ipaddress for the common case
            masked = int.from_bytes(address, "big") & ((0xFFFFFFFF << (32 - mask)) & 0xFFFFFFFF)
            yield f"{socket.inet_ntop(socket.AF_INET, masked.to_bytes(4, 'big'))}/{mask}"
        elif family == socket.AF_INET6 and len(address) == 16 and mask <= 128:
            yield str(ipaddress.ip_network((address, mask), strict=False))


def parse_device(bodies: Iterable[bytes | memoryview]) -> DeviceConfig:
    """The dump's messages (bodies: generic-netlink header and attributes) merged into one device. The kernel
    splits a large device over several messages: the device's fields come in the first, and a peer whose allowed
    IPs do not fit continues in the next message under the same public key."""
    private_key, listen_port, fwmark = "", 0, 0
    peers: dict[str, dict] = {}
    for body in bodies:
        for kind, value in attributes(memoryview(body)[_GENL.size:]):
            kind &= _NLA_TYPE_MASK
            try:
                if kind == DEVICE_PRIVATE_KEY:
                    private_key = _text_key(value)
                elif kind == DEVICE_LISTEN_PORT:
                    (listen_port,) = _U16.unpack_from(value)
                elif kind == DEVICE_FWMARK:
                    (fwmark,) = _U32.unpack_from(value)
                elif kind == DEVICE_PEERS:
                    for _, peer in attributes(value):
                        with contextlib.suppress(*_MALFORMED):  # one peer's bad field costs that peer's rest only
                            _merge_peer(peers, peer)
            except _MALFORMED:
                continue  # a field too short for its type: the kernel sends none; what can be read is kept
    return DeviceConfig(
        private_key=private_key, listen_port=listen_port, fwmark=fwmark,
        peers={k: PeerConfig(public_key=k, endpoint=v["endpoint"], allowed_ips=frozenset(v["allowed"]), psk=v["psk"],
                             persistent_keepalive=v["keepalive"], last_handshake=v["hs"], rx=v["rx"], tx=v["tx"])
               for k, v in peers.items()},
    )


def _merge_peer(peers: dict[str, dict], raw: memoryview) -> None:
    fields = {kind & _NLA_TYPE_MASK: value for kind, value in attributes(raw)}
    key_raw = fields.get(PEER_PUBLIC_KEY)
    if key_raw is None or len(key_raw) != 32:
        return
    cur = peers.setdefault(base64.b64encode(bytes(key_raw)).decode(), {
        "endpoint": "", "allowed": set(), "psk": "", "keepalive": 0, "hs": 0.0, "rx": 0, "tx": 0})
    if (psk := fields.get(PEER_PRESHARED_KEY)) is not None:
        cur["psk"] = _text_key(psk)
    if (endpoint := fields.get(PEER_ENDPOINT)) is not None:
        cur["endpoint"] = _endpoint(endpoint)
    if (keepalive := fields.get(PEER_KEEPALIVE)) is not None:
        (cur["keepalive"],) = _U16.unpack_from(keepalive)
    if (handshake := fields.get(PEER_LAST_HANDSHAKE)) is not None and len(handshake) >= _TIMESPEC.size:
        seconds, nanoseconds = _TIMESPEC.unpack_from(handshake)
        cur["hs"] = seconds + nanoseconds / 1e9
    for name, kind in (("rx", PEER_RX), ("tx", PEER_TX)):
        if (count := fields.get(kind)) is not None:
            (cur[name],) = _U64.unpack_from(count)
    if (allowed := fields.get(PEER_ALLOWEDIPS)) is not None:
        cur["allowed"].update(_allowed_ips(allowed))


# -- the socket's exchanges ---------------------------------------------------------------------------------------


def _code(body: memoryview) -> int:
    """The (negative) errno an NLMSG_ERROR or NLMSG_DONE carries; -EPROTO when the body is too short for one."""
    return _I32.unpack_from(body)[0] if len(body) >= _I32.size else -errno.EPROTO


def family_id(sock: socket.socket) -> int:
    """The `wireguard` family's id; asking for it by name also loads the module (`kernel_probe`)."""
    sock.sendall(getfamily_request("wireguard"))
    for kind, _, body, _ in split_messages(sock.recv(65536)):
        if kind == _NLMSG_ERROR:
            code = _code(body)
            if -code == errno.ENOENT:
                raise WireGuardError("the kernel has no WireGuard generic-netlink family (module not loaded)")
            raise OSError(-code, os.strerror(-code))
        for attr, value in attributes(body[_GENL.size:]):
            if attr & _NLA_TYPE_MASK == _CTRL_ATTR_FAMILY_ID and len(value) >= _U16.size:
                return _U16.unpack_from(value)[0]
    raise WireGuardError("the generic-netlink controller named no id for the wireguard family")


def request(sock: socket.socket, family: int, bodies: Iterable[bytes]) -> None:
    """The SET_DEVICE messages, each acknowledged, in order: OSError with the kernel's errno for the first one
    refused, and nothing sent after it. While the kernel applies one write (in the sending thread's system call)
    the next messages are packed: `bodies` is read in the calling thread, and a second thread sends what has been
    packed so far in one write. On the kernel tier's emulated CPU packing 1,000 peers took a tenth of the time the
    kernel took to apply them; one write and one acknowledgement per message cost another tenth.

    A message `bodies` fails to pack (a WireGuardError) ends the update there: what was packed before it is sent.
    """
    sock.setsockopt(_SOL_NETLINK, _NETLINK_CAP_ACK, 1)  # a refusal's ack does not echo the request back
    packed = iter(bodies)
    first = next(packed, None)
    if first is None:
        return
    second = next(packed, None)
    if second is None:  # one message (an event's delta): no second thread for it
        _write(sock, family, [first])
        return
    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    refused: list[Exception] = []  # the sender's: the kernel's refusal, or what else stopped it
    sender = threading.Thread(target=_sender, args=(sock, family, outbox, refused), name="plexd-wireguard-set")
    sender.start()
    try:
        outbox.put(first)
        outbox.put(second)
        for body in packed:
            if refused:
                break
            outbox.put(body)
    finally:
        outbox.put(None)
        sender.join()
    if refused:
        raise refused[0]


def _sender(sock: socket.socket, family: int, outbox: queue.SimpleQueue[bytes | None],
            refused: list[Exception]) -> None:
    more = True
    while more:
        batch = [outbox.get()]
        while not outbox.empty() and sum(map(len, batch)) < _WRITE_BYTES:
            batch.append(outbox.get())
        if batch[-1] is None:
            more = False
            batch.pop()
        if batch and not refused:
            try:
                _write(sock, family, batch)
            except Exception as e:  # raised again in the packing thread
                refused.append(e)


def _write(sock: socket.socket, family: int, bodies: list[bytes]) -> None:
    """The messages in one write, acknowledged: OSError with the kernel's errno for the first one refused."""
    code = next((c for c in write_on(sock, [Message(family, 0, body) for body in bodies]) if c), 0)
    if code:
        raise OSError(code, os.strerror(code))


def dump(sock: socket.socket, family: int, body: bytes) -> list[bytes]:
    """The GET_DEVICE dump's message bodies: OSError with the kernel's errno when refused (ENODEV: no device)."""
    return dump_on(sock, family, body, family, bytes, "WireGuard device")
