"""Client of the WireGuard cross-platform userspace API (UAPI) over `<socket_dir>/<if>.sock`.

The protocol (https://www.wireguard.com/xplatform/) is line-oriented `key=value` text: a request is `get=1` or
`set=1` followed by settings and an empty line; the reply is settings (for get) and `errno=N` then an empty line.
Keys are hex on the wire. wireguard-go and boringtun both speak it; so does `wg`.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterable
from typing import TypeVar

from plexd.base.mesh_caches import bounded_by_mesh
from plexd.machine.wireguard import (
    ZERO_KEY,
    CounterRow,
    DeviceConfig,
    DeviceUpdate,
    PeerConfig,
    PeerCounters,
    PeerUpdate,
    UapiError,
    WireGuardError,
    b64_to_hex,
    hex_to_b64,
    key_fingerprint,
)

T = TypeVar("T")

DEFAULT_SOCKET_DIR = "/run/wireguard"
_ZERO_HEX = "00" * 32
TIMEOUT = 10.0
_READ_CHUNK = 1 << 16


class UapiUnavailable(WireGuardError):
    """No process is listening on the UAPI socket (the device does not exist or its process died)."""


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def normalize_cidr(cidr: str) -> str:
    """`10.0.0.5/24` → `10.0.0.0/24`; a bare address gets its full prefix. Raises ValueError when invalid."""
    return str(ipaddress.ip_network(cidr.strip(), strict=False))


# --- encoding ----------------------------------------------------------------------------------------------


def _peer_lines(p: PeerUpdate) -> list[str]:
    lines = [f"public_key={b64_to_hex(p.public_key)}"]
    if p.remove:
        lines.append("remove=true")
        return lines
    if p.update_only:
        lines.append("update_only=true")
    if p.psk is not None:
        lines.append(f"preshared_key={b64_to_hex(p.psk or ZERO_KEY)}")
    if p.endpoint:
        lines.append(f"endpoint={p.endpoint}")
    if p.persistent_keepalive is not None:
        lines.append(f"persistent_keepalive_interval={p.persistent_keepalive}")
    if p.allowed_ips is not None:
        lines.append("replace_allowed_ips=true")
        lines.extend(f"allowed_ip={ip}" for ip in sorted(p.allowed_ips))
    return lines


def encode_set(update: DeviceUpdate) -> str:
    """The full `set=1` request text for one transaction."""
    lines = ["set=1"]
    if update.private_key is not None:
        lines.append(f"private_key={b64_to_hex(update.private_key or ZERO_KEY)}")
    if update.listen_port is not None:
        lines.append(f"listen_port={update.listen_port}")
    if update.fwmark is not None:
        lines.append(f"fwmark={update.fwmark}")
    if update.replace_peers:
        lines.append("replace_peers=true")
    for p in update.peers:
        lines.extend(_peer_lines(p))
    return "\n".join(lines) + "\n\n"


# --- decoding ----------------------------------------------------------------------------------------------


def parse_errno(reply: str) -> int:
    """The errno of a reply; a reply without one (the socket was closed on us) is an error too."""
    for line in reply.splitlines():
        if line.startswith("errno="):
            try:
                return int(line[6:])
            except ValueError:
                break
    raise WireGuardError(f"malformed UAPI reply (no errno line): {reply[:80]!r}")


def parse_get(reply: str) -> DeviceConfig:
    """Parse a `get=1` reply into a `DeviceConfig` (observed fields included)."""
    # Tens of thousands of short-lived strings: a cyclic-GC pass in the middle is pure overhead here.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse_get(reply)
    finally:
        if enabled:
            gc.enable()


def _parse_get(reply: str) -> DeviceConfig:
    """Parse a `get=1` reply into a `DeviceConfig` (observed fields included).

    Written for speed (a 5,000-peer reply is ~1.7 MB): the text is cut into peer blocks at `public_key=` and each
    block's lines go into a dict; only allowed IPs repeat. Order inside a block is not assumed.
    """
    _check_get_reply(reply)
    blocks = ("\n" + reply).split("\npublic_key=")
    device: dict[str, str] = {}
    for lineno, line in enumerate(blocks[0].split("\n")[1:], 1):
        if line:
            key, sep, value = line.partition("=")
            if not sep:
                raise WireGuardError(f"malformed UAPI get reply line {lineno}: {line[:80]!r}")
            device[key] = value
    peers: dict[str, PeerConfig] = {}
    for block in blocks[1:]:
        lines = block.split("\n")
        fields: dict[str, str] = {}
        allowed: list[str] = []
        for line in lines[1:]:
            key, _, value = line.partition("=")  # a line without "=" is an unknown key: ignored
            if key == "allowed_ip":
                allowed.append(value)
            else:
                fields[key] = value
        try:
            public_key = hex_to_b64(lines[0])
            psk = fields.get("preshared_key")
            psk_b64 = hex_to_b64(psk) if psk and psk != _ZERO_HEX else ""
            peers[public_key] = PeerConfig(
                public_key=public_key,
                endpoint=fields.get("endpoint", ""),
                allowed_ips=frozenset(map(normalize_cidr, allowed)),
                psk=psk_b64,
                persistent_keepalive=int(fields.get("persistent_keepalive_interval", 0)),
                last_handshake=int(fields.get("last_handshake_time_sec", 0))
                + int(fields.get("last_handshake_time_nsec", 0)) / 1e9,
                rx=int(fields.get("rx_bytes", 0)),
                tx=int(fields.get("tx_bytes", 0)),
            )
        except ValueError as e:
            raise WireGuardError(f"malformed UAPI get reply for peer {lines[0][:16]}: {e}") from None
    numbers: dict[str, int] = {}
    for name in ("listen_port", "fwmark"):
        try:
            numbers[name] = int(device.get(name, 0))
        except ValueError:
            raise WireGuardError(f"malformed UAPI get reply: {name}={device[name][:20]!r}") from None
    private_key = device.get("private_key", "")
    try:
        private_b64 = hex_to_b64(private_key) if private_key and private_key != _ZERO_HEX else ""
    except ValueError:
        raise WireGuardError("malformed UAPI get reply: private_key is not hex") from None
    return DeviceConfig(private_key=private_b64, listen_port=numbers["listen_port"], fwmark=numbers["fwmark"],
                        peers=peers)


def _check_get_reply(reply: str) -> None:
    """Raise unless the reply ends in errno=0 (the device's error, or a reply cut short)."""
    if reply.rstrip("\n").endswith(("errno=0", "\nerrno=0")):
        return
    for line in reply.splitlines():
        if line.startswith("errno="):
            try:
                errno = int(line[6:])
            except ValueError:
                break
            if errno != 0:
                raise UapiError(errno, "get")
    raise WireGuardError("malformed UAPI get reply: no errno line")


def parse_counters(reply: str) -> dict[str, PeerCounters]:
    """Each peer's handshake time and byte counters from a `get=1` reply, by public key (the metrics endpoint)."""
    return {hex_to_b64(key): PeerCounters(int(sec) + int(nsec) / 1e9, int(rx), int(tx))
            for key, sec, nsec, tx, rx in parse_counter_rows(reply)}


# wireguard-go writes a peer's four counters on consecutive lines in this order, a few lines after its key (the
# preshared key, protocol version and endpoint come between): one regex pass reads them all. A match that ran
# into the next peer's block takes two keys, so there are fewer matches than keys, and the slow path reads it.
_NUMBER = "(0|[1-9][0-9]{0,19})"  # what goes into a JSON text as it is: no sign, no leading zero, ASCII digits
_HEX_KEY = "[0-9a-f]{64}"  # a key as wireguard-go writes it; the block reader lower-cases one written otherwise first
_COUNTER_LINES = re.compile(
    rf"^public_key=({_HEX_KEY})\n(?:[^\n]*\n){{0,8}}?last_handshake_time_sec={_NUMBER}\n"
    rf"last_handshake_time_nsec={_NUMBER}\ntx_bytes={_NUMBER}\nrx_bytes={_NUMBER}$", re.M)
_COUNTER_KEYS = ("\nlast_handshake_time_sec=", "\nlast_handshake_time_nsec=", "\ntx_bytes=", "\nrx_bytes=")


def parse_counter_rows(reply: str) -> list[CounterRow]:
    """Only each peer's counters from a `get=1` reply, as `CounterRow`s: what telemetry reads four times a minute.
    A reply in another order (another implementation) is read block by block, a missing counter as 0."""
    _check_get_reply(reply)
    rows: list[CounterRow] = _COUNTER_LINES.findall(reply)
    if len(rows) == reply.count("public_key="):
        return rows
    rows = []
    for block in ("\n" + reply).split("\npublic_key=")[1:]:
        block += "\n"  # every line of the block ends in one (the split took the last one's)
        key = block[:block.find("\n")].lower()  # as the fast path's (and a desired key's) hex
        if not re.fullmatch(_HEX_KEY, key):
            raise WireGuardError(f"malformed UAPI get reply: public_key={key[:16]!r}")
        sec, nsec, tx, rx = (_digits(block, name) for name in _COUNTER_KEYS)
        rows.append((key, sec, nsec, tx, rx))
    return rows


def _digits(block: str, name: str) -> str:
    at = block.find(name)
    if at < 0:
        return "0"
    at += len(name)
    value = block[at:block.find("\n", at)]
    if not (0 < len(value) <= 20 and value.isascii() and value.isdigit()):
        raise WireGuardError(f"malformed UAPI get reply: {name.strip()}{value[:24]!r}")
    return value.lstrip("0") or "0"


def describe_update(update: DeviceUpdate, interface: str) -> str:
    """Name what a failed set was about, for the error message (never includes key material)."""
    parts: list[str] = []
    if update.private_key is not None:
        parts.append("the private key")
    if update.listen_port is not None:
        parts.append(f"listen_port={update.listen_port}")
    if update.fwmark is not None:
        parts.append(f"fwmark={update.fwmark}")
    if len(update.peers) == 1:
        p = update.peers[0]
        what = f"peer {key_fingerprint(p.public_key)}"
        if p.remove:
            what += " (remove)"
        else:
            details = []
            if p.endpoint:
                details.append(f"endpoint={p.endpoint}")
            if p.allowed_ips is not None:
                details.append("allowed_ips=" + ",".join(sorted(p.allowed_ips)))
            if p.persistent_keepalive is not None:
                details.append(f"keepalive={p.persistent_keepalive}")
            if details:
                what += " (" + " ".join(details) + ")"
        parts.append(what)
    elif update.peers:
        parts.append(f"{len(update.peers)} peer updates")
    return (", ".join(parts) or "an empty set") + f" on {interface}"


# --- transport ---------------------------------------------------------------------------------------------


PARSE_INLINE = 64 * 1024  # a reply this small (up to ~150 peers) is parsed on the event loop


class UapiClient:
    """Talks to one device's UAPI socket. Each request uses its own connection (as `wg` does)."""

    def __init__(self, interface: str, socket_dir: str = DEFAULT_SOCKET_DIR, timeout: float = TIMEOUT) -> None:
        self.interface = interface
        self.socket_dir = socket_dir
        self.timeout = timeout

    @property
    def path(self) -> str:
        return os.path.join(self.socket_dir, f"{self.interface}.sock")

    async def _exchange(self, request: str) -> str:
        # A bare non-blocking socket through the loop's sock_* calls: asyncio's streams cost ~0.1 ms a request in
        # objects alone, and a burst of peer events is one request each.
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11, wait_for returns the inner result and swallows a
                # cancellation that arrives as the connect completes, so a daemon shutting down would carry on.
                async with asyncio.timeout(self.timeout):
                    await loop.sock_connect(sock, self.path)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise UapiUnavailable(f"no WireGuard device {self.interface} ({self.path}: {e.strerror})") from None
            except TimeoutError:
                raise WireGuardError(f"timed out connecting to {self.path}") from None
            try:
                async with asyncio.timeout(self.timeout):
                    await loop.sock_sendall(sock, request.encode())
                    buf = bytearray()
                    while not buf.endswith(b"\n\n"):
                        chunk = await loop.sock_recv(sock, _READ_CHUNK)
                        if not chunk:
                            break
                        buf += chunk
                return buf.decode()
            except TimeoutError:
                raise WireGuardError(f"timed out waiting for a reply from {self.path}") from None
            except (ConnectionResetError, BrokenPipeError) as e:
                raise UapiUnavailable(f"WireGuard device {self.interface} closed its UAPI socket: {e}") from None
        finally:
            sock.close()

    async def get(self) -> DeviceConfig:
        return await self._get(parse_get)

    async def counters(self) -> dict[str, PeerCounters]:
        return await self._get(parse_counters)

    async def counter_rows(self) -> list[CounterRow]:
        return await self._get(parse_counter_rows)

    async def _get(self, parse: Callable[[str], T]) -> T:
        reply = await self._exchange("get=1\n\n")
        if len(reply) < PARSE_INLINE:
            return parse(reply)
        # Thousands of peers: ~3 ms per 1,000 of parsing that events on the loop would otherwise wait for.
        return await asyncio.to_thread(parse, reply)

    async def set(self, update: DeviceUpdate) -> None:
        if update.is_empty():
            return
        reply = await self._exchange(encode_set(update))
        errno = parse_errno(reply)
        if errno != 0:
            raise UapiError(errno, describe_update(update, self.interface))

    async def set_raw(self, lines: Iterable[str]) -> int:
        """Send raw `set` lines and return the errno (for tests and debugging)."""
        return parse_errno(await self._exchange("set=1\n" + "".join(f"{line}\n" for line in lines) + "\n"))
