"""The kernel fast path: stable relay flows forwarded by nftables, with no per-packet Python.

Two tables named `plexd_relay`, the relay's own (plexd's firewall table `inet plexd` is never touched). Per
session two map elements, one per direction, keyed by the sending side's current address:

    map fwd_addr { ipv4_addr . inet_service : ipv4_addr }      A_ip . A_port -> B_ip   (and B -> A)
    map fwd_port { ipv4_addr . inet_service : inet_service }   A_ip . A_port -> B_port

`netdev plexd_relay`, on the interface holding the relay's address: the flows whose other side is reached
through that same interface (a one-armed relay, the usual case). At ingress, before the IP stack:

    ingress:  to RELAY:51821, WireGuard transport data (first word 0x04000000), source in @fwd_addr
              -> destination from the maps, source RELAY:51821, `fwd` to the next hop (map fwd_hop:
                 destination -> its gateway, or itself when on-link), out of the same interface

`inet plexd_relay`: every stable flow, for what the ingress table does not take (another interface, no next
hop yet, a kernel without `fwd`). Through the IP stack:

    prerouting (raw):  the same match -> notrack, mark, destination rewritten from the maps
    postrouting:       marked -> source rewritten to RELAY:51821

The ingress path skips routing, the forward path and both netfilter hooks in the relay's namespace: in the lab,
relayed TCP went from ~89 % to ~96 % of the direct path's throughput (bench relay_bench). A packet it forwards
is re-sent as the userspace relay would send it (a new source, the TTL it came with), and plexd's own firewall
never sees it, as it sees none of the packets the userspace relay forwards either.

Stateless rewriting (notrack) rather than conntrack DNAT/SNAT: the flows already have conntrack entries from the
userspace relay, and a NAT rule is only consulted for a connection's first packet. Only transport data (type 4)
takes the fast path: handshakes (three packets every two minutes) still reach the userspace relay, so it keeps
learning indices and addresses; a side whose NAT remaps its port misses the maps, falls back to userspace, which
follows it, and the next sync moves the elements. A destination's next hop is looked up (`ip route get`) when it
first appears and again every `HOP_TTL` seconds. IPv4 only: IPv6 sides stay in userspace. The inet path needs
the machine to forward IPv4 on the relay's interface.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from plexd.base.errors import PlexdError
from plexd.bridge.flows import Flow
from plexd.bridge.sessions import Address
from plexd.mesh import rtnl

log = logging.getLogger(__name__)

FAMILY = "inet"
INGRESS_FAMILY = "netdev"
TABLE = "plexd_relay"
HOP_TTL = 30.0  # seconds a destination's next hop is trusted before it is looked up again
MARK = 0x706C7278  # "plrx": set and read only inside this table
TRANSPORT_WORD = 0x04000000  # WireGuard type 4 and three zero reserved bytes, big-endian

JSON = Any
Elements = dict[Address, Address]  # sender's current address -> the other side's current address
Hops = dict[str, str]  # a destination's address -> the next hop towards it on the ingress interface
HopLookup = Callable[[str], "tuple[int | None, str] | None"]  # address -> (interface index, next hop) or None


def desired_elements(flows: Iterable[Flow]) -> Elements:
    """Both directions of every stable IPv4 flow."""
    out: Elements = {}
    for flow in flows:
        if not flow.stable:
            continue
        a, b = flow.sides[0].address, flow.sides[1].address
        if not (_ipv4(a[0]) and _ipv4(b[0])) or a == b:
            continue
        out[a] = b
        out[b] = a
    return out


def table_commands(relay_ip: str, relay_port: int) -> list[JSON]:
    """Create (or reset) the table with its maps and the two rules; elements come from `element_commands`."""
    key = {"concat": [_payload("ip", "saddr"), _payload("udp", "sport")]}
    t = {"family": FAMILY, "table": TABLE}
    return [
        {"add": {"table": {"family": FAMILY, "name": TABLE}}},
        {"delete": {"table": {"family": FAMILY, "name": TABLE}}},
        {"add": {"table": {"family": FAMILY, "name": TABLE}}},
        {"add": {"map": {**t, "name": "fwd_addr", "type": ["ipv4_addr", "inet_service"], "map": "ipv4_addr"}}},
        {"add": {"map": {**t, "name": "fwd_port", "type": ["ipv4_addr", "inet_service"], "map": "inet_service"}}},
        {"add": {"chain": {**t, "name": "prerouting", "type": "filter", "hook": "prerouting", "prio": -300,
                           "policy": "accept"}}},
        {"add": {"chain": {**t, "name": "postrouting", "type": "filter", "hook": "postrouting", "prio": 100,
                           "policy": "accept"}}},
        {"add": {"rule": {**t, "chain": "prerouting", "expr": [
            _eq(_payload("ip", "daddr"), relay_ip),
            _eq(_payload("udp", "dport"), relay_port),
            _eq({"payload": {"base": "th", "offset": 64, "len": 32}}, TRANSPORT_WORD),
            _eq(key, "@fwd_addr"),
            {"notrack": None},
            {"mangle": {"key": {"meta": {"key": "mark"}}, "value": MARK}},
            {"mangle": {"key": _payload("ip", "daddr"), "value": {"map": {"key": key, "data": "@fwd_addr"}}}},
            {"mangle": {"key": _payload("udp", "dport"), "value": {"map": {"key": key, "data": "@fwd_port"}}}},
            {"counter": None},
        ]}}},
        {"add": {"rule": {**t, "chain": "postrouting", "expr": [
            _eq({"meta": {"key": "mark"}}, MARK),
            {"mangle": {"key": _payload("ip", "saddr"), "value": relay_ip}},
            {"mangle": {"key": _payload("udp", "sport"), "value": relay_port}},
            {"counter": None},
        ]}}},
    ]


def ingress_table_commands(relay_ip: str, relay_port: int, device: str) -> list[JSON]:
    """Create (or reset) the ingress table on `device`; elements come from `element_commands`/`hop_commands`."""
    key = {"concat": [_payload("ip", "saddr"), _payload("udp", "sport")]}
    t = {"family": INGRESS_FAMILY, "table": TABLE}
    return [
        {"add": {"table": {"family": INGRESS_FAMILY, "name": TABLE}}},
        {"delete": {"table": {"family": INGRESS_FAMILY, "name": TABLE}}},
        {"add": {"table": {"family": INGRESS_FAMILY, "name": TABLE}}},
        {"add": {"map": {**t, "name": "fwd_addr", "type": ["ipv4_addr", "inet_service"], "map": "ipv4_addr"}}},
        {"add": {"map": {**t, "name": "fwd_port", "type": ["ipv4_addr", "inet_service"], "map": "inet_service"}}},
        {"add": {"map": {**t, "name": "fwd_hop", "type": "ipv4_addr", "map": "ipv4_addr"}}},
        {"add": {"chain": {**t, "name": "ingress", "type": "filter", "hook": "ingress", "dev": device,
                           "prio": -300, "policy": "accept"}}},
        {"add": {"rule": {**t, "chain": "ingress", "expr": [
            _eq(_payload("ip", "daddr"), relay_ip),
            _eq(_payload("udp", "dport"), relay_port),
            _eq({"payload": {"base": "th", "offset": 64, "len": 32}}, TRANSPORT_WORD),
            _eq(key, "@fwd_addr"),
            {"counter": None},
            # the destination first: both lookups are keyed by the source, rewritten next
            {"mangle": {"key": _payload("ip", "daddr"), "value": {"map": {"key": key, "data": "@fwd_addr"}}}},
            {"mangle": {"key": _payload("udp", "dport"), "value": {"map": {"key": key, "data": "@fwd_port"}}}},
            {"mangle": {"key": _payload("ip", "saddr"), "value": relay_ip}},
            {"mangle": {"key": _payload("udp", "sport"), "value": relay_port}},
            {"fwd": {"dev": device, "family": "ip",
                     "addr": {"map": {"key": _payload("ip", "daddr"), "data": "@fwd_hop"}}}},
        ]}}},
    ]


def element_commands(desired: Mapping[Address, Address], current: Mapping[Address, Address],
                     family: str = FAMILY) -> list[JSON]:
    """The element changes taking `family`'s maps from `current` to `desired` (a changed value is delete + add)."""
    gone = [k for k, v in current.items() if desired.get(k) != v]
    new = [k for k, v in desired.items() if current.get(k) != v]
    commands: list[JSON] = []
    for verb, keys in (("delete", gone), ("add", new)):
        if not keys:
            continue
        source = current if verb == "delete" else desired
        for name, value in (("fwd_addr", lambda a: a[0]), ("fwd_port", lambda a: a[1])):
            commands.append({verb: {"element": {"family": family, "table": TABLE, "name": name,
                                                "elem": [[_concat(k), value(source[k])] for k in sorted(keys)]}}})
    return commands


