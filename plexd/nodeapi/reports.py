"""Report entries: what local workloads tell the control plane about this node (§8.2, §8.3).

Each entry is one file, data_dir/state/report/<file>.json (`keys.file_name`), written atomically (0600) before the
request is answered, so a 200 means the entry survives a crash. The version is the node's: 1 for a new entry,
+1 for every update; `If-Match` (a bare integer) makes a write conditional on it, and `0` means "only if new".
Every change is handed to its subscribers (the sync queue), which carries it upstream.

The store is bounded, so a workload cannot fill the disk or the daemon's memory: at most `max_entries` entries,
`max_bytes` in all and `max_entry_bytes` each (sizes are those of the files). A PUT past a cap is refused with
`StoreFull` (the routes' 507) or `EntryTooLarge` (413), naming the cap and its config key; a delete is always
allowed. Entries already on disk are all loaded at start even when the caps were lowered meanwhile (nothing is
thrown away); new ones are refused until the store is back under them.
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

from plexd.base import gojson
from plexd.base.atomicfile import fsync_directory, write_atomic
from plexd.base.errors import PlexdError
from plexd.base.failpoint import failpoint
from plexd.nodeapi.cache import DIR_MODE, FILE_MODE, STATE_DIR, read_json_file
from plexd.nodeapi.keys import file_name, report_key_problem
from plexd.state.model import DataEntry

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


MAX_ENTRIES = 1000
MAX_BYTES = 16 << 20
MAX_ENTRY_BYTES = 1 << 20  # a PUT body is capped at 1 MiB anyway (plexd.nodeapi.local_api)


class VersionConflict(PlexdError):
    """If-Match did not match the entry's version (or the entry does not exist and If-Match was not 0)."""


class StoreFull(PlexdError):
    """The entry would take the store past its count or byte cap (HTTP 507)."""


class EntryTooLarge(PlexdError):
    """The entry alone is larger than an entry may be (HTTP 413)."""


class StoreUnwritable(PlexdError):
    """data_dir cannot take the write now: full, read-only, an I/O error (HTTP 507). The entry keeps its last
    stored version."""


class ReportStore:
    def __init__(self, data_dir: str | Path, on_change: Callable[[str], None] | None = None, *,
                 max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES,
                 max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        self.dir = Path(data_dir) / STATE_DIR / REPORT_DIR
        self._on_change = [on_change] if on_change is not None else []
        self.max_entries, self.max_bytes, self.max_entry_bytes = max_entries, max_bytes, max_entry_bytes
        self._entries: dict[str, ReportEntry] = {}
        self._sizes: dict[str, int] = {}  # key -> bytes of its file
        self._lock = asyncio.Lock()  # version check and write are one step, whatever else arrives meanwhile

    def subscribe(self, changed: Callable[[str], None]) -> None:
        """`changed(key)` for every entry written or deleted, before its file is (the sync's queue)."""
        self._on_change.append(changed)

    def _changed(self, key: str) -> None:
        for changed in self._on_change:
            changed(key)

    def load(self) -> int:
        """Read every entry from disk (at start). A file that cannot be used is left where it is, with a warning:
        an operator may want it, and a PUT to its key replaces it."""
        self._entries.clear()
        self._sizes.clear()
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
            self._sizes[entry.key] = len(compact(entry.to_wire()))
        if len(self._entries) > self.max_entries or self.total_bytes > self.max_bytes:
            log.warning("report entries in %s (%d, %d bytes) are over the caps (node_api.report_max_entries %d, "
                        "report_max_bytes %d): all kept, new ones refused until some are deleted", self.dir,
                        len(self._entries), self.total_bytes, self.max_entries, self.max_bytes)
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes.values())

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
                raise VersionConflict(f"report {key[:100]!r}: If-Match {if_match}, the entry is at version "
                                      f"{old.version if old is not None else 0}")
            entry = ReportEntry(key, content_type, payload, (old.version + 1) if old is not None else 1,
                                gojson.format_time(gojson.now_utc()))
            data = compact(entry.to_wire())
            self._check_caps(key, len(data))
            # Queued before the write: a crash between the two must not leave an entry on disk that is never sent
            # (the sync reads the key's entry when it sends, so a write that then fails costs one needless send).
            self._changed(key)
            failpoint("report.queued")
            try:
                await asyncio.to_thread(self._write, entry, data)
            except OSError as exc:  # the bench chaos's disk_full and read_only: this was a 500, "internal error"
                raise StoreUnwritable(f"report {key[:100]!r} not stored: {exc.strerror or exc} "
                                      f"(in {self.dir}); the entry keeps version "
                                      f"{old.version if old is not None else 0}") from None
            self._entries[key] = entry
            self._sizes[key] = len(data)
            # Again, now that the store holds it: a send that came due during the write read the key as it was
            # before (a new key as deleted), and its acknowledgement took the first row with it.
            self._changed(key)
        return entry

    async def delete(self, key: str) -> bool:
        async with self._lock:
            if key not in self._entries:
                return False
            self._changed(key)  # before the file goes, as for a write
            try:
                await asyncio.to_thread(self._remove, key)
            except OSError as exc:
                raise StoreUnwritable(f"report {key[:100]!r} not deleted: {exc.strerror or exc} "
                                      f"(in {self.dir})") from None
            del self._entries[key]
            self._sizes.pop(key, None)
            self._changed(key)  # and after, as for a write
        return True

    def _check_caps(self, key: str, size: int) -> None:
        if size > self.max_entry_bytes:
            raise EntryTooLarge(f"report entry too large: {size} bytes stored, at most {self.max_entry_bytes} "
                                "(node_api.report_max_entry_bytes)")
        if key not in self._entries and len(self._entries) >= self.max_entries:
            raise StoreFull(f"report store full: {len(self._entries)} entries, at most {self.max_entries} "
                            "(node_api.report_max_entries); delete entries that are no longer needed")
        total = self.total_bytes - self._sizes.get(key, 0) + size
        if total > self.max_bytes:
            raise StoreFull(f"report store full: this entry ({size} bytes) would make {total} bytes, at most "
                            f"{self.max_bytes} (node_api.report_max_bytes); delete entries that are no longer "
                            "needed")

    def _write(self, entry: ReportEntry, data: bytes) -> None:
        self.dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        write_atomic(self.dir / file_name(entry.key), data, FILE_MODE)

    def _remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / file_name(key)).unlink()
            fsync_directory(self.dir)  # a 204 means gone for good: a power cut must not bring the entry back
