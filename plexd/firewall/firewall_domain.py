"""The firewall domain: the table `inet plexd`, converged to the desired model's policies.

A full converge reads the table and diffs against it (drift is found and restored); an event (`apply_delta`)
diffs against the table as the last apply left it (no read: reading 1,000 rules costs ~90 ms, a set element
~4 ms), and if nftables refuses that (someone changed the table meanwhile) the engine reads it and tries again.

Enforcement that cannot be applied is never silent: the library or the kernel missing is one clear error at start,
and `status()` says `degraded` with the reason until an apply works again (status and heartbeat show it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from plexd.converge.domain import DomainResult
from plexd.firewall import plan
from plexd.firewall.ruleset import (
    FAMILY,
    TABLE,
    BridgeGuards,
    LiveTable,
    Ruleset,
    SessionGate,
    TunnelGuard,
    desired_ruleset,
    node_set,
    parse_table,
)
from plexd.firewall.script import Unrenderable
from plexd.machine.nft import FirewallError, Nftables, UnreadableTable
from plexd.state.desired import DesiredState
from plexd.state.sessions_block import Sessions, service_port, socket_marks

log = logging.getLogger(__name__)

REPROBE_INTERVAL = 30.0  # seconds between looks at whether nftables became usable


@dataclass(frozen=True)
class TableSeen:
    live: LiveTable | None  # None: no table
    error: str = ""  # the table could not be read, or nftables cannot be used here


class FirewallDomain:
    name = "firewall"
    touches_machine = True
    acts_while_held = False

    def __init__(self, interface: str, *, enabled: bool = True, log_denied: bool = False,
                 nft: Nftables | None = None, run_blocking: Callable[..., Any] | None = None,
                 bridge: bool = False) -> None:
        self.interface = interface
        self.bridge = bridge  # mode bridge: the access interface and the site-to-site tunnels are filtered too
        self.enabled = enabled
        self.log_denied = log_denied
        self.nft = nft or Nftables()
        self._run = run_blocking or asyncio.to_thread
        self._believed: LiveTable | None = None
        self._known = False  # _believed is the table as the last read and apply left it
        self._started = False
        self._inflight: asyncio.Future[Any] | None = None  # the last transaction sent, maybe still running
        self._want: tuple[DesiredState, Ruleset | None] | None = None  # the last model and its ruleset
        # The model and ruleset the table was last made to match (not only planned: a hold or a dry run plans
        # without applying, and the event path must not take a planned policy for an applied one).
        self._baseline: tuple[DesiredState, Ruleset | None] | None = None
        self._shapes: dict[tuple[str, str], int] = {}  # (chain, rule key) -> what that rule did when first read
        self.unavailable = ""  # nftables cannot be used at all (reason)
        self._probed_at = 0.0  # monotonic: when the last probe found it unavailable
        self.failure = ""  # the last apply failed (reason); cleared by the next that works
        self.held = ""  # the table differs from the policy and the last converge only planned it (why, for status)
        self.missing = ""  # the policy is wanted and no table is in place: nothing filters the mesh (why)

    # -- status ------------------------------------------------------------------------------------------------

    @property
    def enforcement(self) -> str:
        if not self.enabled:
            return "disabled"
        return "degraded" if self.unavailable or self.failure or self.held else "enforced"

    @property
    def reason(self) -> str:
        if not self.enabled:
            return "policy.enabled is false: peers are not filtered by policy and no firewall is applied"
        return self.unavailable or self.failure or self.held

    def status(self) -> dict[str, str]:
        return {"enforcement": self.enforcement, "reason": self.reason}

    @property
    def unenforced(self) -> str:
        """Why the policy is not enforced at all now ("" when it is, or with policy.enabled false, when there is no
        policy to enforce): nftables cannot be used, or no table is in place (flushed, and the last converge did not
        make it again: it failed, or only planned). A table in place but not current (a failed or held apply) still
        turns away what it does not name by its default deny, so it does not count."""
        return (self.unavailable or self.missing) if self.enabled else ""

    async def start(self) -> None:
        """Check once that nftables works here; say clearly what is missing if not (the node keeps running)."""
        self._started = True
        if not self.enabled:
            log.warning("policy enforcement is off (policy.enabled: false): every peer the control plane sends is "
                        "configured and no firewall filters the mesh interface")
            return
        try:
            await self._run(self.nft.probe)
        except FirewallError as e:
            self.unavailable = f"policy enforcement unavailable: {e}"
            self._probed_at = time.monotonic()
            log.error("%s; peers are still limited to those the policies allow, but traffic from them is not "
                      "filtered", self.unavailable)

    async def _probe_again(self) -> None:
        """While unavailable, look again now and then: the fix the message names (installing libnftables1,
        loading nf_tables) must not need a restart of plexd to take effect."""
        if time.monotonic() - self._probed_at < REPROBE_INTERVAL:
            return
        self._probed_at = time.monotonic()
        try:
            await self._run(self.nft.probe)
        except FirewallError:
            return
        log.warning("nftables can be used now: policy enforcement is being applied")
        self.unavailable = ""

    def want(self, desired: DesiredState) -> Ruleset | None:
        if self._want is not None and self._want[0] is desired:
            return self._want[1]
        ruleset = None
        if self.enabled and desired.enforce_policy:
            compiled = desired.compiled_policy
            addresses = {}
            for node in compiled.referenced_nodes():
                if node == desired.node_id:
                    addresses[node] = desired.mesh_ip
                else:
                    peer = desired.peers.get(node)
                    if peer is not None and peer.mesh_ip:
                        addresses[node] = peer.mesh_ip
            ruleset = desired_ruleset(compiled, desired.interface, addresses, self.log_denied,
                                      session_gates(desired.sessions), self._guards(desired))
        self._want = (desired, ruleset)
        return ruleset

    def _guards(self, desired: DesiredState) -> BridgeGuards:
        if not self.bridge:
            return BridgeGuards()
        access = desired.user_access
        tunnels = desired.site_to_site.tunnels if desired.site_to_site and desired.site_to_site.enabled else ()
        return BridgeGuards(access.interface if access is not None and access.enabled else "",
                            tuple(TunnelGuard(t.interface, t.local_subnets) for t in tunnels))

    async def read(self) -> LiveTable | None:
        objects = await self._run(self.nft.list_table, FAMILY, TABLE)
        return None if objects is None else self._unaltered(parse_table(objects))

    def _forget_shapes(self, changes: Sequence[plan.FirewallChange]) -> None:
        """What plexd writes is learned again at the next read: a rule it re-makes is right by definition (else a
        shape learned from a table altered before this process started would flag plexd's own rule forever)."""
        for c in changes:
            if isinstance(c, plan.TableMissing):
                self._shapes.clear()
                return
            if isinstance(c, plan.ChainWrong | plan.ChainMissing):
                self._shapes = {k: v for k, v in self._shapes.items() if k[0] != c.want.name}
            elif isinstance(c, plan.RuleMissing):
                self._shapes.pop((c.chain, c.rule.key), None)

    def _unaltered(self, live: LiveTable | None) -> LiveTable | None:
        """`live`, with a rule that carries one of plexd's comments but no longer does what it did when first
        read (`nft replace rule ... comment "plexd:..."`: a deny made an accept) shown as the foreign rule it is:
        the diff then deletes it and puts plexd's back. The comment's digest alone cannot tell."""
        if live is None:
            return None
        chains = dict(live.chains)
        for name, chain in live.chains.items():
            altered = [i for i, rule in enumerate(chain.rules) if rule.key and rule.shape
                       and self._shapes.setdefault((name, rule.key), rule.shape) != rule.shape]
            if altered:  # (the usual read alters nothing and copies nothing)
                rules = list(chain.rules)
                for i in altered:
                    log.warning("firewall: chain %s: rule %s was changed in place; it is replaced", name, rules[i].key)
                    rules[i] = replace(rules[i], comment="(altered) " + rules[i].comment)
                chains[name] = replace(chain, rules=tuple(rules))
        if len(self._shapes) > 4 * (sum(len(c.rules) for c in live.chains.values()) + 64):
            present = {(name, r.key) for name, c in live.chains.items() for r in c.rules}
            self._shapes = {k: v for k, v in self._shapes.items() if k in present}
        return replace(live, chains=chains) if chains != live.chains else live

    # -- the domain --------------------------------------------------------------------------------------------

    async def observe(self, desired: DesiredState) -> TableSeen:
        if not self._started:
            await self.start()
        if self.unavailable:
            await self._probe_again()
        if self.unavailable:
            return TableSeen(None, self.unavailable)
        try:
            return TableSeen(await self.read())
        except UnreadableTable as e:  # ours, and not as plexd makes it: the diff rebuilds it
            return TableSeen(LiveTable(unreadable=str(e)))
        except FirewallError as e:
            return TableSeen(None, f"firewall not applied: {e}")

    def plan(self, desired: DesiredState, seen: TableSeen) -> DomainResult:
        wanted = self.enabled and desired.enforce_policy
        if seen.error:
            # Enforcement off: nothing to enforce, and a table nftables cannot read is no one's concern.
            self.held = seen.error if wanted and not self.unavailable else ""  # said even when only planning
            self.missing = seen.error if wanted and not self.unavailable else ""
            return DomainResult(errors=(seen.error,)) if wanted else DomainResult()
        # Until an apply puts it back (a failed one leaves the machine as it was, nftables being transactional)
        self.missing = f"firewall: {plan.WHERE} missing" if wanted and seen.live is None else ""
        changes = plan.diff(self.want(desired), seen.live)
        # Said until an apply runs: while the machine is kept as it is (an operator's hold, or a device that was up
        # before the first state pull) nothing filters, and status must not say otherwise.
        missing = next((c for c in changes if isinstance(c, plan.TableMissing)), None)
        only_planned = "only planned (a reconcile hold, a dry run, or until the first state pull)"
        if not changes:
            self.held = ""
        elif missing is None:
            self.held = (f"firewall: {plan.WHERE} differs from the policy in {len(changes)} "
                         f"{'change' if len(changes) == 1 else 'changes'}, {only_planned}")
        elif missing.rebuilt:
            self.held = (f"firewall: {plan.WHERE} not as plexd makes it ({missing.rebuilt}), rebuilding it is "
                         f"{only_planned}")
        else:
            self.held = f"firewall: {plan.WHERE} missing, nothing filters the mesh; creating it is {only_planned}"
        return DomainResult(tuple(changes))

    async def apply(self, desired: DesiredState, planned: DomainResult, seen: TableSeen) -> DomainResult:
        self.held = ""
        if seen.error:
            if self.enabled and not self.unavailable:
                self._fail(seen.error)
            return DomainResult()
        changes: Sequence[plan.FirewallChange] = planned.changes  # type: ignore[assignment]
        if not self.enabled:  # a table an earlier run left would still drop mesh traffic: remove it, quietly
            try:
                if changes:
                    await self._write(self.nft.run, plan.commands(changes))
            except FirewallError as e:
                log.debug("firewall (enforcement off): %s", e)
                return DomainResult()
            return DomainResult(tuple(changes))
        try:
            if changes:
                await self._apply(changes, self.want(desired), seen.live)
            else:
                self._believed, self._known = seen.live, True
        except FirewallError as e:
            return DomainResult(errors=(self._fail(f"firewall not applied: {e}"),))
        self.missing = ""
        self._baseline = (desired, self.want(desired))
        self._applied()
        return DomainResult(tuple(changes))

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        if not self.enabled:
            return DomainResult()  # leftovers are removed by full converges only
        if self.unavailable:
            return DomainResult(errors=(self.unavailable,)) if desired.enforce_policy else DomainResult()
        if not self._started or not self._known or self.held:
            return None  # (held: the table was last seen not as wanted; only a read can tell what it is now)
        peer_sets = self._peer_sets(desired, touched)
        if peer_sets is not None:
            want, names, changes = peer_sets
            self._want = (desired, want)
        else:
            want, names = self.want(desired), None
            changes = plan.diff(want, self._believed)
            if any(plan.needs_unknown_handle(c) for c in changes):
                return None  # a rule added since the last read is in the way: read the table
        if not changes:
            self._baseline = (desired, want)
            return DomainResult()
        try:
            if names is not None:
                await self._write(self.nft.run, plan.commands(changes))
                self._believed = plan.simulate_sets(self._believed, want, names)
            else:
                await self._apply(changes, want, self._believed)
        except FirewallError as e:
            # The table was not as the last apply left it (someone changed it): the engine reads it and retries.
            log.info("firewall: applying on the believed table failed (%s); reading the table", e)
            self._known = False
            return None
        self._baseline = (desired, want)
        self.held = ""
        self._applied()
        return DomainResult(tuple(changes))

    def _peer_sets(self, desired: DesiredState, touched: Collection[str] | None
                   ) -> tuple[Ruleset, list[str], list[plan.FirewallChange]] | None:
        """Peers' events with the policies unchanged: only the touched nodes' sets can differ, so only they are
        built and diffed (O(change), not O(rules)). Returns (the table wanted, those sets' names, the changes);
        None: not such an event, use the full diff."""
        last = self._baseline
        if touched is None or last is None or last[1] is None or self._believed is None:
            return None
        before, ruleset = last
        if (desired.compiled_policy is not before.compiled_policy or desired.interface != before.interface
                or desired.node_id != before.node_id or desired.mesh_ip != before.mesh_ip
                or desired.enforce_policy != before.enforce_policy or desired.sessions is not before.sessions
                or desired.user_access is not before.user_access or desired.site_to_site is not before.site_to_site):
            return None
        referenced = desired.compiled_policy.referenced_nodes()
        sets = dict(ruleset.sets)
        names = []
        for pid in touched:
            if pid not in referenced or pid == desired.node_id:
                continue
            peer = desired.peers.get(pid)
            spec = node_set(pid, peer.mesh_ip if peer is not None and peer.mesh_ip else "")
            if spec.type != sets[spec.name].type:
                return None  # the node's address family changed: so do the rules naming it
            sets[spec.name] = spec
            names.append(spec.name)
        want = Ruleset(ruleset.chains, sets)
        changes = plan.diff_sets(want, self._believed, names)
        return None if changes is None else (want, names, changes)

    def _fail(self, why: str) -> str:
        self._known = False
        self.failure = why
        log.error("%s", why)
        return why

    def _applied(self) -> None:
        if self.failure:
            log.info("firewall applied again after an earlier failure")
        self.failure = ""

    async def _apply(self, changes: Sequence[plan.FirewallChange], want: Ruleset | None,
                     live: LiveTable | None) -> None:
        script = _script(changes)
        if script is not None:
            await self._write(self.nft.run_script, script)
        else:
            await self._write(self.nft.run, plan.commands(changes))
        self._forget_shapes(changes)  # only once written: a failed write must not forget what was altered
        # A rebuilt table numbers its rules afresh: no handle of the old listing may be believed.
        rebuilt = any(isinstance(c, plan.TableMissing) for c in changes)
        self._believed, self._known = plan.simulate(None if rebuilt else live, want), True
        for c in changes:
            log.debug("firewall: %s", c.detail)

    async def _write(self, fn: Callable[..., Any], *args: Any) -> None:
        """One nftables transaction. It runs in a worker thread, which a cancelled caller cannot stop: shielded
        and remembered, so that teardown waits for it instead of reading the table before it lands."""
        self._inflight = asyncio.ensure_future(self._run(fn, *args))
        await asyncio.shield(self._inflight)

    async def teardown(self) -> None:
        """Remove the table (shutdown with deregistration): nothing of plexd's is left filtering."""
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([self._inflight])  # a converge cancelled by the shutdown may still be writing
        self._known = False
        if not self.enabled or self.unavailable:
            return
        try:
            try:
                present = await self.read() is not None
            except UnreadableTable:
                present = True  # there, and plexd's: removed all the same
            if present:
                await self._run(self.nft.run, [{"delete": {"table": {"family": FAMILY, "name": TABLE}}}])
                log.info("firewall table %s %s removed", FAMILY, TABLE)
        except FirewallError as e:
            log.warning("removing the firewall table: %s", e)


def _script(changes: Sequence[plan.FirewallChange]) -> str | None:
    """The whole table built in one go goes as an nft script (half the time of JSON); anything else is JSON."""
    if len(changes) != 1 or not isinstance(changes[0], plan.TableMissing):
        return None
    try:
        return changes[0].script()
    except Unrenderable as e:
        log.debug("firewall: the table goes as JSON: %s", e)
        return None


def session_gates(sessions: Sessions | None) -> tuple[SessionGate, ...]:
    """Every session in the block gets its listener's rules (its mark, the service port it stands for)."""
    if sessions is None or not sessions.by_id:
        return ()
    marks = socket_marks(sessions.by_id)
    return tuple(SessionGate(sid, marks[sid], service_port(s)) for sid, s in sorted(sessions.by_id.items()))
