"""The WireGuard device adapter: value types and the one interface both backends implement.

Like wireguard-tools, there is one small "get device / set device" interface with two implementations picked at
run time: the kernel module over generic netlink (`kernel.py`) and the cross-platform userspace protocol over
`/run/wireguard/<if>.sock` (`uapi.py`, driven by `userspace.py`, which also runs and supervises wireguard-go).

Keys are standard base64 strings everywhere above the wire (hex is a UAPI wire detail). An empty string means
"no value" for an endpoint or a preshared key.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from plexd.base.errors import PlexdError
from plexd.machine.wireguard.kernel_probe import kernel_module_loaded as kernel_module_loaded
from plexd.state.model import KEY_LEN

ZERO_KEY = base64.b64encode(bytes(KEY_LEN)).decode()
MAX_IFNAME = 15  # IFNAMSIZ - 1


class WireGuardError(PlexdError):
    """The WireGuard device could not be created, read or configured."""


class UapiError(WireGuardError):
    """The userspace implementation answered a `set` with `errno=N` (the setting or peer is named)."""

    def __init__(self, errno: int, what: str) -> None:
        self.errno = errno
        self.what = what
        super().__init__(f"WireGuard refused {what}: errno={errno}")


def b64_to_hex(key: str) -> str:
    """A key as the device's text interface writes it (UAPI, and telemetry's counter rows)."""
    return base64.b64decode(key).hex()


def hex_to_b64(key: str) -> str:
    return binascii.b2a_base64(bytes.fromhex(key), newline=False).decode()


def key_fingerprint(key: str) -> str:
    """A short printable name for a public key (never use this on a private key)."""
    return key[:8] + "…" if key else "(none)"


def clamp_private_key(key: str) -> str:
    """The Curve25519-clamped form WireGuard stores and reports; compare private keys in this form."""
    try:
        raw = bytearray(base64.b64decode(key, validate=True))
    except (binascii.Error, ValueError):
        return key
    if len(raw) != KEY_LEN:
        return key
    raw[0] &= 248
    raw[31] = (raw[31] & 127) | 64
    return base64.b64encode(bytes(raw)).decode()


def check_interface_name(name: str) -> None:
    """Linux interface names are 1-15 bytes without '/', whitespace or ':'."""
    if not name or len(name.encode()) > MAX_IFNAME:
        raise WireGuardError(
            f"mesh.interface {name!r} is not a valid interface name: it must be 1-{MAX_IFNAME} characters"
        )
    if any(c in name for c in "/: \t\n") or name in (".", ".."):
        raise WireGuardError(f"mesh.interface {name!r} is not a valid interface name: no '/', ':' or spaces")


@dataclass(frozen=True)
class PeerConfig:
    """One peer as it is (observed) or should be (desired) on the device.

    `last_handshake` (Unix seconds, 0 = never), `rx` and `tx` are observed-only and ignored by equality.
    """

    public_key: str
    endpoint: str = ""
    allowed_ips: frozenset[str] = frozenset()
    psk: str = field(default="", repr=False)
    persistent_keepalive: int = 0
    last_handshake: float = field(default=0.0, compare=False)
    rx: int = field(default=0, compare=False)
    tx: int = field(default=0, compare=False)


@dataclass(frozen=True)
class DeviceConfig:
    """A whole device. `peers` is keyed by public key."""

    private_key: str = field(default="", repr=False)
    listen_port: int = 0
    fwmark: int = 0
    peers: Mapping[str, PeerConfig] = field(default_factory=dict)


class PeerCounters(NamedTuple):
    """What the metrics endpoint reads of a peer at each scrape: `last_handshake` in Unix seconds (0 = never)."""

    last_handshake: float
    rx: int
    tx: int


# What telemetry reads of each peer four times a minute, as the device wrote it: (public key in hex, handshake
# seconds, handshake nanoseconds, tx bytes, rx bytes), the numbers as strings of at most 20 digits. At 1,000 peers,
# converting every key and number into objects only to write them out again was most of a collection's cost.
CounterRow = tuple[str, str, str, str, str]


@dataclass(frozen=True)
class PeerUpdate:
    """A change to one peer. Fields left `None` are not sent (the device keeps its value).

    `allowed_ips` set means "replace the peer's allowed IPs with exactly these". `psk=""` clears the key.
    """

    public_key: str
    remove: bool = False
    update_only: bool = False
    endpoint: str | None = None
    allowed_ips: frozenset[str] | None = None
    psk: str | None = field(default=None, repr=False)
    persistent_keepalive: int | None = None


@dataclass(frozen=True)
class DeviceUpdate:
    """One set transaction: device fields (None = unchanged) and peer updates in order."""

    private_key: str | None = field(default=None, repr=False)
    listen_port: int | None = None
    fwmark: int | None = None
    replace_peers: bool = False
    peers: tuple[PeerUpdate, ...] = ()

    def is_empty(self) -> bool:
        return (self.private_key is None and self.listen_port is None and self.fwmark is None
                and not self.replace_peers and not self.peers)


@runtime_checkable
class WireGuardBackend(Protocol):
    """What the converge engine needs from a WireGuard implementation."""

    interface: str

    async def observe(self) -> DeviceConfig | None:
        """The live device, or None when it does not exist (or its process is gone)."""
        ...

    async def counters(self) -> Mapping[str, PeerCounters] | None:
        """Each peer's handshake and byte counters by public key (None: no device); cheaper than `observe`."""
        ...

    async def counter_rows(self) -> list[CounterRow] | None:
        """The same as `counters`, as the device wrote them (None: no device); the cheapest read there is."""
        ...

    async def apply(self, update: DeviceUpdate) -> None:
        """Send one set transaction. Raises `UapiError`/`WireGuardError` naming what was refused."""
        ...

    async def ensure_device(self) -> bool:
        """Create the device (or start/restart its process) if missing; True when something was created."""
        ...

    async def delete_device(self) -> None:
        """Remove the device (stop the userspace process); a no-op when it is already gone."""
        ...

    def process_gone(self) -> bool:
        """True when a userspace process this backend started has died (the kernel backend: always False)."""
        ...

    async def close(self) -> None:
        """Let go of what this backend holds (the userspace one: stop the process it started or adopted, once the
        device is not wanted); the kernel's device is not held by anyone: nothing to do."""
        ...
