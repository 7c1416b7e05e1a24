"""What a command that changes the machine did, skipped, or could not do (`plexd install`, `uninstall`,
`deregister --purge`): one line per step, so the operator knows exactly what state the machine is in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LABELS = (("done", "done"), ("skipped", "skipped"), ("failed", "FAILED"))


@dataclass
class StepReport:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, list[str]]:
        return {"done": self.done, "skipped": self.skipped, "failed": self.failed}

    def text(self, done_label: str = "done") -> str:
        return format_steps(self.to_json(), done_label)


def format_steps(report: dict[str, Any], done_label: str = "done") -> str:
    """A `StepReport.to_json()` as lines: "done: ...", "skipped: ...", "FAILED: ..."."""
    return "\n".join(f"{done_label if key == 'done' else label}: {line}" for key, label in LABELS
                     for line in report.get(key, ()))
