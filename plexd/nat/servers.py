"""The STUN servers the operator configured (`nat_traversal.stun_servers`), and their IPv4 addresses.

Only configured servers are ever asked: there is no built-in default (the Go agent's defaults, and aiostun's,
point at public servers the operator never chose). A name is resolved to IPv4 only (§10), with a timeout.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

from plexd.base.hostname import is_ip, is_resolvable
from plexd.nat.stun import StunError

DEFAULT_PORT = 3478
RESOLVE_TIMEOUT = 3.0


@dataclass(frozen=True)
class StunServer:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_server(text: str) -> StunServer:
    """`HOST` or `HOST:PORT`; ValueError naming what is wrong (an IPv6 literal: §10 discovers IPv4 only)."""
    text = text.strip()
    if not text:
        raise ValueError("an empty STUN server")
    if text.startswith("[") or text.count(":") > 1:
        raise ValueError(f"{text!r}: IPv6 STUN servers are not used (plexd discovers IPv4 endpoints)")
    host, sep, port_text = text.partition(":")
    port = DEFAULT_PORT
    if sep:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"{text!r}: port {port_text!r} is not 1-65535")
        port = int(port_text)
    if not is_ip(host, 4) and not is_resolvable(host):
        raise ValueError(f"{text!r} is not HOST or HOST:PORT (an IPv4 address or a host name)")
    return StunServer(host, port)


async def resolve(host: str, timeout: float = RESOLVE_TIMEOUT) -> str:
    """The host's first IPv4 address; StunError when the name does not resolve to one in time."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_DGRAM)
    except TimeoutError:
        raise StunError(f"resolving {host} took longer than {timeout:g}s") from None
    except OSError as exc:
        raise StunError(f"cannot resolve {host}: {exc.strerror or exc}") from None
    except (UnicodeError, ValueError) as exc:  # a name the resolver cannot encode: this server only, not discovery
        raise StunError(f"cannot resolve {host[:80]!r}: {exc}") from None
    if not infos:
        raise StunError(f"{host} has no IPv4 address")
    return str(infos[0][4][0])

