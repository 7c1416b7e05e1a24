"""Error lines said once: a refused entry is logged when it appears, not at every reconcile while it stands (nor
never), and again if it comes back after it was gone."""

from __future__ import annotations

import logging
from collections.abc import Iterable


class OnceLog:
    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._standing: set[str] = set()

    def errors(self, lines: Iterable[str]) -> None:
        """The error lines of a full converge: the new ones are logged, the gone ones forgotten."""
        lines = set(lines)
        for line in sorted(lines - self._standing):
            self._log.error("%s", line)
        self._standing = lines
