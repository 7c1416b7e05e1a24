"""The bridge's own WireGuard keys for the interfaces it serves (user access, site-to-site tunnels).

Generated once and kept (0600, in `data_dir/bridge/`): the Go agent made a new key at every start, so every client's and
remote site's configuration broke on restart (docs/decisions.md, Go defect D4). The public key is what
`plexd status --json` and the status reports publish, so the other end can be configured.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from plexd.base.atomicfile import write_atomic
from plexd.base.errors import PlexdError
from plexd.base.wgkeys import b64, decode_key, generate_private_key, public_key_of


class BridgeKeyError(PlexdError, OSError):
    pass


def key_path(data_dir: str | os.PathLike[str], owner: str) -> Path:
    """`owner`: "access", or a tunnel's id (hashed: ids are the control plane's, file names are ours)."""
    name = owner if owner == "access" else "s2s-" + hashlib.sha256(owner.encode()).hexdigest()[:20]
    return Path(data_dir) / "bridge" / f"{name}.key"


def interface_key(data_dir: str | os.PathLike[str], owner: str) -> tuple[str, str]:
    """(private, public) in base64: the kept key, or a new one written first. A kept key that cannot be read
    is an error, never silently replaced (the other end would stop working)."""
    path = key_path(data_dir, owner)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        private = generate_private_key()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, (b64(private) + "\n").encode(), mode=0o600)
        return b64(private), b64(public_key_of(private))
    try:
        private = decode_key(text, f"the bridge key {path}")
    except ValueError as e:
        raise BridgeKeyError(f"{e}: remove it to make a new one (its clients must then be given the new key)") \
            from None
    return b64(private), b64(public_key_of(private))


def forget_key(data_dir: str | os.PathLike[str], owner: str) -> None:
    """A tunnel the control plane removed for good: its key goes with it (deregistration --purge removes all)."""
    try:
        key_path(data_dir, owner).unlink()
    except FileNotFoundError:
        pass
