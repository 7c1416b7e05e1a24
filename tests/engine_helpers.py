"""One domain converged alone through the real engine (tests and benches of a single domain)."""

from __future__ import annotations

from plexd.converge.domain import Domain
from plexd.converge.engine import ConvergeResult, Engine, Mode
from plexd.state.desired import DesiredState


async def converge(domain: Domain, desired: DesiredState, *, full: bool = True, dry_run: bool = False,
                   touched: list[str] | None = None) -> ConvergeResult:
    """full: observe → plan → apply (the reconcile); otherwise the event path (`apply_delta`), with the peer ids
    the events named (`touched`; None: find them)."""
    engine = Engine([domain])
    if full:
        return await engine.converge(desired, Mode.DRY_RUN if dry_run else Mode.APPLIED)
    return await engine.apply_delta(desired, touched)
