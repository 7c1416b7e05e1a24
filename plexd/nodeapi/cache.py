"""The node-state cache under data_dir/state/, a domain of the converge engine (plexd.converge).

    state/metadata.json     the node's metadata (a JSON object, or null)
    state/secrets.json      the secret index [{"key","version"}]: names and versions, never values
    state/data/<file>.json  one data entry each (`keys.file_name`: no key escapes the directory)

The files are what the control plane last said (the desired model's metadata, data and secret_refs), written
pretty-printed as the Go agent writes them (§8.6), directories 0700, files 0600, atomically. A full converge
reads them back and corrects whatever differs, including a file edited, deleted or re-moded by hand, and each
correction is a drift line:

    cache_file_added     a cache file was missing
    cache_file_updated   a cache file's content or mode differed
    cache_file_removed   a file in state/data/ that no data entry has

Events (`apply_delta`) diff against what the last write left, without reading the disk, and an event that did not
touch the node state (a peer event) costs one identity check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from plexd.base.atomicfile import write_atomic
from plexd.base.errors import PlexdError
from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.nodeapi.keys import file_name
from plexd.state.desired import DesiredState
from plexd.state.model import DataEntry, SecretRef

log = logging.getLogger(__name__)

STATE_DIR = "state"
METADATA = "metadata.json"
SECRETS = "secrets.json"
DATA_DIR = "data"
FILE_MODE = 0o600
DIR_MODE = 0o700
MAX_CACHE_FILE = 8 << 20  # read_json_file's bound: files loaded at start, not the converge's (it knows the sizes)


def pretty(value: Any) -> bytes:
    """JSON as Go's MarshalIndent(v, "", "  ") writes it."""
    return json.dumps(value, indent=2, ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class LiveFile:
    content: bytes | None  # None: unreadable (too big, not a regular file)
    mode: int


@dataclass(frozen=True)
class CacheChange(Change):
    path: str  # relative to data_dir, e.g. "state/data/db.json"
    content: bytes | None  # what to write; None: remove
    why: str

    @property
    def detail(self) -> str:
        return f"node cache {self.path}: {self.why}"


@dataclass(frozen=True)
class CacheFileMissing(CacheChange):
    correction_type: ClassVar[str] = "cache_file_added"


@dataclass(frozen=True)
class CacheFileWrong(CacheChange):
    correction_type: ClassVar[str] = "cache_file_updated"


@dataclass(frozen=True)
class CacheFileExtra(CacheChange):
    correction_type: ClassVar[str] = "cache_file_removed"


def _node_state(desired: DesiredState) -> tuple[Any, Any, Any]:
    return desired.metadata, desired.data, desired.secret_refs


def want(desired: DesiredState) -> dict[str, bytes]:
    """Every cache file the desired model implies, by path relative to data_dir."""
    out = {f"{STATE_DIR}/{METADATA}": pretty(desired.metadata),
           f"{STATE_DIR}/{SECRETS}": pretty([r.to_wire() for r in desired.secret_refs])}
    for entry in desired.data:
        out[f"{STATE_DIR}/{DATA_DIR}/{file_name(entry.key)}"] = pretty(entry.to_wire())
    return out


def diff(wanted: Mapping[str, bytes], live: Mapping[str, LiveFile]) -> list[CacheChange]:
    changes: list[CacheChange] = []
    for path, content in sorted(wanted.items()):
        have = live.get(path)
        if have is None:
            changes.append(CacheFileMissing(path, content, "missing"))
        elif have.content != content:
            changes.append(CacheFileWrong(path, content, "content differs from the control plane's"))
        elif have.mode != FILE_MODE:
            changes.append(CacheFileWrong(path, content, f"mode {have.mode:04o} != {FILE_MODE:04o}"))
    changes.extend(CacheFileExtra(path, None, "no data entry has this file")
                   for path in sorted(live.keys() - wanted.keys()))
    return changes


def read_live(data_dir: Path, wanted: Mapping[str, bytes]) -> dict[str, LiveFile]:
    """The cache files on disk (metadata, secrets, every *.json in data/; temporary files are not ours yet). A file
    is read only when it has the size of the content wanted there: any other size already differs (content None),
    so what is read is bounded by what the model holds, whatever was put in the directory."""
    out: dict[str, LiveFile] = {}
    state = data_dir / STATE_DIR
    names = [METADATA, SECRETS]
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        names += [f"{DATA_DIR}/{n}" for n in os.listdir(state / DATA_DIR)
                  if n.endswith(".json") and not n.startswith(".tmp-")]
    for name in names:
        path = state / name
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        rel = f"{STATE_DIR}/{name}"
        content = None
        want_here = wanted.get(rel)
        if stat.S_ISREG(st.st_mode) and want_here is not None and st.st_size == len(want_here):
            with contextlib.suppress(OSError):
                content = path.read_bytes()
        out[rel] = LiveFile(content, stat.S_IMODE(st.st_mode))
    return out


class CacheError(PlexdError):
    """The cache files could not be read."""


@dataclass(frozen=True)
class CacheSeen:
    wanted: dict[str, bytes]
    live: dict[str, LiveFile]


class NodeStateCache:
    """The cache files, converged to the desired model's node state."""

    name = "node_cache"
    touches_machine = True
    acts_while_held = False

    def __init__(self, data_dir: str | Path, *, run_blocking: Callable[..., Any] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self._run = run_blocking or asyncio.to_thread
        self._believed: dict[str, LiveFile] | None = None  # the files as the last read and write left them
        self._last: tuple[Any, Any, Any] | None = None  # the node state the believed files were written for

    def status(self) -> None:
        return None

    async def observe(self, desired: DesiredState) -> CacheSeen:
        wanted = want(desired)
        try:
            return CacheSeen(wanted, await self._run(read_live, self.data_dir, wanted))
        except OSError as exc:
            raise CacheError(f"node cache in {self.data_dir / STATE_DIR} not read: {exc.strerror or exc}") from None

    def plan(self, desired: DesiredState, seen: CacheSeen) -> DomainResult:
        return DomainResult(tuple(diff(seen.wanted, seen.live)))

    async def apply(self, desired: DesiredState, planned: DomainResult, seen: CacheSeen) -> DomainResult:
        return await self._write(desired, seen.wanted, planned.changes)  # type: ignore[arg-type]

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        if self._believed is None or self._last is None:
            return None
        if all(a is b for a, b in zip(_node_state(desired), self._last, strict=True)):
            return DomainResult()  # a peer event: the node state is the very same objects
        wanted = want(desired)
        return await self._write(desired, wanted, diff(wanted, self._believed))

    async def _write(self, desired: DesiredState, wanted: dict[str, bytes],
                     changes: Sequence[CacheChange]) -> DomainResult:
        try:
            if changes:
                await self._run(self._apply, changes)
        except OSError as exc:
            self._believed = None
            msg = f"node cache in {self.data_dir / STATE_DIR} not written: {exc.strerror or exc}"
            log.error("%s", msg)
            return DomainResult(errors=(msg,))
        self._believed = {p: LiveFile(c, FILE_MODE) for p, c in wanted.items()}
        self._last = _node_state(desired)
        return DomainResult(tuple(changes))

    def _apply(self, changes: Sequence[CacheChange]) -> None:
        state = self.data_dir / STATE_DIR
        for directory in (state, state / DATA_DIR):
            directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            if stat.S_IMODE(directory.stat().st_mode) != DIR_MODE:
                os.chmod(directory, DIR_MODE)
        for change in changes:
            path = self.data_dir / change.path
            if change.content is None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            else:
                if path.is_dir() and not path.is_symlink():
                    raise IsADirectoryError(21, "a directory is in the way", str(path))
                write_atomic(path, change.content, FILE_MODE)
            log.debug("node cache: %s", change.detail)

    async def teardown(self) -> None:
        """The cache stays with the identity (data_dir); `plexd deregister --purge` removes both."""
        self._believed = None


def load(data_dir: str | Path) -> tuple[dict[str, str] | None, list[DataEntry], list[SecretRef]]:
    """The node state in the cache files (a node whose mirror is gone, or a data_dir the Go agent left).
    Files that cannot be read are skipped with a warning; the next state pull replaces all of it."""
    state = Path(data_dir) / STATE_DIR
    metadata: dict[str, str] | None = None
    data: list[DataEntry] = []
    refs: list[SecretRef] = []
    doc = _read_json(state / METADATA)
    if isinstance(doc, dict) and all(isinstance(v, str) for v in doc.values()):
        metadata = doc
    doc = _read_json(state / SECRETS)
    if isinstance(doc, list):
        for i, item in enumerate(doc):
            try:
                refs.append(SecretRef.from_wire(item, f"secrets.json[{i}]"))
            except PlexdError as exc:
                log.warning("node cache: skipping %s", exc)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in sorted(os.listdir(state / DATA_DIR)):
            if name.endswith(".json") and not name.startswith(".tmp-"):
                try:
                    data.append(DataEntry.from_wire(_read_json(state / DATA_DIR / name), f"data/{name}"))
                except PlexdError as exc:
                    log.warning("node cache: skipping %s", exc)
    return metadata, data, refs


def read_json_file(path: Path) -> Any:
    """One of plexd's own JSON files under state/, at most MAX_CACHE_FILE bytes. OSError, or ValueError naming
    what is wrong (too large, not JSON)."""
    if path.stat().st_size > MAX_CACHE_FILE:
        raise ValueError(f"larger than {MAX_CACHE_FILE} bytes")
    return json.loads(path.read_bytes())


def _read_json(path: Path) -> Any:
    try:
        return read_json_file(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:
        log.warning("node cache: cannot read %s: %s", path, exc)
        return None
