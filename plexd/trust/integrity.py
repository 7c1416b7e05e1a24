"""Integrity of what plexd runs: its own code ("binary" checksum), hook scripts, and the capabilities document.

Binary checksum (docs/decisions.md, Binary checksum): a Python program has no single binary, so the checksum is SHA-256
over the installed ``plexd`` package: for every file under the package directory (``__pycache__`` directories and
``.pyc`` files excluded), one line ``<relative posix path> NUL <hex sha256 of the file>`` followed by ``\\n``, lines
sorted by path. Running from a single-file zipapp, it is the SHA-256 of that file. Same code, same checksum, on every
machine. Bare lowercase hex, as the Go agent reports it.

Hooks (docs/decisions.md, Hooks; docs/protocol.md §7.1): every executable regular file directly in
``hooks.dir``; name = file name; optional sidecar ``<file>.json`` with description, parameters, timeout,
sandbox (a malformed sidecar is ignored with a warning). A hook must be owned by root and not writable by group
or other, and the directory itself likewise, otherwise it is refused with a logged reason: whoever can write it
could make plexd run anything as root.

A hook runs from a `HookImage`: its bytes copied into a sealed memfd and hashed there, right before the request
is acked; the process is started by executing that descriptor, not the path. Whatever happens to the file in
between (renamed over, rewritten in place) the bytes that run are the bytes whose checksum was compared.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plexd.base import boundedjson
from plexd.base.errors import PlexdError
from plexd.trust.pathtrust import trust_problem

log = logging.getLogger(__name__)

_CHUNK = 1 << 16


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Lowercase hex SHA-256 of a file, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def package_root() -> Path:
    import plexd

    return Path(plexd.__file__).resolve().parent


def zipapp_of(root: Path | None = None) -> Path | None:
    """The zipapp file the package at `root` (default: the running one) is read from, or None when it is a
    directory: inside a zipapp the package directory is a path into the archive."""
    root = root if root is not None else package_root()
    return next((parent for parent in (root, *root.parents) if parent.is_file()), None)


def binary_checksum(root: str | os.PathLike[str] | None = None) -> str:
    """The checksum of the running plexd code (see the module docstring)."""
    root = Path(root) if root is not None else package_root()
    archive = zipapp_of(root)
    if archive is not None:
        return sha256_file(archive)
    lines = [f"{name}\0{sha256_file(path)}\n" for name, path in package_files(root)]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def package_files(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every file of the package under `root`, sorted by the relative path:
    what the binary checksum covers and a release carries (``__pycache__`` and ``.pyc`` left out)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if not name.endswith(".pyc"):
                path = Path(dirpath, name)
                files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


# ---------------------------------------------------------------------------------------------------------------
# Hooks


@dataclass(frozen=True)
class Hook:
    name: str
    path: str
    checksum: str
    description: str = ""
    parameters: tuple[dict[str, Any], ...] | None = None
    timeout: str = ""
    sandbox: str = ""

    def to_wire(self) -> dict[str, Any]:
        """The capabilities entry of §1.8 (``source`` is always ``local`` for discovered hooks)."""
        return {
            "name": self.name,
            "description": self.description,
            "source": "local",
            "checksum": self.checksum,
            "parameters": None if self.parameters is None else [dict(p) for p in self.parameters],
            "timeout": self.timeout,
            "sandbox": self.sandbox,
        }


@dataclass(frozen=True)
class RefusedHook:
    name: str
    path: str
    reason: str


@dataclass(frozen=True)
class HookScan:
    hooks: tuple[Hook, ...] = ()
    refused: tuple[RefusedHook, ...] = ()
    warnings: tuple[str, ...] = field(default=())

    def find(self, name: str) -> Hook | None:
        return next((h for h in self.hooks if h.name == name), None)

    def refused_json(self) -> list[dict[str, str]]:
        return [{"name": r.name, "path": r.path, "reason": r.reason} for r in self.refused]

    def to_json(self, directory: str, announced: Callable[[str], str | None] | None = None) -> dict[str, Any]:
        """What `plexd hooks list` shows: each hook as announced plus its path (and, from a daemon, the checksum
        last announced for it), the refused ones with the reason, the sidecar warnings."""
        return {"directory": directory,
                "hooks": [{**h.to_wire(), "path": h.path,
                           **({"announced_checksum": announced(h.name)} if announced is not None else {})}
                          for h in self.hooks],
                "refused": self.refused_json(), "warnings": list(self.warnings)}


def _unsafe(st: os.stat_result, what: str) -> str:
    """Why a file or directory with this stat must not be trusted, or ''."""
    if st.st_uid != 0:
        return f"{what} is owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or other (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _directory_problem(directory: Path, st: os.stat_result) -> str:
    """The hooks directory's own check, and its parents' (`plexd.trust.pathtrust`): a hook is no safer than they."""
    problem = _unsafe(st, f"hooks directory {directory}")
    if problem:
        return problem
    problem = trust_problem(directory)
    return f"hooks directory {directory}: {problem}" if problem else ""


def scan_hooks(directory: str | os.PathLike[str]) -> HookScan:
    """Discover hooks in `directory` (non-recursive), sorted by name. Never raises for a bad hook: it is refused
    or its sidecar ignored, with the reason logged and returned."""
    directory = Path(directory)
    try:
        dir_stat = directory.stat()
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        log.debug("hooks directory %s does not exist: no hooks", directory)
        return HookScan()
    except OSError as exc:
        log.warning("cannot read hooks directory %s: %s", directory, exc.strerror, extra={"component": "hooks"})
        return HookScan(warnings=(f"cannot read hooks directory {directory}: {exc.strerror}",))

    hooks: list[Hook] = []
    refused: list[RefusedHook] = []
    warnings: list[str] = []
    dir_problem = _directory_problem(directory, dir_stat)
    for name in names:
        if name.endswith(".json") or name.startswith("."):
            continue
        found = inspect_hook(directory, name, dir_problem)
        if found is None:
            continue
        if isinstance(found, RefusedHook):
            log.warning("hook %s refused: %s", name, found.reason, extra={"component": "hooks", "hook": name})
            refused.append(found)
            continue
        hook, warning = found
        if warning:
            log.warning("hook %s: %s", name, warning, extra={"component": "hooks", "hook": name})
            warnings.append(f"{name}: {warning}")
        hooks.append(hook)
    return HookScan(tuple(hooks), tuple(refused), tuple(warnings))


def inspect_hook(directory: str | os.PathLike[str], name: str, dir_problem: str | None = None,
                 ) -> tuple[Hook, str] | RefusedHook | None:
    """One hook: (the hook, a sidecar warning or ''), a RefusedHook with the reason, or None when `name` is not
    a hook at all (not an executable regular file, or gone). `dir_problem` is the directory's own check when the
    caller already made it. Used by the scan and again right before a hook runs."""
    directory = Path(directory)
    path = directory / name
    if dir_problem is None:
        try:
            dir_problem = _directory_problem(directory, directory.stat())
        except OSError as exc:
            return RefusedHook(name, str(path), f"cannot read hooks directory {directory}: {exc.strerror}")
    try:
        st = path.stat()  # follows symlinks: the target is what would run
    except OSError:
        return None  # dangling symlink or vanished meanwhile
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        return None
    problem = dir_problem or _unsafe(st, "file") or _leaves_directory(directory, path)
    if problem:
        return RefusedHook(name, str(path), problem)
    try:
        checksum = sha256_file(path)
    except OSError as exc:
        return RefusedHook(name, str(path), f"cannot read: {exc.strerror}")
    sidecar, warning = _read_sidecar(Path(f"{path}.json"))
    return Hook(name=name, path=str(path), checksum=checksum, **sidecar), warning


class HookUnusable(PlexdError):
    """The hook file cannot be turned into an image: why, in one line."""


@dataclass
class HookImage:
    """The exact bytes of a hook, hashed (`checksum`) and held by `fd`: a sealed memfd (no write, grow, shrink
    or new seal), or, for a hook over `MAX_IMAGE` or where the kernel forbids executable memfds, the hook file's
    own descriptor, which still pins the file that was hashed against a rename (not against a write in place).

    Executed as ``/proc/self/fd/N`` with the descriptor passed to the child without close-on-exec: for a binary
    the kernel opens it before the exec closes anything, and for a ``#!`` script the interpreter is handed that
    path and opens it itself, after the exec, which works only because the child still holds the descriptor
    (an fexecve with O_CLOEXEC fails for scripts with ENOENT). A script therefore sees ``$0`` as
    ``/proc/self/fd/N``."""

    fd: int
    checksum: str
    sealed: bool

    @property
    def exec_path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# A copy counts against the unit's MemoryMax for as long as the hook runs; a larger hook runs from its opened file.
MAX_IMAGE = 128 << 20
_MFD_EXEC = getattr(os, "MFD_EXEC", 0x10)  # Linux 6.3: memfds are no longer executable by default everywhere


def image_hook(path: str | os.PathLike[str]) -> HookImage:
    """Open hook `path`, check the opened file (regular, executable, root's, not writable by group or other:
    the descriptor is what runs, so it is what is checked), and copy it into a sealed memfd while hashing the
    bytes copied. Raises HookUnusable."""
    try:
        # O_NONBLOCK: a FIFO swapped in after the scan must not hang the open (fstat refuses it below).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise HookUnusable(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
            raise HookUnusable(f"{path} is not an executable regular file")
        problem = _unsafe(st, "file")
        if problem:
            raise HookUnusable(f"{path}: {problem}")
        memfd = _memfd(os.path.basename(path)) if st.st_size <= MAX_IMAGE else None
        if memfd is None:  # too large to copy, or executable memfds forbidden: run (and hash) the opened file
            return HookImage(fd, _hash_fd(fd), sealed=False)
    except BaseException:
        os.close(fd)
        raise
    try:
        digest = hashlib.sha256()
        with open(fd, "rb", closefd=True) as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(memfd, view):]
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SEAL | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
    except OSError as exc:
        os.close(memfd)
        raise HookUnusable(f"cannot read {path}: {exc.strerror}") from None
    except BaseException:
        os.close(memfd)
        raise
    return HookImage(memfd, digest.hexdigest(), sealed=True)


def _memfd(name: str) -> int | None:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    for extra in (_MFD_EXEC, 0):  # MFD_EXEC is EINVAL before Linux 6.3, where every memfd is executable
        try:
            return os.memfd_create(f"plexd-hook:{name}", flags | extra)
        except OSError as exc:
            if exc.errno == errno.EINVAL and extra:
                continue
            log.warning("cannot create an executable memfd for hook %s (%s): running it from its opened file, "
                        "which a rename cannot swap but a write in place could change", name, exc.strerror)
            return None
    return None


def _hash_fd(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _leaves_directory(directory: Path, path: Path) -> str:
    """A symlink whose target lies outside the hooks directory: whoever controls the target's directory
    controls the hook, and the directory's own check no longer covers it."""
    if not path.is_symlink():
        return ""
    target = Path(os.path.realpath(path))
    home = Path(os.path.realpath(directory))
    if target.parent != home:
        return f"symlink to {target} leaves the hooks directory {home}"
    return ""


