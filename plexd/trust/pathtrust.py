"""Whether a directory plexd trusts (data_dir: keys and journals; hooks.dir: code it runs as root) can be changed
by anyone but root.

A directory is only as safe as every directory above it: whoever can write a parent can rename the directory
away and put their own in its place. So the directory and each of its parents (of the path as given and of the
path it resolves to, since a symlink on the way is another place to swap) must be owned by root (or the uid
plexd runs as) and not writable by group or other. A parent may be world-writable with the sticky bit (``/tmp``):
then only an entry's owner can rename or remove it. Parts that do not exist yet are skipped: plexd creates
data_dir, and a hooks directory that appears later is checked by every scan.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from plexd.base.errors import PlexdError


class UntrustedPath(PlexdError):
    pass


def require_trusted(paths: dict[str, str]) -> None:
    """At start: refuse (one line naming the setting, the path and what is wrong) when a directory plexd trusts,
    or one above it, can be changed by someone other than root."""
    for key, path in paths.items():
        problem = trust_problem(path)
        if problem:
            raise UntrustedPath(f"refusing to start: {key} {path}: {problem}; whoever can write there could "
                                "replace what plexd trusts as root (fix the owner or mode)")


def trust_problem(path: str | os.PathLike[str]) -> str:
    """What makes `path` untrustworthy, in a few words naming the offending path, or ''."""
    target = Path(os.path.abspath(path))
    chain = [*reversed(target.parents), target]
    real = Path(os.path.realpath(target))
    chain += [p for p in (*reversed(real.parents), real) if p not in chain]
    trusted = {0, os.geteuid()}
    for part in chain:
        try:
            st = os.lstat(part)
        except (FileNotFoundError, NotADirectoryError):  # not there (yet): creating it will say what is wrong
            continue
        except OSError as exc:
            return f"cannot check {part}: {exc.strerror}"
        if st.st_uid not in trusted:
            return f"{part} is owned by uid {st.st_uid}, not root"
        if stat.S_ISLNK(st.st_mode):  # a link's own mode means nothing; its directory and its target are checked
            continue
        mode = stat.S_IMODE(st.st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            if part in (target, real):
                return f"{part} is writable by group or other (mode {mode:04o})"
            if not mode & stat.S_ISVTX:
                return f"{part} is writable by group or other without the sticky bit (mode {mode:04o})"
    return ""
