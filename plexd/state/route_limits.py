"""What a control plane may not ask, valid signature or not: routes that would cut this node off or hijack traffic.

A peer's allowed IPs become routes into the tunnel. A buggy or compromised control plane could use them to route
the control plane's own address, a peer's endpoint or this node's underlay into the tunnel (the node loses the
control plane, the tunnel its own carrier); the DNS resolver, the default gateway, link-local addresses and the
cloud metadata service (the node's names, its way out and its cloud credentials would go to a peer); this node's
LAN; a large share of the address space, however it is split (a default route as 0/1 + 128/1, 16 × /4, or
thousands of /17s); or another peer's mesh address. Each such prefix is refused on its own, with the reason —
the peer keeps its other prefixes; `plexd.state.desired` applies these checks as peers enter the model and records
what it refused, which the next drift report carries as rejected changes.

Two strengths of refusal:
- `protected` addresses (the control plane, this machine's own addresses) and the mesh's own bookkeeping (a
  peer's endpoint, another peer's prefix, this node's mesh address) are refused whatever the configuration says;
- `guarded` prefixes (resolvers, gateways, LANs, link-local, metadata) and the share limit can be opened by the
  operator for specific prefixes (`mesh.allow_routes`): a site-to-site route over a LAN is a legitimate choice
  only this machine's operator can make. Exit-node routing (default routes) needs `mesh.allow_exit_routes`.
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from plexd.base.mesh_caches import bounded_by_mesh

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

BITS = {4: 32, 6: 128}
HALF = {4: 2**31, 6: 2**127}
DEFAULT_MAX_ROUTE_PERCENT = 0.1  # of each address family: a /10 of IPv4 fits, a /9 does not


@dataclass(frozen=True)
class Guarded:
    """A prefix no route may overlap unless the operator allows it; `what` names it in the refusal."""

    net: IPNetwork
    what: str
    # the prefix's first and last address as integers: every prefix of a state meets every guard, and comparing
    # integers costs a tenth of ipaddress's overlaps()
    first: int = field(init=False, repr=False, compare=False)
    last: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "first", int(self.net.network_address))
        object.__setattr__(self, "last", int(self.net.broadcast_address))


def _guards(*pairs: tuple[str, str]) -> tuple[Guarded, ...]:
    return tuple(Guarded(ipaddress.ip_network(net), what) for net, what in pairs)


# Always guarded, whatever this machine looks like. Metadata services first: inside link-local, and the more
# telling name. (AWS, GCP, Azure and Oracle answer at 169.254.169.254; AWS also at fd00:ec2::254; Alibaba at
# 100.100.100.200.)
ALWAYS_GUARDED = _guards(
    ("169.254.169.254/32", "the cloud metadata service 169.254.169.254"),
    ("fd00:ec2::254/128", "the cloud metadata service fd00:ec2::254"),
    ("100.100.100.200/32", "the cloud metadata service 100.100.100.200"),
    ("169.254.0.0/16", "the link-local range 169.254.0.0/16"),
    ("fe80::/10", "the link-local range fe80::/10"),
    ("127.0.0.0/8", "the loopback range 127.0.0.0/8"),
    ("::1/128", "the loopback address ::1"),
)


@dataclass(frozen=True)
class RouteLimits:
    protected: frozenset[IPAddress] = field(default_factory=frozenset)  # control plane, this machine's addresses
    allow_exit_routes: bool = False
    guarded: tuple[Guarded, ...] = ALWAYS_GUARDED  # plus resolvers, gateways and LANs, read by the node
    allow: tuple[IPNetwork, ...] = ()  # mesh.allow_routes
    max_route_percent: float = DEFAULT_MAX_ROUTE_PERCENT

    def opened(self, net: IPNetwork) -> bool:
        """Inside a prefix the operator allowed."""
        return any(a.version == net.version and net.subnet_of(a) for a in self.allow)  # type: ignore[arg-type]

    def max_addresses(self, version: int) -> int:
        return int(2 ** BITS[version] * self.max_route_percent / 100)


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def network(text: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


class Coverage:
    """The addresses a set of prefixes covers, per family, as sorted disjoint [first, last] integer ranges: how
    much of the address space is routed, however the routes are split or overlap. Adding a prefix costs a
    bisection and the ranges it swallows, so a full state of n peers is checked in O(n log n)."""

    def __init__(self, nets: Iterable[IPNetwork] = ()) -> None:
        self._starts: dict[int, list[int]] = {4: [], 6: []}
        self._ends: dict[int, list[int]] = {4: [], 6: []}
        self.total: dict[int, int] = {4: 0, 6: 0}
        for net in nets:
            self.add(net)

    def copy(self) -> Coverage:
        new = Coverage()
        new._starts = {v: list(s) for v, s in self._starts.items()}
        new._ends = {v: list(e) for v, e in self._ends.items()}
        new.total = dict(self.total)
        return new

    def _span(self, net: IPNetwork) -> tuple[int, int, int, int]:
        """(first, last, index of the first range touching it, index past the last range touching it)."""
        first, last = int(net.network_address), int(net.broadcast_address)
        starts, ends = self._starts[net.version], self._ends[net.version]
        lo = bisect.bisect_left(ends, first - 1)  # ranges ending right before `first` merge too
        hi = bisect.bisect_right(starts, last + 1)
        return first, last, lo, hi

    def added_by(self, net: IPNetwork) -> int:
        """How many addresses `net` would add to the coverage."""
        first, last, lo, hi = self._span(net)
        starts, ends = self._starts[net.version], self._ends[net.version]
        inside = sum(min(last, ends[i]) - max(first, starts[i]) + 1
                     for i in range(lo, hi) if starts[i] <= last and ends[i] >= first)
        return last - first + 1 - inside

    def add(self, net: IPNetwork) -> None:
        first, last, lo, hi = self._span(net)
        v = net.version
        starts, ends = self._starts[v], self._ends[v]
        self.total[v] += self.added_by(net)
        if lo < hi:
            first, last = min(first, starts[lo]), max(last, ends[hi - 1])
        starts[lo:hi] = [first]
        ends[lo:hi] = [last]


class RoutedSpace:
    """How much address space the prefixes in `nets` cover, kept as cheap as a sum while that sum is within the
    limit: only when it is not (prefixes may overlap, so the sum over-counts) is the exact `Coverage` built, and
    then kept up to date by additions (a removal drops it; it is built again when next needed). `nets` is the
    caller's collection, changed only together with `add`/`remove`."""

    def __init__(self, nets: Collection[IPNetwork]) -> None:
        self._nets = nets
        self.sums = {4: 0, 6: 0}
        for net in nets:
            self.sums[net.version] += net.num_addresses
        self._exact: Coverage | None = None

    def rebound(self, nets: Collection[IPNetwork]) -> RoutedSpace:
        """A copy over `nets` (a copy of this one's collection)."""
        new = RoutedSpace(())
        new._nets, new.sums = nets, dict(self.sums)
        new._exact = None if self._exact is None else self._exact.copy()
        return new

    def add(self, net: IPNetwork) -> None:
        self.sums[net.version] += net.num_addresses
        if self._exact is not None:
            self._exact.add(net)

    def remove(self, net: IPNetwork) -> None:
        self.sums[net.version] -= net.num_addresses
        self._exact = None  # ranges cannot be cut back where prefixes overlap

    def covered_with(self, net: IPNetwork, within: int) -> int:
        """The addresses covered once `net` is added: exact, or an upper bound when even that is `within`."""
        upper = self.sums[net.version] + net.num_addresses
        if upper <= within:
            return upper
        if self._exact is None:
            self._exact = Coverage(self._nets)
        return self._exact.total[net.version] + self._exact.added_by(net)


