"""The firewall domain: nftables through libnftables' JSON API (pip-nftables), converged like the mesh.

Same verbs as every adapter: `observe()` reads the live table, `apply()` sends one atomic transaction. The
domain (`FirewallDomain.converge`) adds what the converger needs: a full converge reads the table and diffs
against it (drift is found and restored); an event's converge diffs against the table as the last apply left it
(no read: reading 1,000 rules costs ~90 ms, a set element ~4 ms), and if nftables refuses that (someone changed the
table meanwhile) it reads the table and tries once more.

Enforcement that cannot be applied is never silent: the library or the kernel missing is one clear error at start,
and `status` says `degraded` with the reason until an apply works again (status and heartbeat show it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from plexd.desired import DesiredState
from plexd.errors import PlexdError
from plexd.firewall import plan
from plexd.firewall.ruleset import FAMILY, TABLE, LiveTable, Ruleset, desired_ruleset, parse_table

log = logging.getLogger(__name__)

JSON = Any


class FirewallError(PlexdError):
    """nftables could not be used or refused a change."""


class Nftables:
    """The two libnftables contexts plexd uses (listing, and applying with echo for the new rules' handles).

    Blocking: called from a worker thread, one call at a time. A context works in the network namespace it was
    created in, so it is created lazily by the daemon itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lister: Any = None
        self._applier: Any = None

    def _contexts(self) -> tuple[Any, Any]:
        if self._lister is None:
            try:
                import nftables  # pip-nftables
            except ImportError:
                raise FirewallError("the Python module nftables is missing (pip install pip-nftables)") from None
            try:
                lister, applier = nftables.Nftables(), nftables.Nftables()
            except OSError as e:
                raise FirewallError(f"libnftables cannot be loaded ({e}); install it: apt-get install libnftables1"
                                    ) from None
            for ctx in (lister, applier):
                ctx.set_json_output(True)
                ctx.set_handle_output(True)
            applier.set_echo_output(True)
            self._lister, self._applier = lister, applier
        return self._lister, self._applier

    def list_table(self) -> list[JSON] | None:
        """The table's objects, or None when it does not exist."""
        with self._lock:
            lister, _ = self._contexts()
            rc, out, err = lister.json_cmd({"nftables": [{"list": {"table": {"family": FAMILY, "name": TABLE}}}]})
        if rc != 0:
            if "No such file or directory" in err:
                return None
            raise FirewallError(f"reading table {FAMILY} {TABLE}: {_first_line(err)}")
        return list(out.get("nftables", [])) if isinstance(out, dict) else []

    def run(self, commands: Sequence[JSON], echo: bool = False) -> list[JSON]:
        """One transaction; with `echo`, returns the commands as applied (with the handles of new rules). Echo
        makes libnftables load the whole table first (~50 ms at 1,000 rules), so only rule additions ask for it:
        a set element (a peer joining) costs ~3 ms at any size."""
        with self._lock:
            lister, applier = self._contexts()
            rc, out, err = (applier if echo else lister).json_cmd({"nftables": list(commands)})
        if rc != 0:
            raise FirewallError(f"nftables refused the change: {_first_line(err)}")
        return list(out.get("nftables", [])) if echo and isinstance(out, dict) else []

    def probe(self) -> None:
        """Raise FirewallError naming what is missing when nftables cannot be used here at all."""
        with self._lock:
            lister, _ = self._contexts()
            rc, _out, err = lister.json_cmd({"nftables": [{"list": {"tables": {"family": FAMILY}}}]})
        if rc != 0:
            raise FirewallError(f"the kernel refuses nftables ({_first_line(err)}); is nf_tables loaded?")


def _first_line(err: str) -> str:
    lines = [line.strip() for line in (err or "").splitlines() if line.strip()]
    for line in lines:
        if "Error" in line:
            return line[line.find("Error"):][:300]
    return (lines[0] if lines else "unknown error")[:300]


@dataclass(frozen=True)
class DomainResult:
    changes: tuple[plan.FirewallChange, ...] = ()
    errors: tuple[str, ...] = ()


class FirewallDomain:
    """The table `inet plexd`, converged to the desired model's policies."""

    name = "firewall"

    def __init__(self, interface: str, *, enabled: bool = True, log_denied: bool = False,
                 nft: Nftables | None = None, run_blocking: Callable[..., Any] | None = None) -> None:
        self.interface = interface
        self.enabled = enabled
        self.log_denied = log_denied
        self.nft = nft or Nftables()
        self._run = run_blocking or asyncio.to_thread
        self._believed: LiveTable | None = None
        self._known = False  # _believed is the table as the last read and apply left it
        self._started = False
        self.unavailable = ""  # nftables cannot be used at all (reason)
        self.failure = ""  # the last apply failed (reason); cleared by the next that works

    # -- status ------------------------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        if not self.enabled:
            return "disabled"
        return "degraded" if self.unavailable or self.failure else "enforced"

    @property
    def reason(self) -> str:
        if not self.enabled:
            return "policy.enabled is false: peers are not filtered by policy and no firewall is applied"
        return self.unavailable or self.failure

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
            log.error("%s; peers are still limited to those the policies allow, but traffic from them is not "
                      "filtered", self.unavailable)

    # -- the domain --------------------------------------------------------------------------------------------

    def want(self, desired: DesiredState) -> Ruleset | None:
        if not self.enabled or not desired.enforce_policy:
            return None
        compiled = desired.compiled_policy
        addresses = {}
        for node in compiled.referenced_nodes():
            if node == desired.node_id:
                addresses[node] = desired.mesh_ip
            else:
                peer = desired.peers.get(node)
                if peer is not None and peer.mesh_ip:
                    addresses[node] = peer.mesh_ip
        return desired_ruleset(compiled, desired.interface, addresses, self.log_denied)

    async def observe(self) -> LiveTable | None:
        objects = await self._run(self.nft.list_table)
        return None if objects is None else parse_table(objects)

    async def converge(self, desired: DesiredState, *, full: bool, dry_run: bool = False) -> DomainResult:
        """Full: read the table, diff, apply. Otherwise diff against the table as the last apply left it."""
        if not self._started:
            await self.start()
        if self.unavailable:
            return DomainResult(errors=(self.unavailable,)) if self.enabled and desired.enforce_policy else \
                DomainResult()
        if not self.enabled:
            return await self._remove_leftover(full, dry_run)
        want = self.want(desired)
        try:
            if full or not self._known:
                live = await self.observe()
            else:
                live = self._believed
            changes = plan.diff(want, live)
            if dry_run:
                return DomainResult(tuple(changes))
            if not changes:
                self._believed, self._known, self.failure = live, True, ""
                return DomainResult()
            try:
                await self._apply(changes, want, live)
            except FirewallError as first:
                if full:
                    raise
                # The table was not as the last apply left it (someone changed it): read it and try once more.
                log.info("firewall: applying on the believed table failed (%s); reading the table", first)
                live = await self.observe()
                changes = plan.diff(want, live)
                if changes:
                    await self._apply(changes, want, live)
        except FirewallError as e:
            self._known = False
            self.failure = f"firewall not applied: {e}"
            log.error("%s", self.failure)
            return DomainResult(errors=(self.failure,))
        if self.failure:
            log.info("firewall applied again after an earlier failure")
        self.failure = ""
        return DomainResult(tuple(changes))

    async def _remove_leftover(self, full: bool, dry_run: bool) -> DomainResult:
        """Enforcement off: a table an earlier run left would still drop mesh traffic; remove it (full converges
        only, and quietly when nftables is not usable here: there is nothing to enforce)."""
        if not full:
            return DomainResult()
        try:
            changes = plan.diff(None, await self.observe())
            if changes and not dry_run:
                await self._run(self.nft.run, plan.commands(changes))
        except FirewallError as e:
            log.debug("firewall (enforcement off): %s", e)
            return DomainResult()
        return DomainResult(tuple(changes))

    async def _apply(self, changes: Sequence[plan.FirewallChange], want: Ruleset | None,
                     live: LiveTable | None) -> None:
        adds_rules = any(isinstance(c, plan.RuleMissing | plan.ChainMissing | plan.ChainWrong | plan.TableMissing)
                         for c in changes)
        echoed = await self._run(self.nft.run, plan.commands(changes), adds_rules)
        self._believed, self._known = plan.simulate(live, want, _new_handles(echoed)), True
        for c in changes:
            log.debug("firewall: %s", c.detail)

    async def teardown(self) -> None:
        """Remove the table (shutdown with deregistration): nothing of plexd's is left filtering."""
        self._known = False
        if not self.enabled or self.unavailable:
            return
        try:
            if await self.observe() is not None:
                await self._run(self.nft.run, [{"delete": {"table": {"family": FAMILY, "name": TABLE}}}])
                log.info("firewall table %s %s removed", FAMILY, TABLE)
        except FirewallError as e:
            log.warning("removing the firewall table: %s", e)


def _new_handles(echoed: Sequence[JSON]) -> dict[tuple[str, str], int]:
    """(chain, rule key) -> handle, for every rule the transaction added."""
    out = {}
    for cmd in echoed:
        if not isinstance(cmd, dict):
            continue
        for verb in ("add", "insert"):
            rule = (cmd.get(verb) or {}).get("rule") if isinstance(cmd.get(verb), dict) else None
            if isinstance(rule, dict) and "handle" in rule:
                key = str(rule.get("comment", "")).split(" ", 1)[0]
                out[(str(rule.get("chain")), key)] = int(rule["handle"])
    return out
