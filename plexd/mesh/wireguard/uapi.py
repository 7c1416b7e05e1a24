"""Client of the WireGuard cross-platform userspace API (UAPI) over `<socket_dir>/<if>.sock`.

The protocol (https://www.wireguard.com/xplatform/) is line-oriented `key=value` text: a request is `get=1` or
`set=1` followed by settings and an empty line; the reply is settings (for get) and `errno=N` then an empty line.
Keys are hex on the wire. wireguard-go and boringtun both speak it; so does `wg`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import ipaddress
import os
from collections.abc import Iterable

from plexd.mesh.wireguard import (
    ZERO_KEY,
    DeviceConfig,
    DeviceUpdate,
    PeerConfig,
    PeerUpdate,
    UapiError,
    WireGuardError,
    key_fingerprint,
)

DEFAULT_SOCKET_DIR = "/run/wireguard"
TIMEOUT = 10.0
_READ_CHUNK = 1 << 16


class UapiUnavailable(WireGuardError):
    """No process is listening on the UAPI socket (the device does not exist or its process died)."""


def b64_to_hex(key: str) -> str:
    return base64.b64decode(key).hex()


def hex_to_b64(key: str) -> str:
    return base64.b64encode(bytes.fromhex(key)).decode()


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
    private_key = ""
    listen_port = 0
    fwmark = 0
    peers: dict[str, PeerConfig] = {}
    cur: dict | None = None

    def flush() -> None:
        if cur is not None:
            psk = cur["psk"]
            peers[cur["public_key"]] = PeerConfig(
                public_key=cur["public_key"],
                endpoint=cur["endpoint"],
                allowed_ips=frozenset(cur["allowed_ips"]),
                psk="" if psk == ZERO_KEY else psk,
                persistent_keepalive=cur["keepalive"],
                last_handshake=cur["hs_sec"] + cur["hs_nsec"] / 1e9,
                rx=cur["rx"],
                tx=cur["tx"],
            )

    errno: int | None = None
    for lineno, line in enumerate(reply.splitlines(), 1):
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise WireGuardError(f"malformed UAPI get reply line {lineno}: {line[:80]!r}")
        try:
            if key == "errno":
                errno = int(value)
            elif key == "public_key":
                flush()
                cur = {"public_key": hex_to_b64(value), "endpoint": "", "allowed_ips": [], "psk": "",
                       "keepalive": 0, "hs_sec": 0, "hs_nsec": 0, "rx": 0, "tx": 0}
            elif cur is None:
                if key == "private_key":
                    private_key = hex_to_b64(value)
                elif key == "listen_port":
                    listen_port = int(value)
                elif key == "fwmark":
                    fwmark = int(value)
            elif key == "preshared_key":
                cur["psk"] = hex_to_b64(value)
            elif key == "endpoint":
                cur["endpoint"] = value
            elif key == "allowed_ip":
                cur["allowed_ips"].append(normalize_cidr(value))
            elif key == "persistent_keepalive_interval":
                cur["keepalive"] = int(value)
            elif key == "last_handshake_time_sec":
                cur["hs_sec"] = int(value)
            elif key == "last_handshake_time_nsec":
                cur["hs_nsec"] = int(value)
            elif key == "rx_bytes":
                cur["rx"] = int(value)
            elif key == "tx_bytes":
                cur["tx"] = int(value)
            # protocol_version and unknown keys: ignored (forward compatible)
        except ValueError as e:
            raise WireGuardError(f"malformed UAPI get reply line {lineno} ({key}): {e}") from None
    flush()
    if errno is None:
        raise WireGuardError("malformed UAPI get reply: no errno line")
    if errno != 0:
        raise UapiError(errno, "get")
    if private_key == ZERO_KEY:
        private_key = ""
    return DeviceConfig(private_key=private_key, listen_port=listen_port, fwmark=fwmark, peers=peers)


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
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), self.timeout)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise UapiUnavailable(f"no WireGuard device {self.interface} ({self.path}: {e.strerror})") from None
        except TimeoutError:
            raise WireGuardError(f"timed out connecting to {self.path}") from None
        try:
            writer.write(request.encode())
            await writer.drain()
            buf = bytearray()
            async with asyncio.timeout(self.timeout):
                while not buf.endswith(b"\n\n"):
                    chunk = await reader.read(_READ_CHUNK)
                    if not chunk:
                        break
                    buf += chunk
            return buf.decode()
        except TimeoutError:
            raise WireGuardError(f"timed out waiting for a reply from {self.path}") from None
        except (ConnectionResetError, BrokenPipeError) as e:
            raise UapiUnavailable(f"WireGuard device {self.interface} closed its UAPI socket: {e}") from None
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionResetError, BrokenPipeError):
                pass

    async def get(self) -> DeviceConfig:
        return parse_get(await self._exchange("get=1\n\n"))

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
