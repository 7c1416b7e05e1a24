"""The firewall's diff (pure): `diff(want, live) -> [Change]`, and the one nftables transaction that applies them.

Each change is an instruction and a drift-report line, like the mesh's (`plexd.mesh.mesh_plan`). A rule that comes from
a policy is reported with the [C] names `policy_added` / `policy_removed` (detail `policy <id>: ...`, §4.4); the
table, the chains, the sets and the chains' own rules have names of ours:

    firewall_table_added        the table inet plexd was missing (flushed or deleted): created whole
    firewall_table_rebuilt      the table held something that cannot be changed in place (a set's type, a chain
                                plexd does not make, which a jump may reach; the table's flags, as dormant): rebuilt
    firewall_chain_added        a chain was missing: created with its rules
    firewall_chain_updated      a chain's hook, type, priority or policy was altered: recreated
    firewall_rule_added         a chain's own rule (established, log, default deny) was missing
    firewall_rule_removed       a rule plexd did not make (or an altered copy of one) was in its chains
    firewall_set_added          a node's address set was missing
    firewall_set_removed        a set no rule uses any more
    firewall_set_element_added / firewall_set_element_removed

Rules keep their order: the live rules that are already right and in the right order (the longest such run) are
kept; the others are deleted, and the missing ones inserted before the kept rule that follows them.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from plexd.converge.change import Change
from plexd.firewall.ruleset import (
    FAMILY,
    TABLE,
    UNKNOWN_HANDLE,
    ChainSpec,
    LiveChain,
    LiveRule,
    LiveSet,
    LiveTable,
    Ruleset,
    RuleSpec,
    SetSpec,
)
from plexd.firewall.script import table_script

JSON = Any
_T = {"family": FAMILY, "table": TABLE}
WHERE = f"table {FAMILY} {TABLE}"


@dataclass(frozen=True)
class FirewallChange(Change):
    """A change applied through nftables (`commands()` gives its part of the transaction)."""

    stage: ClassVar[int] = 0  # order inside the one transaction

    def commands(self) -> list[JSON]:  # pragma: no cover - every subclass overrides
        raise NotImplementedError


def _set_cmds(s: SetSpec) -> list[JSON]:
    out: list[JSON] = [{"add": {"set": {**_T, "name": s.name, "type": s.type}}}]
    if s.elements:
        out.append({"add": {"element": {**_T, "name": s.name, "elem": sorted(s.elements)}}})
    return out


def _chain_cmds(c: ChainSpec) -> list[JSON]:
    return [{"add": {"chain": {**_T, "name": c.name, "type": c.type, "hook": c.hook, "prio": c.prio,
                               "policy": c.policy}}},
            *({"add": {"rule": _rule(c.name, r)}} for r in c.rules)]


def _rule(chain: str, r: RuleSpec, position: int | None = None) -> JSON:
    body = {**_T, "chain": chain, "comment": r.comment, "expr": r.expr}
    if position is not None:
        body["handle"] = position
    return body


@dataclass(frozen=True)
class TableMissing(FirewallChange):
    stage: ClassVar[int] = 1
    want: Ruleset
    rebuilt: str = ""  # why an existing table is replaced (firewall_table_rebuilt)

    @property
    def correction_type(self) -> str:  # type: ignore[override]
        return "firewall_table_rebuilt" if self.rebuilt else "firewall_table_added"

    @property
    def detail(self) -> str:
        what = f"{len(self.want.chains)} chains, {self.want.rule_count()} rules, {len(self.want.sets)} sets"
        if self.rebuilt:
            return f"firewall: {WHERE}: {self.rebuilt}; rebuilt ({what})"
        return f"firewall: {WHERE} missing; created ({what})"

    def script(self) -> str:
        """The same transaction as an nft script (about twice as fast to apply); Unrenderable: use commands()."""
        return table_script(self.want, bool(self.rebuilt))

    def commands(self) -> list[JSON]:
        out: list[JSON] = []
        if self.rebuilt:
            out.append({"delete": {"table": {"family": FAMILY, "name": TABLE}}})
        out.append({"add": {"table": {"family": FAMILY, "name": TABLE}}})
        for s in self.want.sets.values():
            out += _set_cmds(s)
        for c in self.want.chains.values():
            out += _chain_cmds(c)
        return out


@dataclass(frozen=True)
class SetMissing(FirewallChange):
    correction_type: ClassVar[str] = "firewall_set_added"
    stage: ClassVar[int] = 2
    want: SetSpec

    @property
    def detail(self) -> str:
        return f"firewall: set {self.want.name} (node {self.want.node}) missing; created"

    def commands(self) -> list[JSON]:
        return _set_cmds(self.want)


@dataclass(frozen=True)
class SetElementsMissing(FirewallChange):
    correction_type: ClassVar[str] = "firewall_set_element_added"
    stage: ClassVar[int] = 3
    set_name: str
    node: str
    elements: frozenset[str]

    @property
    def detail(self) -> str:
        return f"firewall: set {self.set_name}: node {self.node} address {', '.join(sorted(self.elements))} missing"

    def commands(self) -> list[JSON]:
        return [{"add": {"element": {**_T, "name": self.set_name, "elem": sorted(self.elements)}}}]


@dataclass(frozen=True)
class ChainWrong(FirewallChange):
    correction_type: ClassVar[str] = "firewall_chain_updated"
    stage: ClassVar[int] = 5
    want: ChainSpec
    have: tuple[str, str, int, str]

    @property
    def detail(self) -> str:
        t, h, p, pol = self.have
        return (f"firewall: chain {self.want.name}: type {t or '-'} hook {h or '-'} priority {p} policy {pol or '-'}"
                f" != type {self.want.type} hook {self.want.hook} priority {self.want.prio} policy {self.want.policy};"
                " recreated")

    def commands(self) -> list[JSON]:
        ref = {**_T, "name": self.want.name}
        return [{"flush": {"chain": ref}}, {"delete": {"chain": ref}}, *_chain_cmds(self.want)]


@dataclass(frozen=True)
class ChainMissing(FirewallChange):
    correction_type: ClassVar[str] = "firewall_chain_added"
    stage: ClassVar[int] = 5
    want: ChainSpec

    @property
    def detail(self) -> str:
        return f"firewall: chain {self.want.name} missing; created with {len(self.want.rules)} rules"

    def commands(self) -> list[JSON]:
        return _chain_cmds(self.want)


@dataclass(frozen=True)
class RuleExtra(FirewallChange):
    stage: ClassVar[int] = 6
    chain: str
    handle: int
    comment: str

    @property
    def policy_id(self) -> str:
        # Our comments read "plexd:<digest> policy <id>"; a foreign rule has no policy.
        word = self.comment.split(" ", 2)
        if len(word) == 3 and word[0].startswith("plexd:") and word[1] == "policy":
            return word[2]
        return ""

    @property
    def correction_type(self) -> str:  # type: ignore[override]
        return "policy_removed" if self.policy_id else "firewall_rule_removed"

    @property
    def detail(self) -> str:
        what = f"rule handle {self.handle}" + (f" ({self.comment})" if self.comment else "")
        if self.policy_id:
            return f"policy {self.policy_id}: chain {self.chain}: {what} is not wanted; removed"
        if self.comment.split(" ", 2)[1:2] == ["session"]:  # "plexd:<digest> session <id>": that session ended
            return f"firewall: chain {self.chain}: {what}: its session is no longer granted; removed"
        return f"firewall: chain {self.chain}: {what} is not plexd's or was altered; removed"

    def commands(self) -> list[JSON]:
        return [{"delete": {"rule": {**_T, "chain": self.chain, "handle": self.handle}}}]


@dataclass(frozen=True)
class RuleMissing(FirewallChange):
    """Inserted in front of the kept rule after it (`before`, a handle), or appended (`before` None). Appending
    costs ~3 ms at any size; placing by handle makes libnftables load every rule of the table first (~30 ms at
    1,000 policy rules, measured with nftables 1.0.6; "add after a handle" is the same)."""

    stage: ClassVar[int] = 7
    chain: str
    rule: RuleSpec
    before: int | None

    @property
    def correction_type(self) -> str:  # type: ignore[override]
        return "policy_added" if self.rule.policy_id else "firewall_rule_added"

    @property
    def detail(self) -> str:
        if self.rule.policy_id:
            return f"policy {self.rule.policy_id}: chain {self.chain}: {self.rule.label} missing"
        return f"firewall: chain {self.chain}: {self.rule.label} rule missing"

    def commands(self) -> list[JSON]:
        if self.before is None:
            return [{"add": {"rule": _rule(self.chain, self.rule)}}]
        return [{"insert": {"rule": _rule(self.chain, self.rule, self.before)}}]


@dataclass(frozen=True)
class SetElementsExtra(FirewallChange):
    correction_type: ClassVar[str] = "firewall_set_element_removed"
    stage: ClassVar[int] = 8
    set_name: str
    elements: frozenset[str]

    @property
    def detail(self) -> str:
        return f"firewall: set {self.set_name}: unexpected address {', '.join(sorted(self.elements))}"

    def commands(self) -> list[JSON]:
        return [{"delete": {"element": {**_T, "name": self.set_name, "elem": sorted(self.elements)}}}]


@dataclass(frozen=True)
class SetExtra(FirewallChange):
    correction_type: ClassVar[str] = "firewall_set_removed"
    stage: ClassVar[int] = 9
    name: str

    @property
    def detail(self) -> str:
        return f"firewall: set {self.name} is not used by any rule; removed"

    def commands(self) -> list[JSON]:
        return [{"delete": {"set": {**_T, "name": self.name}}}]


@dataclass(frozen=True)
class TableExtra(FirewallChange):
    """Enforcement is off (`policy.enabled: false`) and the table of an earlier run would still filter."""

    correction_type: ClassVar[str] = "firewall_table_removed"
    stage: ClassVar[int] = 0

    @property
    def detail(self) -> str:
        return f"firewall: {WHERE} present while policy enforcement is off; removed"

    def commands(self) -> list[JSON]:
        return [{"delete": {"table": {"family": FAMILY, "name": TABLE}}}]


# -- the diff ----------------------------------------------------------------------------------------------------


def diff(want: Ruleset | None, live: LiveTable | None) -> list[FirewallChange]:
    """What turns `live` (None: no table) into `want` (None: no table), in transaction order."""
    if want is None:
        return [TableExtra()] if live is not None else []
    if live is None:
        return [TableMissing(want)]
    if live.unreadable:
        return [TableMissing(want, rebuilt=f"its listing cannot be read: {live.unreadable}")]
    if live.flags:  # dormant: every chain unhooked, nothing filtered, though every rule is in place
        return [TableMissing(want, rebuilt=f"the table is flagged {'/'.join(live.flags)}")]
    foreign = sorted(live.chains.keys() - want.chains.keys())
    if foreign:
        # A chain of someone else's may be the target of a jump in ours: deleting it first fails the whole
        # transaction (the kernel refuses to delete a chain still jumped to), at every converge. Deleting the
        # table takes the references with it.
        return [TableMissing(want, rebuilt=f"chain {foreign[0]} is not plexd's")]
    wrong_sets = [n for n, s in want.sets.items() if n in live.sets and
                  (live.sets[n].type != s.type or live.sets[n].flags)]
    if wrong_sets:
        # A set's type cannot change while rules use it; rebuilding the table is one transaction too.
        return [TableMissing(want, rebuilt=f"set {wrong_sets[0]} has type {live.sets[wrong_sets[0]].type} "
                                           f"{'/'.join(live.sets[wrong_sets[0]].flags)}".rstrip())]
    changes: list[FirewallChange] = []
    for name, s in want.sets.items():
        have = live.sets.get(name)
        if have is None:
            changes.append(SetMissing(s))
            continue
        if s.elements - have.elements:
            changes.append(SetElementsMissing(name, s.node, s.elements - have.elements))
        if have.elements - s.elements:
            changes.append(SetElementsExtra(name, have.elements - s.elements))
    for name, c in want.chains.items():
        have_chain = live.chains.get(name)
        if have_chain is None:
            changes.append(ChainMissing(c))
        elif have_chain.props != c.props():
            changes.append(ChainWrong(c, have_chain.props))
        else:
            changes.extend(_chain_rules(c, have_chain))
    for name in sorted(live.sets.keys() - want.sets.keys()):
        changes.append(SetExtra(name))
    return sorted(changes, key=lambda ch: ch.stage)


def diff_sets(want: Ruleset, live: LiveTable, names: Collection[str]) -> list[FirewallChange] | None:
    """The changes to the sets `names` alone (a peer event: the chains cannot have changed). None: a set is
    missing or has another type, which only the full diff handles."""
    changes: list[FirewallChange] = []
    for name in sorted(names):
        s, have = want.sets[name], live.sets.get(name)
        if have is None or have.type != s.type or have.flags:
            return None
        if s.elements - have.elements:
            changes.append(SetElementsMissing(name, s.node, s.elements - have.elements))
        if have.elements - s.elements:
            changes.append(SetElementsExtra(name, have.elements - s.elements))
    return sorted(changes, key=lambda ch: ch.stage)


def simulate_sets(live: LiveTable, want: Ruleset, names: Collection[str]) -> LiveTable:
    """`live` after a successful apply of `diff_sets(want, live, names)`: those sets as wanted, the rest as is."""
    sets = dict(live.sets)
    for name in names:
        s = want.sets[name]
        sets[name] = LiveSet(name, s.type, s.elements)
    return LiveTable(live.chains, sets)


def _chain_rules(want: ChainSpec, live: LiveChain) -> list[FirewallChange]:
    keys = [r.key for r in want.rules]
    if [r.key for r in live.rules] == keys:
        return []  # the usual case, in one comparison
    position = {k: i for i, k in enumerate(keys)}
    kept = _longest_in_order(live.rules, position)
    kept_ids = {id(r) for r in kept}  # not handles: rules plexd added on the event path share UNKNOWN_HANDLE
    out: list[FirewallChange] = [RuleExtra(want.name, r.handle, r.comment)
                                 for r in live.rules if id(r) not in kept_ids]
    kept_at = {position[r.key]: r.handle for r in kept}
    following: int | None = None
    missing: list[RuleMissing] = []
    for i in range(len(keys) - 1, -1, -1):  # from the end: each missing rule goes before the next kept one
        if i in kept_at:
            following = kept_at[i]
        else:
            missing.append(RuleMissing(want.name, want.rules[i], following))
    out.extend(reversed(missing))
    return out


def needs_unknown_handle(change: FirewallChange) -> bool:
    """Whether `change` names a rule by a handle nobody has read (0: a rule plexd added without asking nftables to
    echo its handle back). Only a table read can tell it: the event path leaves such changes to a full converge."""
    if isinstance(change, RuleExtra):
        return change.handle == UNKNOWN_HANDLE
    return isinstance(change, RuleMissing) and change.before == UNKNOWN_HANDLE


def _longest_in_order(live: Sequence[LiveRule], position: dict[str, int]) -> list[LiveRule]:
    """The longest run of live rules that are wanted and already in the wanted order (each key once)."""
    candidates = []
    seen: set[str] = set()
    for r in live:
        if r.key in position and r.key not in seen:
            seen.add(r.key)
            candidates.append(r)
    # Longest increasing subsequence of their wanted positions (patience sorting), O(n log n).
    tails: list[int] = []
    tail_idx: list[int] = []
    prev = [-1] * len(candidates)
    for i, r in enumerate(candidates):
        p = position[r.key]
        j = bisect.bisect_left(tails, p)
        if j == len(tails):
            tails.append(p)
            tail_idx.append(i)
        else:
            tails[j] = p
            tail_idx[j] = i
        prev[i] = tail_idx[j - 1] if j > 0 else -1
    out = []
    i = tail_idx[-1] if tail_idx else -1
    while i >= 0:
        out.append(candidates[i])
        i = prev[i]
    return out[::-1]


def commands(changes: Iterable[FirewallChange]) -> list[JSON]:
    """The one transaction (nftables applies a batch atomically: all of it or nothing)."""
    out: list[JSON] = []
    for c in sorted(changes, key=lambda ch: ch.stage):
        out.extend(c.commands())
    return out


def simulate(live: LiveTable | None, want: Ruleset | None) -> LiveTable | None:
    """The table after a successful apply of `diff(want, live)`: `want`, each rule with its handle from `live`,
    or UNKNOWN_HANDLE for a rule the apply added (the transaction is not echoed: that costs a whole-table load).
    A chain the apply left as it was is kept as it was (the usual case: an event changes a set element)."""
    if want is None:
        return None
    chains = {}
    for name, c in want.chains.items():
        have = live.chains.get(name) if live is not None else None
        if have is not None and have.props == c.props() and [r.key for r in have.rules] == [r.key for r in c.rules]:
            chains[name] = have
            continue
        old = {}
        if have is not None:
            for r in have.rules:
                old.setdefault(r.key, r.handle)
        rules = tuple(LiveRule(old.get(r.key, UNKNOWN_HANDLE), r.comment) for r in c.rules)
        chains[name] = LiveChain(name, c.props(), rules)
    sets = {n: LiveSet(n, s.type, s.elements) for n, s in want.sets.items()}
    return LiveTable(chains, sets)