def hop_commands(desired: Hops, current: Hops) -> list[JSON]:
    """The `fwd_hop` changes from `current` to `desired`."""
    commands: list[JSON] = []
    for verb, source, other in (("delete", current, desired), ("add", desired, current)):
        keys = sorted(k for k, v in source.items() if other.get(k) != v)
        if keys:
            commands.append({verb: {"element": {"family": INGRESS_FAMILY, "table": TABLE, "name": "fwd_hop",
                                                "elem": [[k, source[k]] for k in keys]}}})
    return commands


def ingress_elements(elements: Elements, hops: Mapping[str, str | None]) -> tuple[Elements, Hops]:
    """The elements the ingress table takes (their destination has a next hop) and those destinations' hops."""
    taken = {k: v for k, v in elements.items() if hops.get(v[0])}
    return taken, {v[0]: str(hops[v[0]]) for v in taken.values()}


def remove_commands() -> list[JSON]:
    return [{"add": {"table": {"family": family, "name": TABLE}}} for family in (FAMILY, INGRESS_FAMILY)] + \
           [{"delete": {"table": {"family": family, "name": TABLE}}} for family in (FAMILY, INGRESS_FAMILY)]


def route_hop(address: str) -> tuple[int | None, str] | None:
    """The interface and next hop the kernel would send packets to `address` by; None: no unicast route."""
    route = rtnl.route_get(address)
    if route is None or route.type != 1:  # RTN_UNICAST: not local, blackhole, unreachable
        return None
    return route.oif, route.gateways[0] if route.gateways else address