def refuse_prefix(net: IPNetwork, limits: RouteLimits, endpoints: Mapping[IPAddress, str],
                  routed: Mapping[IPNetwork, str], own_mesh_ip: IPAddress | None,
                  space: RoutedSpace) -> str | None:
    """Why `net` may not be routed into the tunnel, or None. `endpoints` maps the peers' endpoint addresses to
    their owner, `routed` every prefix already routed to another peer (its mesh address included) to its owner,
    `space` what they cover. WireGuard routes by longest prefix, so a wider prefix over another peer's address
    takes nothing from it; the same prefix moves it to the new peer: that is a theft."""
    if net.prefixlen == 0 and not limits.allow_exit_routes:
        return "a default route (set mesh.allow_exit_routes to allow exit-node routing)"
    for addr in limits.protected:
        if addr.version == net.version and addr in net:
            return f"would route {addr} (the control plane or this node's own address) into the tunnel"
    if own_mesh_ip is not None and net.num_addresses == 1 and net.network_address == own_mesh_ip:
        return f"claims this node's own mesh address {own_mesh_ip}"
    hit = _inside(net, endpoints)
    if hit is not None:
        return f"would route the endpoint {hit[0]} of peer {hit[1]} into the tunnel"
    owner = routed.get(net)
    if owner is not None:
        return f"claims {net}, which is routed to peer {owner}"
    if limits.opened(net):
        return None
    exit_route = net.prefixlen == 0  # allowed by now: WireGuard's alone, never installed as a kernel route
    first, last = int(net.network_address), int(net.broadcast_address)
    for guard in () if exit_route else limits.guarded:
        if guard.net.version == net.version and first <= guard.last and guard.first <= last:
            return f"overlaps {guard.what} (list the prefix in mesh.allow_routes to allow it)"
    if not limits.allow_exit_routes:
        most = limits.max_addresses(net.version)
        covered = space.covered_with(net, min(most, HALF[net.version] - 1))
        if covered >= HALF[net.version]:
            return "together with the other peers' routes it amounts to a default route"
        if covered > most:
            share = 100 * covered / 2 ** BITS[net.version]
            return (f"together with the other peers' routes it would route {share:.3g}% of the IPv{net.version} "
                    f"address space into the tunnel (mesh.max_route_percent is {limits.max_route_percent:g})")
    return None


def _inside(net: IPNetwork, table: Mapping[IPAddress, str]) -> tuple[IPAddress, str] | None:
    if net.num_addresses == 1:
        owner = table.get(net.network_address)
        return None if owner is None else (net.network_address, owner)
    for addr, owner in table.items():
        if addr.version == net.version and addr in net:
            return addr, owner
    return None
