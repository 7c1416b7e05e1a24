"""The STUN servers the operator configured (`nat_traversal.stun_servers`), and their IPv4 addresses.

Only configured servers are ever asked: there is no built-in default (the Go agent's defaults, and aiostun's,
point at public servers the operator never chose). A name is resolved to IPv4 only (§10), with a timeout.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from plexd.config.stun_server import DEFAULT_PORT, StunServer, parse_server
from plexd.nat.stun import StunError

__all__ = ["DEFAULT_PORT", "RESOLVE_TIMEOUT", "StunServer", "parse_server", "resolve"]

RESOLVE_TIMEOUT = 3.0


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

