"""The firewall as plexd wants it, and as nftables shows it (pure).

One table, `inet plexd`, owned by plexd; nothing outside it is read or written. Two base chains, `input` (traffic
to this node) and `forward` (traffic through it), each filtering only packets that arrive on the mesh interface:

    iifname "plexd0" ct state established,related accept          replies of allowed flows
    iifname "plexd0" socket mark 0x706c1a2b ip saddr @node_n_a meta l4proto tcp counter accept
                                                                    an access session's listener (below)
    iifname "plexd0" ip saddr @node_n_a tcp dport 22 counter accept  one rule per policy rule, in policy order
    iifname "plexd0" limit rate 10/second log prefix "plexd denied "  with policy.log_denied
    iifname "plexd0" counter drop                                   default deny, counted

A rule naming a node matches that node's mesh address through a named set (`node_<id>`), so a node joining or
leaving changes one set element, never a chain. Every rule carries a comment `plexd:<digest> <origin>`: the digest
covers the chain, the policy and the expression (not the rule's position), and is how a live rule is recognised
as this one, unchanged.

An access session's listener (docs/protocol.md §A1.3) sits on a port the kernel chose, so its rules match
the listener's socket mark instead (`plexd.state.sessions_block.socket_marks`; the sessions domain marks the socket),
and they come from the sessions block and the policy alone: the policy's inbound rules for the service the session
stands for (tcp/22 for SSH, the target port for TCP, tcp/6443 for Kubernetes), in order, allows and denies alike,
each rewritten to match the session's socket instead of that port. A source the policy would not let reach the
service cannot reach the session; with no such rule nobody can (the default deny).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from plexd.base.memo import ByIdentity
from plexd.base.mesh_caches import bounded_by_mesh
from plexd.state.policy import CompiledPolicy, Rule, Selector

FAMILY = "inet"
TABLE = "plexd"
CHAINS = {"input": "input", "forward": "forward"}  # chain name -> hook
KEY_PREFIX = "plexd:"
COMMENT_MAX = 120  # nftables keeps at most 128 bytes of comment
LOG_PREFIX = "plexd denied "
LOG_RATE = 10  # per second: a flood of denied packets must not become a flood of log lines

JSON = Any


@dataclass(frozen=True)
class RuleSpec:
    key: str  # "plexd:<digest>", the first word of the comment
    comment: str
    expr_json: str  # the nftables JSON expression list, serialised (hashable)
    label: str  # for people: "policy web rule 0 (allow tcp/22 from n_a to *)", "default deny"
    policy_id: str = ""  # "" for the chain's own rules (established, log, default deny)
    rule_index: int = -1  # the rule's index in its policy

    @property
    def expr(self) -> list[JSON]:
        return json.loads(self.expr_json)


@dataclass(frozen=True)
class ChainSpec:
    name: str
    hook: str
    rules: tuple[RuleSpec, ...]
    type: str = "filter"
    prio: int = 0
    policy: str = "accept"  # the chain only drops mesh traffic, through its own last rule

    def props(self) -> tuple[str, str, int, str]:
        return (self.type, self.hook, self.prio, self.policy)


@dataclass(frozen=True)
class SetSpec:
    name: str
    type: str  # ipv4_addr / ipv6_addr
    elements: frozenset[str]
    node: str  # the node id whose addresses it holds


@dataclass(frozen=True)
class Ruleset:
    chains: Mapping[str, ChainSpec]
    sets: Mapping[str, SetSpec]

    def rule_count(self) -> int:
        return sum(len(c.rules) for c in self.chains.values())


# -- what nftables shows ------------------------------------------------------------------------------------------


UNKNOWN_HANDLE = 0  # nftables numbers from 1: a rule plexd added without reading its handle back


@dataclass(frozen=True)
class LiveRule:
    handle: int
    comment: str = ""
    packets: int = 0
    bytes: int = 0
    shape: int = 0  # a hash of what the rule does (its expressions, counters' values left out); 0: not read

    @functools.cached_property
    def key(self) -> str:  # cached: a diff at 1,000 rules asks ~100,000 times
        word = self.comment.split(" ", 1)[0]
        return word if word.startswith(KEY_PREFIX) else ""


@dataclass(frozen=True)
class LiveChain:
    name: str
    props: tuple[str, str, int, str]  # (type, hook, prio, policy); ("", "", 0, "") for a regular chain
    rules: tuple[LiveRule, ...] = ()


@dataclass(frozen=True)
class LiveSet:
    name: str
    type: str
    elements: frozenset[str] = frozenset()
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class LiveTable:
    chains: Mapping[str, LiveChain] = field(default_factory=dict)
    sets: Mapping[str, LiveSet] = field(default_factory=dict)
    flags: tuple[str, ...] = ()  # the table's own ("dormant" unhooks every chain: nothing is filtered)
    unreadable: str = ""  # why its listing could not be read (then nothing else here is known)


def parse_table(objects: list[JSON]) -> LiveTable | None:
    """`nft -j list table inet plexd` (the list under "nftables") → LiveTable; None when the table is absent."""
    chains: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[LiveRule]] = {}
    sets: dict[str, LiveSet] = {}
    found = False
    flags: tuple[str, ...] = ()
    for obj in objects:
        if not isinstance(obj, dict):
            continue
        if "table" in obj:
            found = True
            raw = obj["table"].get("flags") if isinstance(obj["table"], dict) else None
            flags = tuple(str(f) for f in raw) if isinstance(raw, list) else (str(raw),) if raw else ()
        elif "chain" in obj:
            c = obj["chain"]
            chains[c["name"]] = c
        elif "rule" in obj:
            r = obj["rule"]
            packets = nbytes = 0
            parts = []
            for e in r.get("expr") or []:
                if isinstance(e, dict) and isinstance(e.get("counter"), dict):
                    packets, nbytes = int(e["counter"].get("packets", 0)), int(e["counter"].get("bytes", 0))
                    parts.append("counter")
                else:
                    parts.append(repr(e))
            rules.setdefault(r["chain"], []).append(LiveRule(int(r["handle"]), str(r.get("comment", "")),
                                                             packets, nbytes, hash(tuple(parts)) or 1))
        elif "set" in obj:
            s = obj["set"]
            sets[s["name"]] = LiveSet(s["name"], str(s.get("type", "")), _elements(s.get("elem")),
                                      tuple(s.get("flags") or ()))
    if not found:
        return None
    live_chains = {
        name: LiveChain(name, (str(c.get("type", "")), str(c.get("hook", "")), int(c.get("prio", 0) or 0),
                               str(c.get("policy", ""))), tuple(rules.get(name, ())))
        for name, c in chains.items()}
    return LiveTable(live_chains, sets, flags)


def _elements(elem: JSON) -> frozenset[str]:
    """In Python's form, as the wanted side writes them: nft prints `::ffff:10.100.0.2` where Python writes
    `::ffff:a64:2`, and comparing the texts made such an element flap between added and removed."""
    out = set()
    for e in elem or ():
        if isinstance(e, dict) and "elem" in e:  # an element with a timeout or counter
            e = e["elem"].get("val")
        if isinstance(e, str):
            out.add(_as_python_writes(e))
        elif isinstance(e, dict) and "prefix" in e:  # interval sets print prefixes; ours are plain addresses
            out.add(_as_python_writes(f"{e['prefix']['addr']}/{e['prefix']['len']}"))
    return frozenset(out)


def _as_python_writes(text: str) -> str:
    try:
        return str(ipaddress.ip_network(text, strict=False)) if "/" in text else str(ipaddress.ip_address(text))
    except ValueError:
        return text  # not an address: compared as it is (and removed as foreign)


# -- what plexd wants --------------------------------------------------------------------------------------------


_SET_SAFE = re.compile(r"[A-Za-z0-9_]{1,48}")


def set_name(node_id: str) -> str:
    """The set holding a node's addresses. Node ids are printable ASCII; what a set name cannot hold is hashed."""
    if _SET_SAFE.fullmatch(node_id):
        return f"node_{node_id}"
    return "node_h" + hashlib.sha256(node_id.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class SessionGate:
    """An access session's listener as the firewall sees it: the socket mark and the service port it stands for."""

    session_id: str
    mark: int
    service_port: int


@dataclass(frozen=True)
class TunnelGuard:
    """A site-to-site tunnel: what arrives on it may reach its local subnets, and nothing else."""

    interface: str
    local_subnets: tuple[str, ...]


@dataclass(frozen=True)
class BridgeGuards:
    """A bridge's other interfaces: the access interface, policed by the policy as the mesh interface is (its
    peers are sources like any other: a rule allowing their prefix lets them through, nothing else does), and
    the site-to-site tunnels."""

    access_interface: str = ""
    tunnels: tuple[TunnelGuard, ...] = ()


def desired_ruleset(compiled: CompiledPolicy, interface: str, addresses: Mapping[str, str],
                    log_denied: bool, sessions: tuple[SessionGate, ...] = (),
                    bridge: BridgeGuards = BridgeGuards()) -> Ruleset:
    """The table for these policies. `addresses`: node id -> its mesh address, for every node a rule names
    (this node included); a node not in it gets an empty set. `sessions`: the live access sessions' gates."""
    chains = _chains(compiled, interface, log_denied, tuple(sorted(
        (n, _family(addresses.get(n, ""))) for n in compiled.referenced_nodes())), sessions, bridge)
    sets = {}
    for node in compiled.referenced_nodes():
        spec = node_set(node, addresses.get(node, ""))
        sets[spec.name] = spec
    return Ruleset(chains, sets)


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def node_set(node: str, address: str) -> SetSpec:
    """The set of one node a rule names: its address ("" while the node is unknown: an empty set). Cached, as
    `_family`: a policy change builds the sets of every node its rules name, nearly all of them as before."""
    name = set_name(node)
    return SetSpec(name, "ipv6_addr" if _family(address) == 6 else "ipv4_addr",
                   frozenset({_normal(address)}) if address else frozenset(), node)


_chain_cache = ByIdentity[Mapping[str, ChainSpec]]()


def _chains(compiled: CompiledPolicy, interface: str, log_denied: bool, families: tuple[tuple[str, int], ...],
            sessions: tuple[SessionGate, ...], bridge: BridgeGuards) -> Mapping[str, ChainSpec]:
    """The chains depend on the policies, not on the peers: built once per policy version (1,000 rules take
    milliseconds to build, and a peer event must not pay that). By identity: `compile_policies` returns the same
    object for the same policies, and hashing 1,000 rules per event would cost what the cache saves."""
    return _chain_cache.get(compiled, (interface, log_denied, families, sessions, bridge),
                            lambda: _build_chains(compiled, interface, log_denied, families, sessions, bridge))


def _build_chains(compiled: CompiledPolicy, interface: str, log_denied: bool, families: tuple[tuple[str, int], ...],
                  sessions: tuple[SessionGate, ...], bridge: BridgeGuards) -> Mapping[str, ChainSpec]:
    family_of = dict(families)
    out = {}
    policed = [interface] + ([bridge.access_interface] if bridge.access_interface else [])
    for name, hook in CHAINS.items():
        rules: list[RuleSpec] = []
        # forward leaves out the rules to this node alone: they could never match there, and every rule in the
        # table makes a positioned insert slower (libnftables reads all of them first)
        source = compiled.inbound() if name == "input" else compiled.forwarded()
        for iface in policed:
            rules.append(_base(name, "established", iface, [_ct_established(), {"accept": None}]))
            copies: dict[tuple[str, str], int] = {}
            if name == "input" and iface == interface:
                for gate in sessions:
                    rules.extend(_session_rules(gate, source, iface, family_of, copies))
            for r in source:
                if iface == interface or r.src.kind != "node":  # an access peer is never a node
                    rules.extend(_policy_rules(name, r, iface, family_of, name == "input", copies))
            if log_denied:
                rules.append(_base(name, "log denied", iface, [
                    {"limit": {"rate": LOG_RATE, "burst": 5 * LOG_RATE, "per": "second"}},
                    {"log": {"prefix": f"{LOG_PREFIX}{name}: ", "level": "info"}}]))
            rules.append(_base(name, "default deny", iface, [{"counter": None}, {"drop": None}]))
        for tunnel in bridge.tunnels:
            rules.extend(_tunnel_rules(name, tunnel))
        out[name] = ChainSpec(name, hook, tuple(rules))
    return out


def _tunnel_rules(chain: str, tunnel: TunnelGuard) -> list[RuleSpec]:
    """Replies pass; new traffic from a remote site may go to its local subnets (forward), nowhere else."""
    iface = tunnel.interface
    out = [_base(chain, "established", iface, [_ct_established(), {"accept": None}])]
    if chain == "forward":
        for cidr in tunnel.local_subnets:
            sel = Selector("cidr", cidr)
            family = sel.network.version if sel.network is not None else 4
            expr = [_iif(iface), *_address_match(sel, "daddr", family), {"counter": None}, {"accept": None}]
            out.append(_spec(chain, _serialised(expr), f"site-to-site {iface} to {cidr}", "",
                             f"site-to-site {iface}", 0))
    out.append(_base(chain, "default deny", iface, [{"counter": None}, {"drop": None}]))
    return out


def _iif(interface: str) -> JSON:
    return {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": interface}}


def _ct_established() -> JSON:
    return {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["established", "related"]}}


def _base(chain: str, label: str, interface: str, tail: list[JSON]) -> RuleSpec:
    return _spec(chain, _serialised([_iif(interface), *tail]), label, "", label.replace(" ", "-"), 0)


def _serialised(expr: list[JSON]) -> str:
    return json.dumps(expr, sort_keys=True, separators=(",", ":"))


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 14)
def _spec(chain: str, expr_json: str, label: str, policy_id: str, origin: str, copy: int,
          rule_index: int = -1) -> RuleSpec:
    """The key hashes what the rule is (chain, policy, expression), not where it stands: a rule inserted in front
    of others leaves their keys, and so the live rules, as they are. `copy` tells identical rules apart.
    Cached: a policy change rebuilds the chains, and all but the changed rules come out as before."""
    digest = hashlib.sha256(f"{chain}\0{policy_id}\0{expr_json}\0{copy}".encode()).hexdigest()[:16]
    key = KEY_PREFIX + digest
    comment = f"{key} {origin}"
    if len(comment.encode()) > COMMENT_MAX:
        comment = comment.encode()[:COMMENT_MAX].decode("ascii", "ignore")
    return RuleSpec(key, comment, expr_json, label, policy_id, rule_index)


