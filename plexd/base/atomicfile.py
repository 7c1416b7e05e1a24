"""Crash-safe file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` to `path` via ``.tmp-<name>`` (created with `mode`), fsync, rename, fsync the directory."""
    tmp = path.with_name(f".tmp-{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT honours the umask and keeps an existing file's mode
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_directory(path.parent)


def rename_atomic(src: Path, dst: Path) -> None:
    """Rename `src` over `dst` and make the rename durable (fsync the directory)."""
    os.replace(src, dst)
    fsync_directory(dst.parent)


def fsync_directory(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
