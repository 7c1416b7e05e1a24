"""One piece of machine state the engine converges: the protocol every domain implements, and its one result.

A domain owns its objects outright and nothing else: the WireGuard device with its link and routes, the
nftables table, the node-state cache files; next the access proxy's listeners and live sessions (with the
session rules in a chain of their own), the bridge's extra interfaces. Two domains never change the same object,
and a domain reads only the desired model (`DesiredState`), never another domain: what one needs from another is
in the model (a session's rule comes from the sessions block, not from the proxy domain).

The engine calls, in a full converge (start-up, the periodic reconcile, `reconcile --once`):

    observed = await domain.observe(desired)          read the live machine (may raise PlexdError)
    planned  = domain.plan(desired, observed)         pure: the changes, and what could not be planned
    applied  = await domain.apply(desired, planned, observed)   always called unless dry-run, even with no
                                                      change: the domain then knows the machine matches
and for events (`apply_delta`) one call that diffs against what the domain's last apply left, no read: it
returns None when it cannot (no baseline, or the machine was not as believed) and the engine runs the full
sequence for that domain alone.

Every `Change` a domain returns is also its drift line (`plexd.converge.change`). A domain returns failures in
`errors` naming the object; an exception out of a domain is a bug or a PlexdError the engine turns into an error
line for that domain, and the other domains still converge.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from plexd.converge.change import Change
from plexd.state.desired import DesiredState


@dataclass(frozen=True)
class DomainResult:
    """What a domain planned or applied: `changes` done (or planned), `errors` one line each, naming the object."""

    changes: tuple[Change, ...] = ()
    errors: tuple[str, ...] = ()

    def __add__(self, other: DomainResult) -> DomainResult:
        return DomainResult(self.changes + other.changes, self.errors + other.errors)


class Domain(Protocol):
    name: str  # short, stable: logs, errors and `plexd status --json` use it
    # False: what it converges is not this machine (the NAT domain: what the control plane is told), so an
    # operator's hold, or a device kept as it is until the first state pull, does not stop it; a dry run still does.
    touches_machine: bool
    # True: an operator's hold does not stop it (the sessions: a hold must never keep a revoked session open),
    # while a device kept until the first state pull still does.
    acts_while_held: bool

    async def observe(self, desired: DesiredState) -> Any:
        """The live state of what this domain owns (`desired` says where to look: an interface, a directory)."""
        ...

    def plan(self, desired: DesiredState, observed: Any) -> DomainResult:
        """The changes that make `observed` match `desired`; errors for what cannot be planned. No I/O."""
        ...

    async def apply(self, desired: DesiredState, planned: DomainResult, observed: Any) -> DomainResult:
        """Apply `planned.changes`; returns the ones applied and the errors (not `planned.errors`)."""
        ...

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        """Events: apply what changed since the last apply without reading the machine; None: converge me in full.
        `touched`: the ids the events named (peers), a superset is fine; None: find them by comparing models."""
        ...

    async def teardown(self) -> None:
        """Remove what the domain put on the machine (deregistration); never raises for what the machine does."""
        ...

    def status(self) -> Mapping[str, Any] | None:
        """The domain's health for `plexd status --json` and the heartbeat; None when it has nothing to say."""
        ...