def ingress_device(relay_ip: str) -> tuple[int, str] | None:
    """The (index, name) of the interface holding `relay_ip`, None when it is only on loopback or nowhere."""
    index = next((a.index for a in rtnl.dump_addresses() if a.address == relay_ip), None)
    if index is None:
        return None
    name = rtnl.link_names().get(index)
    return None if name in (None, "lo") else (index, name)


class KernelFastPath:
    """Keeps both `plexd_relay` tables equal to the relay's stable flows (apply, sync, remove) through
    libnftables. The ingress table is optional: without it (no interface holds the address, or the kernel
    refuses it: `ingress_error`) the inet table alone forwards."""

    def __init__(self, relay_ip: str, relay_port: int, nft: Any = None, *,
                 device: Callable[[str], tuple[int, str] | None] = ingress_device, hop: HopLookup = route_hop,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from plexd.firewall.nft import Nftables  # the firewall's libnftables wrapper (pip-nftables)

        if not _ipv4(relay_ip):
            raise ValueError(f"the kernel fast path needs the relay's IPv4 address, not {relay_ip!r}")
        self.relay_ip, self.relay_port = relay_ip, relay_port
        self.nft = nft or Nftables()
        self.current: Elements = {}
        self.installed = False
        self.syncs = 0
        self._device_of, self._hop_of, self._clock = device, hop, clock
        self.device: tuple[int, str] | None = None
        self.ingress_current: Elements = {}
        self.hops_current: Hops = {}
        self.ingress_installed = False
        self.ingress_error = ""
        self._hops: dict[str, tuple[float, str | None]] = {}  # destination -> (looked up at, next hop or None)

    def apply(self) -> None:
        self.nft.run(table_commands(self.relay_ip, self.relay_port))
        self.current = {}
        self.installed = True
        self._apply_ingress()

    def _apply_ingress(self) -> None:
        self.ingress_current, self.hops_current, self.ingress_installed = {}, {}, False
        try:
            self.device = self._device_of(self.relay_ip)
        except OSError as e:
            self.device, self.ingress_error = None, f"finding the interface of {self.relay_ip}: {e}"
            return
        if self.device is None:  # only on loopback, or not here yet: the inet table forwards
            self.ingress_error = ""
            return
        try:
            self.nft.run(ingress_table_commands(self.relay_ip, self.relay_port, self.device[1]))
        except PlexdError as e:
            self.ingress_error = f"ingress table on {self.device[1]}: {e}"
            return
        self.ingress_installed, self.ingress_error = True, ""

    def sync(self, flows: Iterable[Flow]) -> int:
        """Bring the maps to the stable flows; returns how many inet elements changed (one transaction each)."""
        if not self.installed:
            self.apply()
        desired = desired_elements(flows)
        commands = element_commands(desired, self.current)
        changed = 0
        if commands:
            self.nft.run(commands)
            changed = len(set(desired.items()) ^ set(self.current.items()))
            self.current = desired
            self.syncs += 1
        self._sync_ingress(desired)
        return changed

    def _sync_ingress(self, desired: Elements) -> None:
        if self.device is None:
            return
        if not self.ingress_installed:
            if self.ingress_error:  # refused: tried again when the table is applied anew, not every second
                return
            self._apply_ingress()
            if not self.ingress_installed:
                return
        elements, hops = ingress_elements(desired, self._next_hops({v[0] for v in desired.values()}))
        commands = element_commands(elements, self.ingress_current, INGRESS_FAMILY) + \
            hop_commands(hops, self.hops_current)
        if commands:
            self.nft.run(commands)
            self.ingress_current, self.hops_current = elements, hops

    def _next_hops(self, destinations: set[str]) -> dict[str, str | None]:
        """Each destination's next hop out of the ingress interface (None: another interface or no route)."""
        assert self.device is not None
        now = self._clock()
        for gone in set(self._hops) - destinations:
            del self._hops[gone]
        for dst in destinations:
            looked, _ = self._hops.get(dst, (None, None))
            if looked is None or now - looked >= HOP_TTL:
                try:
                    found = self._hop_of(dst)
                except OSError:
                    found = None
                hop = found[1] if found is not None and found[0] == self.device[0] else None
                self._hops[dst] = (now, hop)
        return {dst: self._hops[dst][1] for dst in destinations}

    def remove(self) -> None:
        self.nft.run(remove_commands())
        self.current, self.ingress_current, self.hops_current = {}, {}, {}
        self.installed = self.ingress_installed = False


def _ipv4(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False


def _payload(protocol: str, field: str) -> JSON:
    return {"payload": {"protocol": protocol, "field": field}}


def _eq(left: JSON, right: JSON) -> JSON:
    return {"match": {"op": "==", "left": left, "right": right}}


def _concat(address: Address) -> JSON:
    return {"concat": [address[0], address[1]]}
