"""Build a release: the plexd package as one zipapp file (``plexd-<version>.pyz``).

Why a zipapp and not a wheel: a wheel must be installed by pip into a venv, which needs an index or every dependency at
hand, and takes seconds and a network on the node. A zipapp is one file: it is verified by one SHA-256 (the "binary"
checksum, docs/decisions.md, Binary checksum, is then the file's own), placed beside the running version and switched by
a symlink, and run by the same Python and the same installed dependencies. The price: a release cannot bring new
dependencies; a version that needs one is installed with pip (README, Upgrading).

The archive is reproducible: files in sorted order, fixed timestamps and modes, no ``__pycache__``. So the same
checkout gives the same bytes, and so the same checksum, on every machine.

    python -m plexd.upgrade.zipapp OUT.pyz [--version 0.2.0]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

from plexd.trust.integrity import package_files, package_root

MAIN = b"import sys\n\nfrom plexd.cli import main\n\nsys.exit(main())\n"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the oldest time a zip entry can carry
_VERSION_LINE = re.compile(rb'^__version__ = "[^"]*"$', re.M)


def build(out: str | os.PathLike[str], *, version: str | None = None,
          overrides: Mapping[str, bytes] | None = None, root: Path | None = None) -> str:
    """Write the zipapp to `out`; return its SHA-256. `version` replaces ``plexd.__version__``; `overrides`
    replaces or adds archive members (tests build a release that fails at start this way)."""
    files = {f"plexd/{name}": path.read_bytes() for name, path in package_files(root or package_root())}
    if version is not None:
        init, count = _VERSION_LINE.subn(f'__version__ = "{version}"'.encode(), files["plexd/__init__.py"])
        if count != 1:
            raise ValueError("plexd/__init__.py has no single __version__ line to replace")
        files["plexd/__init__.py"] = init
    files["__main__.py"] = MAIN
    files.update(overrides or {})
    tmp = Path(f"{out}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, _EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, files[name])
    os.replace(tmp, out)
    return hashlib.sha256(Path(out).read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plexd.upgrade.zipapp",
                                     description="Build a plexd release zipapp from this checkout.")
    parser.add_argument("out", help="the .pyz file to write")
    parser.add_argument("--version", help="the version string the release reports (default: this checkout's)")
    args = parser.parse_args(argv)
    checksum = build(args.out, version=args.version)
    print(f"{args.out}: sha256 {checksum}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
