"""A toy domain, to show what plugging a new piece of machine state into the engine takes: this module and one
line in a list of domains, nothing else.

The file it owns holds one line per peer, `<mesh ip> <peer id>` (a hosts file of the mesh). Observed: the lines on
disk. Planned: the lines missing and the lines no peer has. Applied: the file rewritten atomically. Every change is
a drift line of its own: `hosts_line_added`, `hosts_line_removed`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.state.desired import DesiredState


@dataclass(frozen=True)
class LineMissing(Change):
    correction_type: ClassVar[str] = "hosts_line_added"
    line: str

    @property
    def detail(self) -> str:
        return f"hosts file: line {self.line!r} missing"


@dataclass(frozen=True)
class LineExtra(Change):
    correction_type: ClassVar[str] = "hosts_line_removed"
    line: str

    @property
    def detail(self) -> str:
        return f"hosts file: line {self.line!r} is no peer's"


def wanted(desired: DesiredState) -> list[str]:
    return sorted(f"{p.mesh_ip} {pid}" for pid, p in desired.peers.items())


class HostsFile:
    name = "hosts_file"
    touches_machine = True
    acts_while_held = False

    def __init__(self, path: Path) -> None:
        self.path = path

    async def observe(self, desired: DesiredState) -> list[str]:
        try:
            text = await asyncio.to_thread(self.path.read_text)
        except FileNotFoundError:
            return []
        return [line for line in text.splitlines() if line.strip()]

    def plan(self, desired: DesiredState, observed: list[str]) -> DomainResult:
        want, have = wanted(desired), set(observed)
        changes: list[Change] = [LineMissing(line) for line in want if line not in have]
        changes += [LineExtra(line) for line in sorted(have - set(want))]
        return DomainResult(tuple(changes))

    async def apply(self, desired: DesiredState, planned: DomainResult, observed: list[str]) -> DomainResult:
        if planned.changes:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(f"{line}\n" for line in wanted(desired)))
            os.replace(tmp, self.path)
        return planned

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        return None  # small: every event converges it in full

    async def teardown(self) -> None:
        self.path.unlink(missing_ok=True)

    def status(self) -> dict[str, str]:
        return {"path": str(self.path)}