def _policy_rules(chain: str, rule: Rule, interface: str, family_of: Mapping[str, int],
                  to_self: bool, copies: dict[tuple[str, str], int]) -> list[RuleSpec]:
    """One policy rule in one chain: one nftables rule per address family it can match (a rule between a v4
    CIDR and a node is v4 only; `*` to `*` needs no address match at all)."""
    out = []
    for family in _families(rule, family_of, to_self):
        label = f"{rule.label} ({rule.describe()})"
        expr_json = _rule_expr(interface, rule.src, None if to_self else rule.dst, rule.protocol, rule.port,
                               rule.action, family)
        seen = (rule.policy_id, expr_json)
        copy = copies.get(seen, 0)
        copies[seen] = copy + 1
        out.append(_spec(chain, expr_json, label, rule.policy_id, "policy " + _printable(rule.policy_id), copy,
                         rule.index))
    return out


def _session_rules(gate: SessionGate, inbound: tuple[Rule, ...], interface: str, family_of: Mapping[str, int],
                   copies: dict[tuple[str, str], int]) -> list[RuleSpec]:
    """The policy's inbound rules that decide who reaches `gate.service_port` over TCP, in order, each matching
    the session's listener socket instead of the port."""
    out = []
    for rule in inbound:
        if rule.protocol not in ("tcp", "") or rule.port not in (0, gate.service_port):
            continue
        for family in _families(rule, family_of, True):
            expr: list[JSON] = [_iif(interface), {"match": {"op": "==", "left": {"socket": {"key": "mark"}},
                                                             "right": gate.mark}}]
            expr += _address_match(rule.src, "saddr", family)
            expr += _l4("tcp", 0, family)
            expr += [{"counter": None}, {"accept": None} if rule.action == "allow" else {"drop": None}]
            expr_json = _serialised(expr)
            seen = (gate.session_id, expr_json)
            copy = copies.get(seen, 0)
            copies[seen] = copy + 1
            out.append(_spec("input", expr_json, f"session {gate.session_id} as {rule.label} ({rule.describe()})",
                             "", "session " + _printable(gate.session_id), copy))
    return out


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 14)
def _rule_expr(interface: str, src: Selector, dst: Selector | None, protocol: str, port: int, action: str,
               family: int) -> str:
    """A policy rule's expression, serialised. Cached by what it is made of, not by the rule (whose index, and so
    identity, shifts when a rule is inserted before it): a policy change rebuilds only what changed."""
    expr: list[JSON] = [_iif(interface)]
    expr += _address_match(src, "saddr", family)
    if dst is not None:
        expr += _address_match(dst, "daddr", family)
    expr += _l4(protocol, port, family)
    expr += [{"counter": None}, {"accept": None} if action == "allow" else {"drop": None}]
    return _serialised(expr)