def _read_sidecar(path: Path) -> tuple[dict[str, Any], str]:
    """Sidecar fields for `Hook`, and a warning when the sidecar exists but cannot be used (then no fields)."""
    try:
        doc = boundedjson.parse(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, ""
    except (OSError, ValueError) as exc:
        return {}, f"sidecar {path.name} ignored: {exc}"
    if not isinstance(doc, dict):
        return {}, f"sidecar {path.name} ignored: not a JSON object"
    out: dict[str, Any] = {}
    for key in ("description", "timeout", "sandbox"):
        value = doc.get(key, "")
        if not isinstance(value, str):
            return {}, f"sidecar {path.name} ignored: {key} must be a string"
        out[key] = value
    if out["timeout"]:
        from plexd.base.gojson import parse_duration

        try:
            seconds = parse_duration(out["timeout"])
        except ValueError:
            return {}, f"sidecar {path.name} ignored: timeout {out['timeout']!r} is not a Go duration"
        if seconds <= 0:  # every run would end at once as "timeout"
            return {}, f"sidecar {path.name} ignored: timeout {out['timeout']!r} is not a positive duration"
    params = doc.get("parameters")
    if params is not None:
        if not isinstance(params, list):
            return {}, f"sidecar {path.name} ignored: parameters must be a list"
        clean = []
        for i, p in enumerate(params):
            if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not p["name"]:
                return {}, f"sidecar {path.name} ignored: parameters[{i}] needs a string name"
            clean.append({"name": p["name"], "type": str(p.get("type", "string")),
                          "required": bool(p.get("required", False)), "description": str(p.get("description", ""))})
        out["parameters"] = tuple(clean)
    return out, ""


# ---------------------------------------------------------------------------------------------------------------
# Capabilities (§1.8)


def capabilities_document(
    version: str, checksum: str, hooks: Sequence[Hook], builtin_actions: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """``{"binary":{"version","checksum"},"builtin_actions":[...]|null,"hooks":[...]|null}`` — empty lists are
    ``null`` as the Go agent's nil slices are."""
    return {
        "binary": {"version": version, "checksum": checksum},
        "builtin_actions": [dict(a) for a in builtin_actions] or None,
        "hooks": [h.to_wire() for h in hooks] or None,
    }
