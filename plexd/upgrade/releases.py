"""The release directory (``upgrade.dir``, default /opt/plexd/releases)::

    plexd-0.2.0-1a2b3c4d5e6f.pyz     a release: version and the start of its SHA-256 in the name, 0644
    plexd-0.2.0-1a2b3c4d5e6f.pyz.sig its signature (plexd.upgrade.signing), checked again before every launch
    current -> plexd-0.2.0-….pyz     what `plexd up` runs; absent: the plexd package installed in the venv

`current` is switched by creating the new link beside it and renaming it over the old one, so a start sees the
old release or the new one, never no link. Release files are written whole (".part", fsync, rename) and never
changed afterwards: their name pins their checksum.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from plexd.base.atomicfile import fsync_directory, rename_atomic
from plexd.base.errors import PlexdError

CURRENT = "current"
KEEP = 3  # releases kept besides the current one (rollbacks without a download)


class ReleaseError(PlexdError):
    pass


def release_name(version: str, checksum: str) -> str:
    return f"plexd-{version}-{checksum[:12]}.pyz"


class Releases:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)

    def current(self) -> Path | None:
        """The release `plexd up` runs, or None for the installed package. A link to a missing file is an
        error: starting the installed package instead would hide a broken install."""
        link = self.dir / CURRENT
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ReleaseError(f"cannot read {link}: {exc.strerror}") from None
        path = (self.dir / target).resolve()
        if not path.is_file():
            raise ReleaseError(f"{link} points to {target}, which does not exist")
        return path

    def path_for(self, version: str, checksum: str) -> Path:
        return self.dir / release_name(version, checksum)

    def prepare(self) -> None:
        """Create the directory (0755: the release files are code, not secrets)."""
        try:
            self.dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise ReleaseError(f"cannot create the release directory {self.dir}: {exc.strerror}") from None

    def part_path(self, version: str, checksum: str) -> Path:
        return self.dir / f".{release_name(version, checksum)}.part"

    def commit(self, part: Path, version: str, checksum: str, signature: bytes) -> Path:
        """Move a verified download into place under its final name, its signature beside it (first: a release
        file is never there without one)."""
        final = self.path_for(version, checksum)
        sig_part = part.with_name(part.name + ".sig")
        with open(sig_part, "wb") as fh:
            fh.write(signature)
            os.fsync(fh.fileno())
        os.chmod(sig_part, 0o644)
        rename_atomic(sig_part, Path(f"{final}.sig"))
        os.chmod(part, 0o644)
        rename_atomic(part, final)
        return final

    def switch(self, release: Path | None) -> None:
        """Point `current` at `release` (None: back to the installed package), atomically and durably."""
        link = self.dir / CURRENT
        if release is None:
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
                fsync_directory(self.dir)
            return
        tmp = self.dir / f".{CURRENT}.new"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(release.name, tmp)
        rename_atomic(tmp, link)

    def prune(self, keep: set[Path]) -> list[str]:
        """Remove old releases: all but `keep`, the current one and the `KEEP` newest others."""
        try:
            current = self.current()
        except ReleaseError:
            return []
        files = sorted(self.dir.glob("plexd-*.pyz"), key=lambda p: p.stat().st_mtime, reverse=True)
        spare = [p for p in files if p != current and p not in keep]
        removed = []
        for path in spare[KEEP:]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
            with contextlib.suppress(FileNotFoundError):
                Path(f"{path}.sig").unlink()
        return removed
