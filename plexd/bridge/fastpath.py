"""The kernel fast path: stable relay flows forwarded by nftables, with no per-packet Python.

Table `inet plexd_relay`, the relay's own (plexd's firewall table `inet plexd` is never touched). Per session two
map elements, one per direction, keyed by the sending side's current address:

    map fwd_addr { ipv4_addr . inet_service : ipv4_addr }      A_ip . A_port -> B_ip   (and B -> A)
    map fwd_port { ipv4_addr . inet_service : inet_service }   A_ip . A_port -> B_port
    prerouting (raw):  to RELAY:51821, WireGuard transport data (first word 0x04000000): destination rewritten
                       from the maps (a source not in them ends the rule), notrack, mark
    postrouting:       marked -> source rewritten to RELAY:51821

Stateless rewriting (notrack) rather than conntrack DNAT/SNAT: the flows already have conntrack entries from the
userspace relay, and a NAT rule is only consulted for a connection's first packet. Only transport data (type 4)
takes the fast path: handshakes (three packets every two minutes) still reach the userspace relay, so it keeps
learning indices and addresses; a side whose NAT remaps its port misses the map, falls back to userspace, which
follows it, and the next sync moves the element. IPv4 only: IPv6 sides stay in userspace. The machine must
forward IPv4 on the relay's interface (the bridge domain will own that sysctl and restore it).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from plexd.bridge.flows import Flow
from plexd.state.relay_block import Address

log = logging.getLogger(__name__)

FAMILY = "inet"
TABLE = "plexd_relay"
MARK = 0x706C7278  # "plrx": set and read only inside this table
TRANSPORT_WORD = 0x04000000  # WireGuard type 4 and three zero reserved bytes, big-endian

JSON = Any
Elements = dict[Address, Address]  # sender's current address -> the other side's current address


def desired_elements(flows: Iterable[Flow]) -> Elements:
    """Both directions of every stable IPv4 flow, but for a sender in more than one: a node in two relay
    sessions from one port has one key here and two destinations, which only the userspace relay (by the
    packet's receiver index) tells apart. Its packets stay there; the other sides' still take the fast path."""
    out: Elements = {}
    shared: set[Address] = set()
    for flow in flows:
        if not flow.stable:
            continue
        a, b = flow.sides[0].address, flow.sides[1].address
        if not (_ipv4(a[0]) and _ipv4(b[0])) or a == b:
            continue
        for sender, receiver in ((a, b), (b, a)):
            if out.get(sender, receiver) != receiver:
                shared.add(sender)
            out[sender] = receiver
    for sender in shared:
        del out[sender]
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
            # The map lookups come first and are the membership test too: a sender not in the maps ends the rule
            # there (a lookup that misses stops it), before anything is changed. Matching `@fwd_addr` as a set
            # first read better, but kernels before 6.4 refuse a map used as a set (EINVAL): Debian 12's 6.1.
            {"mangle": {"key": _payload("ip", "daddr"), "value": {"map": {"key": key, "data": "@fwd_addr"}}}},
            {"mangle": {"key": _payload("udp", "dport"), "value": {"map": {"key": key, "data": "@fwd_port"}}}},
            {"notrack": None},
            {"mangle": {"key": {"meta": {"key": "mark"}}, "value": MARK}},
            {"counter": None},
        ]}}},
        {"add": {"rule": {**t, "chain": "postrouting", "expr": [
            _eq({"meta": {"key": "mark"}}, MARK),
            {"mangle": {"key": _payload("ip", "saddr"), "value": relay_ip}},
            {"mangle": {"key": _payload("udp", "sport"), "value": relay_port}},
            {"counter": None},
        ]}}},
    ]


def element_commands(desired: Mapping[Address, Address], current: Mapping[Address, Address]) -> list[JSON]:
    """The element changes taking the maps from `current` to `desired` (a changed value is delete + add)."""
    gone = [k for k, v in current.items() if desired.get(k) != v]
    new = [k for k, v in desired.items() if current.get(k) != v]
    commands: list[JSON] = []
    for verb, keys in (("delete", gone), ("add", new)):
        if not keys:
            continue
        source = current if verb == "delete" else desired
        for name, value in (("fwd_addr", lambda a: a[0]), ("fwd_port", lambda a: a[1])):
            commands.append({verb: {"element": {"family": FAMILY, "table": TABLE, "name": name,
                                                "elem": [[_concat(k), value(source[k])] for k in sorted(keys)]}}})
    return commands


def remove_commands() -> list[JSON]:
    return [{"add": {"table": {"family": FAMILY, "name": TABLE}}},
            {"delete": {"table": {"family": FAMILY, "name": TABLE}}}]


class KernelFastPath:
    """Keeps `inet plexd_relay` equal to the relay's stable flows (apply, sync, remove) through libnftables."""

    def __init__(self, relay_ip: str, relay_port: int, nft: Any = None) -> None:
        from plexd.machine.nft import Nftables  # the firewall's libnftables wrapper (pip-nftables)

        if not _ipv4(relay_ip):
            raise ValueError(f"the kernel fast path needs the relay's IPv4 address, not {relay_ip!r}")
        self.relay_ip, self.relay_port = relay_ip, relay_port
        self.nft = nft or Nftables()
        self.current: Elements = {}
        self.installed = False
        self.syncs = 0

    def apply(self) -> None:
        self.nft.run(table_commands(self.relay_ip, self.relay_port))
        self.current = {}
        self.installed = True

    def sync(self, flows: Iterable[Flow]) -> int:
        """Bring the maps to the stable flows; returns how many elements changed (one transaction)."""
        if not self.installed:
            self.apply()
        desired = desired_elements(flows)
        commands = element_commands(desired, self.current)
        if commands:
            self.nft.run(commands)
            changed = len(set(desired.items()) ^ set(self.current.items()))
            self.current = desired
            self.syncs += 1
            return changed
        return 0

    def remove(self) -> None:
        self.nft.run(remove_commands())
        self.current = {}
        self.installed = False


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
