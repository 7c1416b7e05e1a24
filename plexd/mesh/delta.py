"""The event path's diff: the changes for the peers an event touched, against the machine as we last left it.

`plan.diff` compares the whole desired model with a fresh read of the live machine; at thousands of peers that
read dominates, and an event changes one peer. `peer_delta(old, new, believed, now)` looks only at the peers whose
value differs between the model the last apply was made for (`old`) and the current one (`new`), and compares
them with `believed`: the snapshot of the last full converge with every change applied since (`plan.simulate`).
Cost grows with the peers touched, not the mesh. Drift that happened since (someone ran `wg set`) is not seen
here; the periodic reconcile's full diff is where that is found and reported.

Routes are kept incrementally: a new prefix not yet covered gets its own route and merges with an existing
sibling into the common supernet (so sequential mesh addresses still collapse into a few routes); a prefix no
peer needs any more is cut out of the route that covered it. The full diff compares routes by the addresses
they cover, not their form, so this never shows up as drift.

Returns None when something other than peers changed (key, port, MTU, addresses, keepalive, interface): the
caller runs a full converge instead. A policy change is a peer change: the peers whose visibility (§9.2) it
changed are touched too.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterable, Mapping

from plexd.machine.wireguard import PeerConfig
from plexd.mesh.mesh_plan import (
    Change,
    Observed,
    PeerAdded,
    PeerKeyChanged,
    PeerRemoved,
    RouteExtra,
    RouteMissing,
    normalize_endpoint,
    own_addresses,
    peer_config,
    peer_fields,
    rules_for,
)
from plexd.state import route_limits
from plexd.state.desired import DesiredState
from plexd.state.model import Peer

Net = ipaddress.IPv4Network | ipaddress.IPv6Network

_DEVICE_FIELDS = ("interface", "listen_port", "mtu", "private_key", "mesh_ip", "mesh_ip6", "persistent_keepalive")
_POLICY_FIELDS = ("policies", "enforce_policy", "node_id", "mesh_range")


def touched_peers(old: DesiredState, new: DesiredState) -> list[str]:
    """Peer ids whose value differs between the two models. An event's edit keeps every other peer object as it
    was, so identity settles nearly all of them; a state pull builds new objects, compared by value (~1 µs)."""
    moved = sorted(old.relayed ^ new.relayed)  # the same peer object, put on its other path (plexd.services.paths)
    if old.peers is new.peers:
        return moved
    before = old.peers
    changed = [pid for pid, p in new.peers.items() if (b := before.get(pid)) is not p and b != p]
    changed.extend(pid for pid in before if pid not in new.peers)
    return changed + [pid for pid in moved if pid not in changed]


def peer_delta(old: DesiredState, new: DesiredState, believed: Observed, now: float,
               touched: Iterable[str] | None = None) -> list[Change] | None:
    if believed.device is None or believed.link is None:
        return None
    if any(getattr(old, f) != getattr(new, f) for f in _DEVICE_FIELDS):
        return None
    live = believed.device.peers
    keepalive = new.persistent_keepalive
    own = own_addresses(new)
    peer_changes: list[Change] = []
    gone: list[Net] = []
    wanted: list[Net] = []
    touched = set(touched_peers(old, new) if touched is None else touched)
    if any(getattr(old, f) != getattr(new, f) for f in _POLICY_FIELDS):
        before_shown, after_shown = old.shown_peers, new.shown_peers
        touched.update(pid for pid in before_shown.keys() ^ after_shown.keys())
    touched = sorted(touched)
    # Keys let go by their old peer (removed, or rotated away): whoever holds them now is added afresh.
    released = set()
    for pid in touched:
        before, after = old.shown_peer(pid), new.shown_peer(pid)
        if before is not None and (after is None or after.public_key != before.public_key):
            released.add(before.public_key)
    for pid in touched:
        before, after = old.shown_peer(pid), new.shown_peer(pid)
        want = peer_config(after, keepalive) if after is not None else None
        peer_changes.extend(_peer_changes(pid, before, want, live, released, now))
        had = _prefixes(before, keepalive, own)
        has = _prefixes(after, keepalive, own)
        gone.extend(had - has)
        wanted.extend(has - had)
    routes = _RouteSet(believed.link.routes)
    for net in gone:
        inside = _still_routed_inside(net, new, own)
        if inside is not None:
            routes.cut(net)
            wanted.extend(inside)
    for net in wanted:
        routes.cover(net)
    added = sorted(routes.added())
    route_changes: list[Change] = rules_for(new.interface, added, believed.link)
    route_changes += [RouteMissing(new.interface, r) for r in added]
    route_changes += [RouteExtra(new.interface, r) for r in sorted(routes.removed())]
    return peer_changes + route_changes


def _peer_changes(pid: str, before: Peer | None, want: PeerConfig | None, live: Mapping[str, PeerConfig],
                  released: set[str], now: float) -> Iterable[Change]:
    old_key = before.public_key if before is not None else ""
    if want is None:
        if old_key in live:
            yield PeerRemoved(pid, old_key)
        return
    key = want.public_key
    have = live.get(key) if key not in released else None  # a released key is removed first (device_update)
    if old_key and old_key != key and old_key in live:
        if have is not None:
            yield PeerRemoved(pid, old_key)
        else:
            yield PeerKeyChanged(pid, key, old_key, want)
            return
    if have is None:
        yield PeerAdded(pid, key, want)
    elif have != want:
        moved = before is not None and normalize_endpoint(before.endpoint) != want.endpoint
        yield from peer_fields(pid, want, have, now, moved=moved)


def _prefixes(peer: Peer | None, keepalive: int, own: frozenset[str]) -> set[Net]:
    """The prefixes a peer needs routed via the interface (what `plan.target` routes, for one peer)."""
    if peer is None:
        return set()
    return {_net(c) for c in peer_config(peer, keepalive).allowed_ips if not c.endswith("/0") and c not in own}


def _still_routed_inside(net: Net, desired: DesiredState, own: frozenset[str]) -> list[Net] | None:
    """The parts of `net` some peer of `desired` still needs routed, or None when all of it is (a peer holds it
    or a prefix around it). Prefixes are indexed by exact value, so the usual case (a /32 mesh address) is a
    few lookups; only a wide prefix is checked against every routed prefix."""
    routed = desired.routed_prefixes()

    def held(prefix: Net) -> bool:  # by a peer on the device (a peer the policies hide holds no route)
        pid = routed.get(prefix)
        return pid is not None and desired.shown_peer(pid) is not None

    for plen in desired.routed_lengths(net.version):  # not /0: a default route is never installed
        if 0 < plen <= net.prefixlen and held(net.supernet(new_prefix=plen)):
            return None
    if net.prefixlen == net.max_prefixlen:
        return []
    return [n for n in routed if n.version == net.version and n.subnet_of(net)  # type: ignore[arg-type]
            and str(n) not in own and held(n)]


def _net(text: str) -> Net:
    """Parsed once per text: every apply looks at the interface's routes, and parsing them each time cost more
    than the rest of an apply. The cache is the model's (`route_limits.network`), so a prefix is one object for
    the route index and for the routes here (two would be ~4 MiB at 10,000 peers)."""
    net = route_limits.network(text)
    if net is None:  # the device's routes and the model's allowed IPs are valid prefixes: a bug if not
        raise ValueError(f"not a prefix: {text!r}")
    return net


class _RouteSet:
    """The interface's routes, changed one prefix at a time, remembering what to add and remove in the end."""

    def __init__(self, live: Iterable[str]) -> None:
        self._nets: set[Net] = set()
        self._lengths: Counter[tuple[int, int]] = Counter()  # (IP version, prefix length) -> routes of it
        for r in live:
            self._put(_net(r))
        self._added: set[Net] = set()
        self._removed: set[Net] = set()

    def _put(self, net: Net) -> None:
        self._nets.add(net)
        self._lengths[net.version, net.prefixlen] += 1

    def _add(self, net: Net) -> None:
        if net not in self._nets:
            self._put(net)
            if net in self._removed:
                self._removed.discard(net)
            else:
                self._added.add(net)

    def _discard(self, net: Net) -> None:
        if net in self._nets:
            self._nets.discard(net)
            self._lengths[net.version, net.prefixlen] -= 1
            if net in self._added:
                self._added.discard(net)
            else:
                self._removed.add(net)

    def _covering(self, net: Net) -> Net | None:
        """The route that holds `net` (itself or a wider one): only the lengths some route has are tried (the
        usual interface has /32s and a few wider prefixes; trying all 33 lengths was most of an event's apply)."""
        lengths = sorted((p for (v, p), n in self._lengths.items() if n > 0 and v == net.version
                          and p <= net.prefixlen), reverse=True)
        for plen in lengths:
            candidate = net.supernet(new_prefix=plen)
            if candidate in self._nets:
                return candidate
        return None

    def cover(self, net: Net) -> None:
        if self._covering(net) is not None:
            return
        self._drop_inside(net)
        # Merge with a routed sibling as long as there is one.
        while net.prefixlen > 0:
            parent = net.supernet()
            sibling = next(n for n in parent.subnets() if n != net)
            if sibling not in self._nets:
                break
            self._discard(sibling)
            net = parent
        self._add(net)

    def cut(self, net: Net) -> None:
        route = self._covering(net)
        if route is None:
            self._drop_inside(net)
            return
        self._discard(route)
        if route != net:
            for part in route.address_exclude(net):  # type: ignore[arg-type]
                self._add(part)

    def _drop_inside(self, net: Net) -> None:
        """Remove routes for parts of `net` (none can exist inside a host prefix: skip the scan)."""
        if net.prefixlen < net.max_prefixlen:
            for n in [n for n in self._nets if n.version == net.version and n.subnet_of(net)]:  # type: ignore[arg-type]
                self._discard(n)

    def added(self) -> set[str]:
        return {str(n) for n in self._added}

    def removed(self) -> set[str]:
        return {str(n) for n in self._removed}
