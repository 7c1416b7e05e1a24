"""`plexd doctor`: the preflight an operator runs before and after joining. One line per check: its verdict (ok,
warn, fail) and, when not ok, the fix. Exit status 0 when nothing failed (warnings allowed), 1 otherwise.

Adding a check: a function `check_x(ctx) -> Result` in `plexd.node.doctor_checks` and one `Check` line in
`CHECKS`. The checks run side by side, each in a thread of its own under its own timeout, so an unreachable
control plane costs its few seconds once, never a hang; a check that raises or runs out of time is that check's
failure, never a traceback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from plexd import __version__
from plexd.config.settings import Config
from plexd.node import doctor_checks as c
from plexd.node.doctor_checks import FAIL, OK, WARN, Context, Result

REPORT_VERSION = 1
DEFAULT_TIMEOUT = 5.0  # seconds per check
REACH_TIMEOUT = 10.0  # the control plane's steps share an 8 s budget (plexd.node.doctor_reach.BUDGET)


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], Result]
    timeout: float = DEFAULT_TIMEOUT


# In the order they are shown: what the machine has, then the network, then what could be in the way.
CHECKS: tuple[Check, ...] = (
    Check("wireguard", c.check_wireguard),
    Check("nftables", c.check_nftables),
    Check("capabilities", c.check_capabilities),
    Check("control_plane", c.check_control_plane, REACH_TIMEOUT),
    Check("clock", c.check_clock, REACH_TIMEOUT),
    Check("stun", c.check_stun, REACH_TIMEOUT),
    Check("mtu", c.check_mtu, REACH_TIMEOUT + DEFAULT_TIMEOUT),
    Check("mesh_routes", c.check_mesh_routes),
    Check("mesh_interface", c.check_mesh_interface),
    Check("trusted_dirs", c.check_trusted_dirs),
    Check("systemd", c.check_systemd, 2 * DEFAULT_TIMEOUT),
)


@dataclass(frozen=True)
class Outcome:
    name: str
    verdict: str
    detail: str
    fix: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "detail": self.detail, "fix": self.fix,
                "seconds": round(self.seconds, 3)}


def run_checks(ctx: Context, checks: Sequence[Check] = CHECKS) -> list[Outcome]:
    """Every check at once, each in a daemon thread (one left hanging must not keep the command from exiting);
    the outcomes in the order of `checks`."""
    started = []
    for check in checks:
        box: dict[str, Outcome] = {}
        thread = threading.Thread(target=_run_one, args=(check, ctx, box), daemon=True, name=f"doctor-{check.name}")
        started.append((check, thread, box, time.monotonic()))
        thread.start()
    outcomes = []
    for check, thread, box, began in started:
        thread.join(max(0.0, began + check.timeout - time.monotonic()))
        if "outcome" in box:
            outcomes.append(box["outcome"])
        else:
            outcomes.append(Outcome(check.name, FAIL, f"did not finish within {check.timeout:g}s",
                                    "something on this machine hangs it: run doctor again; if it hangs each "
                                    "time, attach 'plexd bugreport' to a ticket", check.timeout))
    return outcomes


def _run_one(check: Check, ctx: Context, box: dict[str, Outcome]) -> None:
    began = time.monotonic()
    try:
        result = check.run(ctx)
        if not isinstance(result, Result) or result.verdict not in (OK, WARN, FAIL):
            raise TypeError(f"the check returned {result!r}")
    except Exception as exc:  # a check's own bug or an unforeseen error: its line, not a traceback
        result = Result(FAIL, f"the check could not run: {type(exc).__name__}: {exc}",
                        "report this with 'plexd bugreport'")
    box["outcome"] = Outcome(check.name, result.verdict, result.detail, "" if result.verdict == OK else result.fix,
                             time.monotonic() - began)


@dataclass(frozen=True)
class Report:
    config_file: str | None
    outcomes: list[Outcome]

    @property
    def ok(self) -> bool:
        return all(o.verdict != FAIL for o in self.outcomes)

    def count(self, verdict: str) -> int:
        return sum(o.verdict == verdict for o in self.outcomes)

    def to_json(self) -> dict[str, Any]:
        return {"version": REPORT_VERSION, "plexd_version": __version__, "ok": self.ok,
                "config_file": self.config_file, "failed": self.count(FAIL), "warnings": self.count(WARN),
                "checks": [o.to_json() for o in self.outcomes]}

    def text(self) -> str:
        width = max(len(o.name) for o in self.outcomes) if self.outcomes else 0
        lines = []
        for o in self.outcomes:
            fix = f" -> fix: {o.fix}" if o.fix else ""
            lines.append(f"{o.verdict:<4}  {o.name:<{width}}  {o.detail}{fix}")
        failed, warned = self.count(FAIL), self.count(WARN)
        lines.append(f"{len(self.outcomes)} checks: {failed} failed, {warned} warning{'s' if warned != 1 else ''} "
                     f"(config: {self.config_file or 'none, defaults'})")
        return "\n".join(lines)


def run_doctor(config: Config, checks: Sequence[Check] = CHECKS, ctx: Context | None = None) -> Report:
    return Report(config.config_file, run_checks(ctx or Context(config), checks))
