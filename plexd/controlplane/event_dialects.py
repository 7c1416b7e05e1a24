"""What the event stream does per dialect: how a frame's data is parsed and verified, what the handlers are given,
and what a replay cursor looks like.

The handlers (`plexd.services.event_handlers`) understand the spec's events (docs/protocol.md §2.3). A platform
event (docs/platform-dialect.md) is turned into one of those here, in the wire layer, once verified: its events
carry no change, they say the state changed, so every known type is the spec's `policy_updated` (whose handler
pulls the state and applies it through the engine) but for `rotate_keys` (the WireGuard key rotation) and
`signing_key_rotated` (done here: the keys are the wire's business). An unknown type is dropped.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from plexd.controlplane import envelope, platform_envelope
from plexd.controlplane.envelope import Envelope
from plexd.controlplane.event_signing import EventRejected, Verifier
from plexd.controlplane.platform_envelope import PlatformEnvelope
from plexd.controlplane.platform_signing import KeyIds, PlatformVerifier
from plexd.controlplane.sse import valid_event_id

log = logging.getLogger(__name__)

PULL = "policy_updated"  # the spec's event that names no change: its handler pulls the state
ROTATE_KEYS = "rotate_keys"
SIGNING_KEY_ROTATED = "signing_key_rotated"
ASKING_FOR_A_PULL = frozenset({
    "node_state_updated", "action_request", "session_setup", "policy_updated", "bridge_config_updated",
    "peer_registered", "peer_psk_assigned", "peer_deregistered", "peer_endpoint_changed", "peer_key_rotated",
    "session_revoked",
})
MAX_SEQUENCE_DIGITS = 20  # the platform's cursor is a uint64 sequence
NODE_SCOPE = "node:"  # an envelope's scope naming one node: `node:<node id>`


class SignedEvents(Protocol):
    """One dialect's signed events, as the stream meets them. An envelope has `event_id`, `event_type`,
    `issued_at` and `nonce` ("" in a dialect without)."""

    name: str
    cursor_rule: str  # what a usable replay cursor is, for the log

    def parse(self, data: str) -> Any: ...  # WireFormatError when malformed
    def verify(self, env: Any) -> None: ...  # EventRejected when not authentic, fresh and new
    def authentic(self, env: Any) -> bool: ...  # signed by a trusted key, whatever its time
    def to_handlers(self, env: Any) -> Envelope | None: ...  # None: nothing for the handlers to do
    def usable_cursor(self, frame_id: str) -> bool: ...


class SpecEvents:
    """docs/protocol.md §2-3: the handlers' own envelope, verified with nonces."""

    name = "spec"
    cursor_rule = "1-128 printable ASCII characters"

    def __init__(self, verifier: Verifier) -> None:
        self.verify = verifier.verify
        self.authentic = verifier.authentic

    @staticmethod
    def parse(data: str) -> Envelope:
        return envelope.parse_envelope(data)

    @staticmethod
    def to_handlers(env: Envelope) -> Envelope:
        return env

    @staticmethod
    def usable_cursor(frame_id: str) -> bool:
        return valid_event_id(frame_id)


class PlatformEvents:
    """docs/platform-dialect.md: envelopes naming their key, no nonce; every event a pull but the key events."""

    name = "platform"
    cursor_rule = "the frame's decimal sequence number"

    def __init__(self, verifier: PlatformVerifier, node_id: Callable[[], str] = lambda: "") -> None:
        self.verifier = verifier
        self.authentic = verifier.authentic
        self._node_id = node_id

    def verify(self, env: PlatformEnvelope) -> None:
        """Authentic and fresh (the verifier), and addressed to this node: an envelope scoped to another node
        (`node:<id>`) is refused, whoever signed it, as the spec dialect refuses another node's target. Other
        scopes (none, the project's) are the stream's own."""
        self.verifier.verify(env)
        own = self._node_id()
        if env.scope.startswith(NODE_SCOPE) and own and not _same_node(env.scope[len(NODE_SCOPE):], own):
            raise EventRejected("wrong_scope", f"event is scoped to {env.scope[:80]!r}, not to this node")

    @staticmethod
    def parse(data: str) -> PlatformEnvelope:
        return platform_envelope.parse_envelope(data)

    def to_handlers(self, env: PlatformEnvelope) -> Envelope | None:
        if env.type == SIGNING_KEY_ROTATED:
            self.verifier.rotate(env)
            return None
        if env.type == ROTATE_KEYS:
            return _as_spec(env, ROTATE_KEYS)
        if env.type in ASKING_FOR_A_PULL:
            log.debug("event %s (%s): asks for a state pull", env.id, env.type, extra={"event_id": env.id})
            return _as_spec(env, PULL)
        log.debug("event %s has unknown type %r; dropped", env.id, env.type,
                  extra={"event_id": env.id, "event_type": env.type})
        return None

    @staticmethod
    def usable_cursor(frame_id: str) -> bool:
        # Last-Event-ID is the frame's `id:`, a sequence number; anything else is answered 400
        return frame_id.isascii() and frame_id.isdigit() and len(frame_id) <= MAX_SEQUENCE_DIGITS


def platform_events(verifier: Verifier, data_dir: Path | str | None = None,
                    registered: Callable[[], tuple[str, str]] | None = None,
                    node_id: Callable[[], str] = lambda: "") -> PlatformEvents:
    """The platform dialect over `verifier`'s keys; `registered` gives the registration's (public key, key id),
    `data_dir` keeps the rotated keys and their ids, `node_id` the node's own id (events scoped to another are
    refused)."""
    return PlatformEvents(PlatformVerifier(verifier, KeyIds(data_dir, registered), data_dir), node_id)


def _same_node(named: str, own: str) -> bool:
    """Whether a scope's node id is this node's: as UUIDs where both are (the platform's ids; any spelling uuid
    reads, as the bearer does), else as text."""
    try:
        return uuid.UUID(named) == uuid.UUID(own)
    except ValueError:
        return named == own


def _as_spec(env: PlatformEnvelope, event_type: str) -> Envelope:
    return Envelope(event_type=event_type, event_id=env.id, issued_at=env.issued_at, nonce="",
                    payload_raw=env.payload_raw, signature=env.signature)
