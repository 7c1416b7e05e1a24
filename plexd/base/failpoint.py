"""Failpoints: named places where a test kills plexd with SIGKILL, to prove what survives a crash right there.

    PLEXD_TEST_FAILPOINTS=register.answered          the first time the point is passed
    PLEXD_TEST_FAILPOINTS=converge.between_domains:3 the third time
    PLEXD_TEST_FAILPOINTS=a,b:2                      several

A kill at a chosen moment is what a random one (`bench chaos`, fault plexd_kill) reaches only by luck: the moment
between an answer and the write that keeps it. Production never sets the variable; then `failpoint()` is one set
lookup. A name that is not in `POINTS` is refused by `plexd up` with one line, so a typo never passes as a test of
nothing (other commands pass the points they reach, and ignore a bad name). Counts start again in a process that
re-executes itself. tests/e2e/test_failpoints_lab.py kills the daemon at every point and checks what its promises say.
"""

from __future__ import annotations

import os
import signal
import sys

from plexd.base.errors import PlexdError

ENV = "PLEXD_TEST_FAILPOINTS"

POINTS = {
    "register.answered": "the control plane answered a registration; the identity is not saved yet",
    "converge.between_domains": "a full converge applied its first domain and not the others",
    "rotation.announced": "the control plane took a rotated key; the node has not committed it yet",
    "action.finished": "an action ran to its end and its result is not journaled yet",
    "report.queued": "a node-API report entry is queued for the control plane; its file is not written yet",
    "mirror.commit": "the mirror and the event cursor are written in their transaction, not committed yet",
    "upgrade.switched": "an upgrade switched the current release and has not restarted into it yet",
}


class BadFailpoint(PlexdError):
    """PLEXD_TEST_FAILPOINTS names a point that does not exist or a count that is not a positive number."""


def parse(text: str) -> dict[str, int]:
    """`name[:n],...` → {name: the pass that kills}."""
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition(":")
        if name not in POINTS:
            raise BadFailpoint(f"{ENV}: no failpoint {name!r}; the points: {', '.join(sorted(POINTS))}")
        if count and not (count.isascii() and count.isdecimal() and int(count) > 0):
            raise BadFailpoint(f"{ENV}: {item!r}: the count after ':' is a positive whole number")
        armed[name] = int(count or 1)
    return armed


_passes: dict[str, int] = {}


def check() -> None:
    """Refuse a PLEXD_TEST_FAILPOINTS that names no point (`plexd up` calls this before anything else)."""
    parse(os.environ.get(ENV, ""))


def _read() -> dict[str, int]:
    try:
        return parse(os.environ.get(ENV, ""))
    except BadFailpoint:
        return {}  # `check` said so at the start


_armed = _read()


def failpoint(name: str) -> None:
    """SIGKILL this process here, if a test armed `name` and this is the pass it named."""
    if not _armed or name not in _armed:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] == _armed[name]:
        # On stderr, unbuffered and without the logging machinery: the line must be out before the kill.
        sys.stderr.write(f"plexd: failpoint {name} (pass {_passes[name]}): SIGKILL now\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
