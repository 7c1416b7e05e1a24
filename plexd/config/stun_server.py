"""A STUN server as the configuration names it: `HOST` or `HOST:PORT` (nat.stun_servers), checked when the
configuration loads."""

from __future__ import annotations

from dataclasses import dataclass

from plexd.base.hostname import is_ip, is_resolvable

DEFAULT_PORT = 3478


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
