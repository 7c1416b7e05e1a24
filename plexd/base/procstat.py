"""One reader of ``/proc/PID/stat``: a process's state and start time.

The command name sits in parentheses and may itself hold spaces and parentheses, so fields are counted after the
last ``)``. The start time (clock ticks since boot) stays the same across an exec and tells a process from a new
one that reused its pid.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcStat:
    state: str  # R, S, D, Z (zombie), X (dead), …
    start_ticks: int

    @property
    def alive(self) -> bool:
        """Running or able to run: not a zombie waiting to be reaped, not dead."""
        return self.state not in ("Z", "X")


def process_stat(pid: int) -> ProcStat | None:
    """The state and start time of `pid`, or None when there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return ProcStat(fields[0].decode(), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None
