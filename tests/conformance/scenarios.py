"""What a conformance scenario is: one way the daemon uses one endpoint, driven through the real client.

A scenario runs against a client that is registered (its bearer set as the daemon sets it, from the identity the
register answer gives) unless it is a registration itself. It names the document it exercises; `None` means the
call must send nothing in this dialect (the contract has no such route). `result` says the document's `result`
is checked against what the call returned; `known_defect` marks a difference already known (an xfail that must
keep failing until the client is fixed, then the mark goes).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nacl.public import PrivateKey

from plexd.controlplane.client import ControlPlaneClient

Run = Callable[[ControlPlaneClient, str], Awaitable[Any]]  # (client, node id) -> what the call returned


@dataclass(frozen=True)
class Scenario:
    endpoint: str | None
    name: str
    run: Run
    result: bool = False
    registered: bool = True
    known_defect: str = ""

    @property
    def id(self) -> str:
        return f"{self.endpoint or 'nothing-sent'}:{self.name}"


def wireguard_key(seed: int) -> str:
    """A fixed X25519 public key, standard base64."""
    return base64.b64encode(bytes(PrivateKey(bytes([seed]) * 32).public_key)).decode()


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


NODE_KEY = wireguard_key(9)
NEW_NODE_KEY = wireguard_key(11)
BINARY_CHECKSUM = sha256_hex("the plexd binary")


async def first_event(client: ControlPlaneClient, node_id: str, cursor: str = "") -> Any:
    """The first event of the stream (comments skipped), as `plexd.controlplane.sse` frames it."""
    from plexd.controlplane.sse import read_events

    async with client.open_event_stream(node_id, cursor, read_timeout=10) as response:
        async for event in read_events(response.aiter_bytes()):
            return event
    raise AssertionError("the event stream ended before its first event")


def signed_by(signing_public_key: str, canonical: bytes, signature: str) -> bool:
    """Whether `signature` (standard base64) is the register answer's signing key's over `canonical`."""
    from nacl.exceptions import BadSignatureError
    from nacl.signing import VerifyKey

    try:
        VerifyKey(base64.b64decode(signing_public_key)).verify(canonical, base64.b64decode(signature))
    except (BadSignatureError, ValueError):
        return False
    return True
