"""The event log in the platform dialect: the same Deployment events, told the way the platform tells them.

The platform's events only ask for a pull, so whatever changes a node's desired state (peers, policy, metadata,
data, secrets, bridge, a session's end) goes out as `node_state_updated {revision}`; `action_request`,
`session_setup` and `rotate_keys` keep their names, and `signing_key_rotated` carries the new key as
`{key_id, public_key, previous_key_id, transition_expires}`, signed by the old key like every announcement of it.

Each envelope is scoped to its node (`node:<id>`), so it is signed once per target and stored as its own event:
the SSE `id:` is the log's sequence number (monotonic from 1, with gaps between one node's events), which is
what `Last-Event-ID` resumes from. A key's id is derived from the key itself, so a rotation needs no bookkeeping.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from plexd.base import gojson
from plexd.controlplane.platform_envelope import sign_event
from plexd.devplane.events import RAW_FRAME, EventHub, StreamEvent, one_line, replace_signature, split_long_lines

log = logging.getLogger(__name__)

KEY_ID_PREFIX = "did:web:devplane.invalid#key-"
API_VERSION = "v1"

# What the Deployment publishes about a node's desired state; the platform says only "pull".
STATE_EVENTS = frozenset({
    "peer_added", "peer_removed", "peer_endpoint_changed", "peer_key_rotated", "policy_updated",
    "node_state_updated", "node_secrets_updated", "bridge_config_updated", "session_revoked",
})


def key_id(public_key_b64: str) -> str:
    """The signing key's id: a short digest of the key, so every key has its own and a restart keeps it."""
    return KEY_ID_PREFIX + hashlib.sha256(base64.b64decode(public_key_b64)).hexdigest()[:12]


class PlatformHub(EventHub):
    """An EventHub whose events are platform envelopes, one per target node."""

    def _translate(self, event_type: str, payload: Any, seq: int) -> tuple[str, Any]:
        if event_type in STATE_EVENTS:
            return "node_state_updated", {"revision": seq}
        if event_type == "signing_key_rotated" and isinstance(payload, dict) and "current" in payload:
            return event_type, {"key_id": key_id(payload["current"]), "public_key": payload["current"],
                                "previous_key_id": key_id(payload["previous"]),
                                "transition_expires": payload["transition_expires"]}
        return event_type, payload

    def publish(
        self,
        targets: Iterable[str],
        event_type: str,
        payload: Any = None,
        *,
        payload_raw: str | None = None,
        issued_at: str | None = None,
        nonce: str | None = None,  # the platform's envelope has none: accepted and ignored
        signature: str | None = None,
        raw_data: str | None = None,
        raw_frame: str | None = None,
    ) -> str:
        """Sign, persist and deliver one envelope per target; returns the first one's id ("" for no target).
        `signature`, `raw_data` and `raw_frame` work as in EventHub.publish (the agent's fault tests)."""
        first = ""
        signer_key, signer_id = self.signer.key, key_id(self.signer.public_key)
        raw_payload = one_line(payload_raw) if payload_raw is not None else None
        for node_id in dict.fromkeys(targets):
            self.seq += 1
            seq = self.seq
            first = first or str(seq)
            kind = event_type
            if raw_frame is not None:
                data, kind = raw_frame, RAW_FRAME
            elif raw_data is not None:
                data = raw_data
            else:
                kind, body = self._translate(event_type, payload, seq) if raw_payload is None else (event_type, None)
                data = sign_event(signer_key, f"evt_{seq}", kind, body, key_id=signer_id, scope=f"node:{node_id}",
                                  issued_at=issued_at or gojson.format_time(self._now()), payload_raw=raw_payload)
                if signature is not None:
                    data = replace_signature(data, base64.b64encode(os.urandom(64)).decode()
                                              if signature == "forge" else signature)
                data = split_long_lines(data)
            self.store.add_event(seq, kind, data, time.time(), [self.node_num(node_id)])
            event = StreamEvent(seq, kind, data)
            for sub in self.subscribers.get(node_id, ()):
                sub.push(event)
            log.debug("event %d %s -> %s", seq, kind, node_id)
        return first


def format_sse(event: StreamEvent) -> bytes:
    """One SSE block: `id: <seq>`, `event: <type>`, the envelope as `data:` (a verbatim frame as it is)."""
    if event.event_type == RAW_FRAME:
        return event.data.encode("utf-8", "surrogateescape")
    lines = [f"id: {event.seq}", f"event: {event.event_type}"]
    lines += [f"data: {part}" for part in event.data.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return ("\n".join(lines) + "\n\n").encode("utf-8")
