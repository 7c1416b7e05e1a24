"""Report entries: what local workloads tell the control plane about this node (§8.2, §8.3).

Each entry is one file, data_dir/state/report/<file>.json (`keys.file_name`), written atomically (0600) before the
request is answered, so a 200 means the entry survives a crash. The version is the node's: 1 for a new entry,
+1 for every update; `If-Match` (a bare integer) makes a write conditional on it, and `0` means "only if new".
Every change is handed to `on_change` (the sync queue), which carries it upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexd import gojson
from plexd.atomicfile import write_atomic
from plexd.model import DataEntry
from plexd.nodeapi.cache import DIR_MODE, FILE_MODE, STATE_DIR, read_json_file
from plexd.nodeapi.keys import file_name, report_key_problem

log = logging.getLogger(__name__)

REPORT_DIR = "report"


# A report entry has the wire shape of a data entry (§1.12, §8.6): key, content_type, payload, version, updated_at.
ReportEntry = DataEntry


def entry_from_file(doc: Any) -> ReportEntry:
    """A report entry file read back at start; ValueError names what makes it unusable."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    key, ctype, version, updated = doc.get("key"), doc.get("content_type"), doc.get("version"), \
        doc.get("updated_at")
    if not isinstance(key, str) or report_key_problem(key):
        raise ValueError(f"key: {report_key_problem(key) if isinstance(key, str) else 'missing'}")
    if not isinstance(ctype, str) or not ctype:
        raise ValueError("content_type missing")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError("version must be a positive integer")
    if "payload" not in doc:
        raise ValueError("payload missing")
    return ReportEntry(key, ctype, doc["payload"], version, updated if isinstance(updated, str) else "")


def compact(value: Any) -> bytes:
    """Report files are written without indentation, unlike the Go agent's: indenting a deeply nested 450 KB
    payload makes an 18 MB file (a PUT would write 40 times what it sent), larger than the bound the file is read
    back with at start, so an acknowledged entry would be lost by a restart."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class VersionConflict(Exception):
    """If-Match did not match the entry's version (or the entry does not exist and If-Match was not 0)."""


class ReportStore:
    def __init__(self, data_dir: str | Path, on_change: Callable[[str], None] | None = None) -> None:
        self.dir = Path(data_dir) / STATE_DIR / REPORT_DIR
        self.on_change = on_change or (lambda key: None)
        self._entries: dict[str, ReportEntry] = {}
        self._lock = asyncio.Lock()  # version check and write are one step, whatever else arrives meanwhile

    def load(self) -> int:
        """Read every entry from disk (at start). A file that cannot be used is left where it is, with a warning:
        an operator may want it, and a PUT to its key replaces it."""
        self._entries.clear()
        try:
            names = sorted(os.listdir(self.dir))
        except (FileNotFoundError, NotADirectoryError):
            return 0
        for name in names:
            if not name.endswith(".json") or name.startswith(".tmp-"):
                continue
            path = self.dir / name
            try:
                entry = entry_from_file(read_json_file(path))
            except (OSError, ValueError) as exc:
                log.warning("report entry %s ignored: %s", path, exc)
                continue
            if file_name(entry.key) != name:
                log.warning("report entry %s ignored: it holds key %r, which belongs in %s", path, entry.key,
                            file_name(entry.key))
                continue
            self._entries[entry.key] = entry
        return len(self._entries)

    def index(self) -> list[dict[str, Any]]:
        return [{"key": e.key, "version": e.version} for e in self._entries.values()]

    def get(self, key: str) -> ReportEntry | None:
        return self._entries.get(key)

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, key: str, content_type: str, payload: Any, if_match: int | None) -> ReportEntry:
        async with self._lock:
            old = self._entries.get(key)
            if if_match is not None and if_match != (old.version if old is not None else 0):
                raise VersionConflict(key)
            entry = ReportEntry(key, content_type, payload, (old.version + 1) if old is not None else 1,
                                gojson.format_time(gojson.now_utc()))
            await asyncio.to_thread(self._write, entry)
            self._entries[key] = entry
        self.on_change(key)
        return entry

    async def delete(self, key: str) -> bool:
        async with self._lock:
            if key not in self._entries:
                return False
            await asyncio.to_thread(self._remove, key)
            del self._entries[key]
        self.on_change(key)
        return True

    def _write(self, entry: ReportEntry) -> None:
        self.dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        write_atomic(self.dir / file_name(entry.key), compact(entry.to_wire()), FILE_MODE)

    def _remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / file_name(key)).unlink()
