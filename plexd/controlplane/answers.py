"""The control plane's answers as the node uses them, whichever contract carried them, and the path escaping both
contracts share."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote


def path_escape(value: str) -> str:
    """Escape one path segment like Go's url.PathEscape: everything but unreserved characters, ``/`` included."""
    return quote(value, safe="")


@dataclass(frozen=True)
class HeartbeatResponse:
    reconcile: bool = False
    rotate_keys: bool = False


@dataclass(frozen=True)
class PeerEndpoint:
    peer_id: str
    endpoint: str


@dataclass(frozen=True)
class SecretResponse:
    key: str
    ciphertext: str
    nonce: str
    version: int
