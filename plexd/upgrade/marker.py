"""``data_dir/upgrade.json``: an upgrade from its install until its outcome is reported.

    installed     the new release is in place and `current` points to it; the old daemon is restarting
    started       the launcher started the new release; it removes the marker once healthy. Finding this state
                  at a start means the new release never got there (it died, hung or gave up): roll back
    rolled_back   `current` points to the old release again; the old daemon reports the failure and removes it

Written atomically (0600) at each step, so a crash anywhere leaves a state the next start can act on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexd.base import boundedjson
from plexd.base.atomicfile import write_atomic
from plexd.base.errors import PlexdError
from plexd.config import datadir

log = logging.getLogger(__name__)

INSTALLED, STARTED, ROLLED_BACK = "installed", "started", "rolled_back"
MAX_SIZE = 64 << 10


@dataclass(frozen=True)
class UpgradeMarker:
    execution_id: str
    from_version: str
    from_checksum: str
    from_release: str | None  # the release file the node ran before; None: the installed package
    to_version: str
    to_checksum: str
    to_release: str
    deadline: float  # unix time by which the new release must be healthy
    state: str = INSTALLED
    reason: str = ""  # why it was rolled back

    def with_state(self, state: str, reason: str = "") -> UpgradeMarker:
        return dataclasses.replace(self, state=state, reason=reason or self.reason)


def marker_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / datadir.UPGRADE


def write(data_dir: str | os.PathLike[str], marker: UpgradeMarker) -> None:
    write_atomic(marker_path(data_dir), json.dumps(dataclasses.asdict(marker), indent=2).encode())


def remove(data_dir: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        marker_path(data_dir).unlink()


def read(data_dir: str | os.PathLike[str]) -> UpgradeMarker | None:
    """The marker, or None. A malformed one is set aside as ``upgrade.json.bad`` with one error line: it cannot
    say where to roll back to, and must not stop the node from starting."""
    path = marker_path(data_dir)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SIZE + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None  # no marker, or no data_dir yet: the start's own data_dir check speaks for the latter
    except OSError as exc:
        log.error("cannot read the upgrade marker %s: %s; starting without it", path, exc.strerror)
        return None
    try:
        return _parse(raw)
    except (PlexdError, ValueError) as exc:
        bad = path.with_name(path.name + ".bad")
        with contextlib.suppress(OSError):
            os.replace(path, bad)
        log.error("the upgrade marker %s is unusable (%s); moved to %s, and the current release runs as it is",
                  path, exc, bad)
        return None


def _parse(raw: bytes) -> UpgradeMarker:
    if len(raw) > MAX_SIZE:
        raise ValueError(f"larger than {MAX_SIZE} bytes")
    doc: Any = boundedjson.loads(raw, "upgrade marker")
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(UpgradeMarker):
        value = doc.get(f.name, f.default)
        if value is dataclasses.MISSING:
            raise ValueError(f"{f.name}: missing")
        allowed = {"str": (str,), "str | None": (str, type(None)), "float": (int, float)}[str(f.type)]
        if not isinstance(value, allowed) or isinstance(value, bool):
            raise ValueError(f"{f.name}: {type(value).__name__} where {f.type} belongs")
        values[f.name] = value
    if values["state"] not in (INSTALLED, STARTED, ROLLED_BACK):
        raise ValueError(f"state: unknown state {values['state']!r}")
    return UpgradeMarker(**values)