def _families(rule: Rule, family_of: Mapping[str, int], to_self: bool) -> list[int]:
    """0: no address match, any family. Otherwise the families the addressed ends allow."""
    ends = [rule.src] if to_self else [rule.src, rule.dst]
    wanted: set[int] = set()
    for sel in ends:
        if sel.kind == "cidr" and sel.network is not None:
            wanted.add(sel.network.version)
        elif sel.kind == "node":
            wanted.add(family_of.get(sel.value, 4))
    if not wanted:
        return [0] if rule.protocol != "icmp" else [4, 6]
    if len(wanted) > 1:
        return []  # a v4 end and a v6 end: no packet has both; the rule matches nothing
    return sorted(wanted)


def _address_match(sel: Selector, field_name: str, family: int) -> list[JSON]:
    if sel.kind == "any":
        return []
    proto = "ip6" if family == 6 else "ip"
    left = {"payload": {"protocol": proto, "field": field_name}}
    if sel.kind == "node":
        return [{"match": {"op": "==", "left": left, "right": "@" + set_name(sel.value)}}]
    net = sel.network
    assert net is not None
    right: JSON = str(net.network_address) if net.prefixlen == net.max_prefixlen else {
        "prefix": {"addr": str(net.network_address), "len": net.prefixlen}}
    return [{"match": {"op": "==", "left": left, "right": right}}]


def _l4(protocol: str, port: int, family: int) -> list[JSON]:
    l4proto = {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}}}
    if protocol == "icmp":
        return [_with_right(l4proto, "ipv6-icmp" if family == 6 else "icmp")]
    if not port:
        return [_with_right(l4proto, protocol)] if protocol else []
    protos: JSON = protocol if protocol else {"set": ["tcp", "udp"]}
    return [_with_right(l4proto, protos),
            {"match": {"op": "==", "left": {"payload": {"protocol": "th", "field": "dport"}}, "right": port}}]


def _with_right(match: JSON, right: JSON) -> JSON:
    return {"match": {**match["match"], "right": right}}


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def _family(address: str) -> int:
    """Cached, as `_normal`: every event asks again for every node a rule names (1,000 parses were ~25 ms)."""
    try:
        return ipaddress.ip_address(address).version if address else 4
    except ValueError:
        return 4


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def _normal(address: str) -> str:
    return str(ipaddress.ip_address(address))


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 12)
def _printable(text: str) -> str:
    return "".join(c if c.isprintable() and c.isascii() and c not in "\"\\" else "?" for c in text)
