"""What a control plane may not ask, valid signature or not: routes that would cut this node off or hijack peers.

A peer's allowed IPs become routes into the tunnel. A buggy or compromised control plane could use them to
route the control plane's own address, a peer's endpoint or this node's underlay addresses into the tunnel (the
node loses the control plane, the tunnel loses its own carrier), to take everything (a default route, also when
split into halves or smaller pieces), or to steal another peer's mesh address. Each such prefix is refused on
its own — the peer keeps its other prefixes — with the reason; `plexd.desired` applies these checks as peers
enter the model and records what it refused. Exit-node routing (a peer carrying default routes) is only
allowed with ``mesh.allow_exit_routes``; the protected addresses are refused even then.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# A prefix this wide or wider counts towards "amounts to a default route"; half of an address family routed
# into the tunnel is treated as a default route (0.0.0.0/1 + 128.0.0.0/1 is how WireGuard tools spell one).
WIDE = {4: 16, 6: 48}
HALF = {4: 2**31, 6: 2**127}


@dataclass(frozen=True)
class RouteLimits:
    protected: frozenset[IPAddress] = field(default_factory=frozenset)  # control plane, underlay addresses
    allow_exit_routes: bool = False


@functools.lru_cache(maxsize=1 << 16)
def address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


@functools.lru_cache(maxsize=1 << 16)
def network(text: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def is_wide(net: IPNetwork) -> bool:
    """Wide enough to count towards "amounts to a default route"."""
    return net.prefixlen <= WIDE[net.version]


def refuse_prefix(net: IPNetwork, limits: RouteLimits, endpoints: Mapping[IPAddress, str],
                  routed: Mapping[IPNetwork, str], own_mesh_ip: IPAddress | None,
                  wide_others: Iterable[IPNetwork]) -> str | None:
    """Why `net` may not be routed into the tunnel, or None. `endpoints` maps the peers' endpoint addresses to
    their owner, `routed` every prefix already routed to another peer (its mesh address included) to its owner;
    `wide_others` are the wide prefixes among them. WireGuard routes by longest prefix, so a wider prefix over
    another peer's address takes nothing from it; the same prefix moves it to the new peer: that is a theft."""
    if net.prefixlen == 0 and not limits.allow_exit_routes:
        return "a default route (set mesh.allow_exit_routes to allow exit-node routing)"
    for addr in limits.protected:
        if addr.version == net.version and addr in net:
            return f"would route {addr} (the control plane or this node's own network) into the tunnel"
    if own_mesh_ip is not None and net.num_addresses == 1 and net.network_address == own_mesh_ip:
        return f"claims this node's own mesh address {own_mesh_ip}"
    hit = _inside(net, endpoints)
    if hit is not None:
        return f"would route the endpoint {hit[0]} of peer {hit[1]} into the tunnel"
    owner = routed.get(net)
    if owner is not None:
        return f"claims {net}, which is routed to peer {owner}"
    if is_wide(net) and not limits.allow_exit_routes:
        same = [n for n in wide_others if n.version == net.version]
        covered = sum(n.num_addresses for n in ipaddress.collapse_addresses([*same, net]))  # type: ignore[misc]
        if covered >= HALF[net.version]:
            return "together with the other peers' routes it amounts to a default route"
    return None


def _inside(net: IPNetwork, table: Mapping[IPAddress, str]) -> tuple[IPAddress, str] | None:
    if net.num_addresses == 1:
        owner = table.get(net.network_address)
        return None if owner is None else (net.network_address, owner)
    for addr, owner in table.items():
        if addr.version == net.version and addr in net:
            return addr, owner
    return None
