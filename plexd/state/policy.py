"""The policy engine (pure, docs/protocol.md §9): which peers this node may see, and which flows it lets in.

A rule names its two ends as a node id, `*` (anyone), or a CIDR inside the mesh range ([R]; the Go engine
matches nothing for a CIDR). `protocol` is tcp, udp, icmp or "" (any); `port` 0 is any port and needs tcp or
udp otherwise (a port with "" means tcp or udp on that port); `action` allow or deny.

- Visibility (§9.2): no rules, no peers; a peer is visible iff some valid `allow` rule has this node on one end and
  the peer on the other. Allows are bidirectional here; deny rules never hide a peer.
- Filtering: a rule applies to a flow whose source matches `src` and whose destination matches `dst`, in policy
  order, first match wins, the rest is dropped. The firewall (`plexd.firewall`) turns `inbound()` (rules whose
  `dst` covers this node) into the input chain and every rule into the forward chain. Replies of allowed flows pass
  as established connections, so an allow is one-directional for traffic.

A rule that cannot be used is skipped with the reason (`CompiledPolicy.skipped`), and the rest applies. A rule
naming a node that is neither this node nor one of its peers is kept: it matches nothing until that node
appears, and then only a set element changes.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from plexd.base.memo import ByIdentity
from plexd.base.mesh_caches import bounded_by_mesh
from plexd.state.model import Peer, Policy, PolicyRule

ANY = "*"
PROTOCOLS = ("tcp", "udp", "icmp", "")
ACTIONS = ("allow", "deny")
DEFAULT_MESH_RANGE = ("10.100.0.0/16",)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Selector:
    """One end of a rule."""

    kind: Literal["any", "node", "cidr"]
    value: str = ""  # the node id, or the CIDR in its normal form

    @functools.cached_property
    def network(self) -> IPNetwork | None:
        return ipaddress.ip_network(self.value) if self.kind == "cidr" else None

    def matches(self, node_id: str, address: IPAddress | None) -> bool:
        if self.kind == "any":
            return True
        if self.kind == "node":
            return node_id == self.value
        net = self.network
        return address is not None and net is not None and address.version == net.version and address in net

    def __str__(self) -> str:
        return "*" if self.kind == "any" else self.value


@dataclass(frozen=True)
class Rule:
    """A usable rule, with where it came from (policy id, index in that policy's rules)."""

    policy_id: str
    index: int
    src: Selector
    dst: Selector
    protocol: str  # tcp, udp, icmp, "" (any)
    port: int  # 0: any
    action: str  # allow, deny

    @property
    def label(self) -> str:
        return f"policy {self.policy_id} rule {self.index}"

    def describe(self) -> str:
        what = self.protocol or "any"
        if self.port:
            what += f"/{self.port}"
        return f"{self.action} {what} from {self.src} to {self.dst}"


@dataclass(frozen=True)
class Skipped:
    policy_id: str
    index: int | None  # None: the whole policy
    reason: str

    @property
    def label(self) -> str:
        shown = self.policy_id or "(no id)"
        return f"policy {shown}" if self.index is None else f"policy {shown} rule {self.index}"

    def __str__(self) -> str:
        return f"{self.label}: {self.reason}"


@dataclass(frozen=True)
class CompiledPolicy:
    """The policies as this node applies them."""

    node_id: str
    addresses: frozenset[IPAddress]  # this node's own mesh addresses
    rules: tuple[Rule, ...]
    skipped: tuple[Skipped, ...]

    def _is_self(self, sel: Selector) -> bool:
        return sel.kind == "any" or any(sel.matches(self.node_id, a) for a in self.addresses) or (
            sel.kind == "node" and sel.value == self.node_id)

    @functools.cached_property
    def _allows(self) -> tuple[tuple[Rule, bool, bool], ...]:
        # (rule, src covers this node, dst covers this node), allows only: the peer-visibility test per peer
        return tuple((r, self._is_self(r.src), self._is_self(r.dst)) for r in self.rules if r.action == "allow")

    def sees(self, peer: Peer) -> bool:
        """Whether some allow rule connects this node and `peer` (in either direction)."""
        address = mesh_address(peer)
        for rule, src_self, dst_self in self._allows:
            if (src_self and rule.dst.matches(peer.id, address)) or (
                    dst_self and rule.src.matches(peer.id, address)):
                return True
        return False

    def inbound(self) -> tuple[Rule, ...]:
        """Rules for traffic to this node: those whose destination covers it, in order."""
        return tuple(r for r in self.rules if self._is_self(r.dst))

    def forwarded(self) -> tuple[Rule, ...]:
        """Rules that can match traffic routed through this node: all but those whose destination is this node
        alone (a packet to this node's own address is delivered here, never forwarded), in order."""
        return tuple(r for r in self.rules if not (r.dst.kind == "node" and r.dst.value == self.node_id))

    def referenced_nodes(self) -> frozenset[str]:
        return self._referenced

    @functools.cached_property
    def _referenced(self) -> frozenset[str]:
        return frozenset(s.value for r in self.rules for s in (r.src, r.dst) if s.kind == "node")

    def unknown_nodes(self, peers: Mapping[str, Peer]) -> list[Skipped]:
        """Rules that name a node that is neither this node nor a peer: kept, matching nothing for now."""
        out = []
        for r in self.rules:
            for side, sel in (("src", r.src), ("dst", r.dst)):
                if sel.kind == "node" and sel.value != self.node_id and sel.value not in peers:
                    out.append(Skipped(r.policy_id, r.index,
                                       f"{side} names node {sel.value}, which is not a known node: "
                                       "it matches nothing until that node appears"))
        return out


def mesh_address(peer: Peer) -> IPAddress | None:
    return _address(peer.mesh_ip)


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def _address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text) if text and "%" not in text else None
    except ValueError:
        return None


