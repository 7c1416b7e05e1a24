"""The SSH access sessions' host key: one Ed25519 key, generated once, kept 0600 in a directory (data_dir), reused,
so the fingerprint a client pinned stays valid across restarts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from plexd.base.errors import PlexdError

if TYPE_CHECKING:
    import asyncssh

HOST_KEY_NAME = "ssh_host_ed25519_key"


class HostKeyError(PlexdError):
    """The host key file exists but cannot be used (unreadable, not a private key, readable by others)."""


def load_or_create_host_key(directory: str | os.PathLike[str]) -> asyncssh.SSHKey:
    """The key in `directory`/ssh_host_ed25519_key, created (O_EXCL, 0600) when there is none."""
    import asyncssh  # lazily: only a node that opens an SSH session pays for asyncssh (~20 MiB)

    path = Path(directory) / HOST_KEY_NAME
    if not path.exists():
        key = asyncssh.generate_private_key("ssh-ed25519")
        data = key.export_private_key("openssh")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another start made it meanwhile: load that one
        else:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            return key
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise HostKeyError(f"{path} is readable by others (mode {mode:o}); expected 0600")
    try:
        return asyncssh.read_private_key(str(path))
    except (OSError, asyncssh.KeyImportError) as exc:
        raise HostKeyError(f"{path} is not a usable private key: {type(exc).__name__}") from None


def fingerprint(key: asyncssh.SSHKey) -> str:
    """`SHA256:<base64>`, as `ssh-keygen -lf` prints it and clients pin it."""
    return key.get_fingerprint("sha256")