_compiled = ByIdentity[CompiledPolicy]()


def compiled_for(policies: tuple[Policy, ...], node_id: str, own: tuple[str, ...],
                 mesh_range: tuple[str, ...] = DEFAULT_MESH_RANGE) -> CompiledPolicy:
    """`compile_policies`, looked up by the identity of the policies tuple first: every event's model shares the
    tuple of the one before, and hashing 1,000 rules per event would cost more than the event's whole apply."""
    return _compiled.get(policies, (node_id, own, mesh_range),
                         lambda: compile_policies(policies, node_id, own, mesh_range))


@functools.lru_cache(maxsize=8)
def compile_policies(policies: tuple[Policy, ...], node_id: str, own: tuple[str, ...],
                     mesh_range: tuple[str, ...] = DEFAULT_MESH_RANGE) -> CompiledPolicy:
    """Parse and check every rule. Cached: the same policies, node and range compile once."""
    ranges = [ipaddress.ip_network(r, strict=False) for r in mesh_range]
    addresses = frozenset(a for a in (_address(x) for x in own) if a is not None)
    rules: list[Rule] = []
    skipped: list[Skipped] = []
    seen_ids: set[str] = set()
    for pol in policies:
        if pol.problem:
            skipped.append(Skipped(pol.id, None, pol.problem))
            continue
        if not pol.id:
            skipped.append(Skipped("", None, "policy has no id"))
            continue
        if pol.id in seen_ids:
            skipped.append(Skipped(pol.id, None, "a policy with this id came earlier; this one is ignored"))
            continue
        seen_ids.add(pol.id)
        for i, raw in enumerate(pol.rules):
            rule_or_reason = _rule(pol.id, i, raw, ranges)
            if isinstance(rule_or_reason, str):
                skipped.append(Skipped(pol.id, i, rule_or_reason))
            else:
                rules.append(rule_or_reason)
    return CompiledPolicy(node_id, addresses, tuple(rules), tuple(skipped))


def _rule(policy_id: str, index: int, raw: PolicyRule, ranges: Iterable[IPNetwork]) -> Rule | str:
    if raw.problem:
        return raw.problem
    protocol = raw.protocol.lower()
    if protocol not in PROTOCOLS:
        return f"unknown protocol {raw.protocol[:20]!r} (tcp, udp, icmp or \"\" for any)"
    if not raw.action:
        return "action is missing (allow or deny)"
    if raw.action not in ACTIONS:
        return f"unknown action {raw.action[:20]!r} (allow or deny)"
    if not 0 <= raw.port <= 65535:
        return f"port {raw.port} is out of range (0 for any, or 1-65535)"
    if raw.port and protocol == "icmp":
        return "a port needs protocol tcp or udp (or \"\" for both), not icmp"
    ends = []
    for side, text in (("src", raw.src), ("dst", raw.dst)):
        sel = _selector(text, ranges)
        if isinstance(sel, str):
            return f"{side} {sel}"
        ends.append(sel)
    src, dst = ends
    if src.network is not None and dst.network is not None and src.network.version != dst.network.version:
        return "src and dst are CIDRs of different address families"
    return Rule(policy_id, index, src, dst, protocol, raw.port, raw.action)


def _selector(text: str, ranges: Iterable[IPNetwork]) -> Selector | str:
    if text == ANY:
        return Selector("any")
    if not text:
        return "is empty (a node id, a CIDR inside the mesh range, or \"*\")"
    if "/" in text or _address(text) is not None:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            return f"{text[:50]!r} is not a valid CIDR"
        if not any(net.version == r.version and net.subnet_of(r) for r in ranges):  # type: ignore[arg-type]
            return f"{net} is outside the mesh range {', '.join(str(r) for r in ranges)}"
        return Selector("cidr", str(net))
    if len(text) > 128 or not text.isprintable() or not text.isascii() or " " in text:
        return f"{text[:40]!r} is not a node id, a CIDR or \"*\""
    return Selector("node", text)
