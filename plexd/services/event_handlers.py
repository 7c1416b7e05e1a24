"""What each verified event does (docs/protocol.md §2.3): update the desired model, then ask for a converge.

Events are hints; the reconciler's state pull is the truth. A handler therefore only edits the desired model
(`DesiredStore.edit` with a `DesiredState.with_*` change, journaled so that a state pull in flight cannot undo
it) and requests a converge; an event that says the state changed without carrying the change
(``policy_updated``) asks for a state refresh: the state is pulled and applied through the event path.
``rotate_keys`` starts a WireGuard key rotation when one is wired in (`plexd.node.key_rotation`), else a
reconcile. A payload of the wrong shape raises WireFormatError, which the event stream logs with the event id as
a rejected event.

Event types owned by other subsystems (``action_request``, tunnels, bridge, access, ingress, site-to-site) are
routed to a handler registered with `register()`; until one exists they are logged as unsupported.

These are the spec's events: the platform dialect's arrive already turned into them by the wire layer
(`plexd.controlplane.event_dialects`: a pull, or ``rotate_keys``), so nothing here knows which was spoken.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from plexd.base.errors import WireFormatError
from plexd.controlplane.envelope import Envelope
from plexd.controlplane.event_signing import Verifier, install_signing_keys, key_fingerprint
from plexd.state.desired import DesiredState, split_endpoint
from plexd.state.desired_store import DesiredStore, Edit
from plexd.state.model import DataEntry, Peer, SecretRef, SigningKeys, _fields  # _fields: Go's case-insensitive keys
from plexd.state.relay_block import parse_revoked as parse_relay_revoked
from plexd.state.relay_block import parse_session as parse_relay_session
from plexd.state.sessions_block import revoked_session_id, setup_event_session

log = logging.getLogger(__name__)

Handler = Callable[[Envelope], Awaitable[None]]

OWNED_ELSEWHERE = ("action_request",)


def _payload_object(env: Envelope) -> dict[str, Any]:
    payload = env.payload()
    if not isinstance(payload, dict):
        raise WireFormatError("payload", f"must be a JSON object for {env.event_type}")
    return payload


def _field(payload: dict[str, Any], *names: str) -> str:
    lowered = _fields(payload, "payload")
    for name in names:
        value = lowered.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise WireFormatError(f"payload.{name}", "must be a string")
        if value:
            return value
    raise WireFormatError(f"payload.{names[0]}", "missing")


def _peer(env: Envelope) -> Peer:
    peer = Peer.from_wire(_payload_object(env), "payload")
    if not peer.id:
        raise WireFormatError("payload.id", "missing")
    return peer


def apply_signing_keys(verifier: Verifier, data_dir: Path | None, keys: SigningKeys) -> bool:
    """Length-check and install new signing keys, persisting the current one. Raises InvalidSigningKeys."""
    return install_signing_keys(verifier, data_dir, keys)


class EventHandlers:
    def __init__(
        self,
        desired: DesiredStore,
        request_converge: Callable[[str], None],  # converge soon (coalesced); the argument says why
        trigger_reconcile: Callable[[str], None],  # ask the reconciler for a full cycle (coalesced)
        verifier: Verifier,
        data_dir: Path | str | None = None,
        rotate_keys: Callable[[str], None] | None = None,  # start a WireGuard key rotation; the argument says why
        refresh_state: Callable[[str], None] | None = None,  # pull the state, apply it as events (coalesced)
        stale: Callable[[str], None] | None = None,  # an event's change did not reach the model: pull at the next cycle
    ) -> None:
        self._desired = desired
        self._rotate = rotate_keys
        self._converge = request_converge
        self._reconcile = trigger_reconcile
        self._refresh = refresh_state or trigger_reconcile
        self._stale = stale or (lambda reason: None)
        self._verifier = verifier
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._handlers: dict[str, Handler] = {
            "peer_added": self._peer_upsert,
            "peer_key_rotated": self._peer_upsert,
            "peer_removed": self._peer_removed,
            "peer_endpoint_changed": self._peer_endpoint_changed,
            "policy_updated": self._refresh_now,
            "rotate_keys": self._rotate_keys,
            "signing_key_rotated": self._signing_key_rotated,
            "node_state_updated": self._node_state_updated,
            "node_secrets_updated": self._node_secrets_updated,
            # Sessions (docs/protocol.md §A1.1): the block in the state is the truth. A new one is pulled
            # with it; a revocation is applied at once (a live shell closes within a second), the pull confirms.
            "session_setup": self._refresh_now,
            "session_revoked": self._session_revoked,
            "ssh_session_setup": self._ssh_session_setup,
            # Bridge mode's relay (docs/protocol.md §A2): deltas on the relay sessions (a node ignores them)
            "bridge_config_updated": self._refresh_now,
            "relay_session_assigned": self._relay_session_assigned,
            "relay_session_revoked": self._relay_session_revoked,
            # User access, site-to-site and ingress: the state's blocks are the truth, and these events only name
            # a change the pull brings whole (as the newer contract does for all of them).
            **dict.fromkeys(("user_access_config_updated", "user_access_peer_assigned", "user_access_peer_revoked",
                             "site_to_site_config_updated", "site_to_site_tunnel_assigned",
                             "site_to_site_tunnel_revoked", "ingress_config_updated", "ingress_rule_assigned",
                             "ingress_rule_revoked"), self._refresh_now),
        }

    def register(self, event_type: str, handler: Handler) -> None:
        """Route `event_type` to another subsystem (actions, tunnels, bridge...)."""
        self._handlers[event_type] = handler

    def handles(self, event_type: str) -> bool:
        return event_type in self._handlers

    async def dispatch(self, env: Envelope) -> None:
        handler = self._handlers.get(env.event_type)
        if handler is not None:
            await handler(env)
        elif env.event_type in OWNED_ELSEWHERE:
            log.info("event %s (%s) ignored: not supported by this plexd yet", env.event_id, env.event_type,
                     extra={"event_id": env.event_id, "event_type": env.event_type})
            self._stale(f"event {env.event_type} ignored")
        else:
            log.debug("event %s has unknown type %r; ignored", env.event_id, env.event_type,
                      extra={"event_id": env.event_id, "event_type": env.event_type})
            self._stale(f"event of unknown type {env.event_type!r}")  # whatever it said, the state has it

    async def _update(self, env: Envelope, change: Edit, peers: tuple[str, ...] = ()) -> None:
        """Edit the model (`peers`: the ids the change touches, so the apply needs no scan) and ask for an apply."""
        self._desired.edit(change, f"{env.event_type} {env.event_id}", peers)
        self._converge(f"{env.event_type} {env.event_id}")

    async def _peer_upsert(self, env: Envelope) -> None:
        peer = _peer(env)
        if not peer.public_key:
            raise WireFormatError("payload.public_key", "missing")
        log.info("event %s: %s %s", env.event_id, env.event_type, peer.id)

        def upsert(d: DesiredState) -> DesiredState:
            # A bridge's relay for the pair (`fallback_endpoint`) is the state's to say, per receiving node; a peer
            # event that does not speak of it keeps the one the last pull gave.
            had = d.peers.get(peer.id)
            if had is not None and had.fallback_endpoint and "fallback_endpoint" not in _payload_object(env):
                return d.with_peer(dataclasses.replace(peer, fallback_endpoint=had.fallback_endpoint))
            return d.with_peer(peer)

        await self._update(env, upsert, (peer.id,))

    async def _peer_removed(self, env: Envelope) -> None:
        peer_id = _field(_payload_object(env), "peer_id", "id")
        log.info("event %s: peer_removed %s", env.event_id, peer_id)
        await self._update(env, lambda d: d.without_peer(peer_id), (peer_id,))

    async def _peer_endpoint_changed(self, env: Envelope) -> None:
        payload = _payload_object(env)
        peer_id = _field(payload, "id", "peer_id")
        endpoint = _field(payload, "endpoint")
        try:  # refused here, naming it: applied, the peer would fail validation and leave the model whole
            split_endpoint(endpoint)
        except ValueError as exc:
            raise WireFormatError("payload.endpoint", str(exc)) from None
        if peer_id not in self._desired.value.peers:  # nothing to change here: the state may know the peer
            self._stale(f"peer_endpoint_changed for {peer_id}, a peer the model does not have")
        log.info("event %s: peer %s endpoint → %s", env.event_id, peer_id, endpoint)
        await self._update(env, lambda d: d.with_peer_endpoint(peer_id, endpoint), (peer_id,))

    async def _refresh_now(self, env: Envelope) -> None:
        """The event names no change (the Go agent ignores its payload): pull the state, apply what changed."""
        log.info("event %s: %s, pulling the state", env.event_id, env.event_type)
        self._refresh(env.event_type)

    async def _reconcile_now(self, env: Envelope) -> None:
        log.info("event %s: %s, reconciling", env.event_id, env.event_type)
        self._reconcile(env.event_type)

    async def _rotate_keys(self, env: Envelope) -> None:
        if self._rotate is None:
            await self._reconcile_now(env)
            return
        log.info("event %s: rotate_keys", env.event_id)
        self._rotate(f"event {env.event_id}")

    async def _signing_key_rotated(self, env: Envelope) -> None:
        keys = SigningKeys.from_wire(_payload_object(env), "payload")
        apply_signing_keys(self._verifier, self._data_dir, keys)  # InvalidSigningKeys → event rejected
        log.info("event %s: signing key rotated to %s", env.event_id, key_fingerprint(keys.current))
        self._desired.edit(lambda d: d.with_signing_keys(keys), f"{env.event_type} {env.event_id}", ())

    async def _session_revoked(self, env: Envelope) -> None:
        session_id = revoked_session_id(env.payload())
        log.info("event %s: session %s revoked", env.event_id, session_id)
        await self._update(env, lambda d: d.without_session(session_id))

    async def _ssh_session_setup(self, env: Envelope) -> None:
        session = setup_event_session(env.payload())
        log.info("event %s: session %s set up (older event shape)", env.event_id, session.session_id)
        await self._update(env, lambda d: d.with_session(session))

    async def _relay_session_assigned(self, env: Envelope) -> None:
        payload = env.payload()
        parse_relay_session(payload, "payload")  # a bad one is refused here, with its field, before any change
        log.info("event %s: relay session assigned", env.event_id)
        await self._update(env, lambda d: d.with_relay_event(lambda relay: relay.assigned(payload)))

    async def _relay_session_revoked(self, env: Envelope) -> None:
        session_id = parse_relay_revoked(env.payload(), "payload")
        log.info("event %s: relay session %s revoked", env.event_id, session_id)
        await self._update(env, lambda d: d.with_relay_event(
            lambda relay: relay.revoked({"session_id": session_id})))

    async def _node_state_updated(self, env: Envelope) -> None:
        payload = _payload_object(env)
        lowered = _fields(payload, "payload")
        metadata = lowered.get("metadata")
        if metadata is not None and (
                not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())):
            raise WireFormatError("payload.metadata", "must be an object of strings")
        raw_data = lowered.get("data") or []
        if not isinstance(raw_data, list):
            raise WireFormatError("payload.data", "must be an array")
        data = [DataEntry.from_wire(d, f"payload.data[{i}]") for i, d in enumerate(raw_data)]
        log.info("event %s: node state updated (%d data entries)", env.event_id, len(data))
        await self._update(env, lambda d: d.with_node_state(metadata, data))

    async def _node_secrets_updated(self, env: Envelope) -> None:
        payload = _payload_object(env)
        lowered = _fields(payload, "payload")
        raw = lowered.get("secret_refs") or []
        if not isinstance(raw, list):
            raise WireFormatError("payload.secret_refs", "must be an array")
        refs = [SecretRef.from_wire(r, f"payload.secret_refs[{i}]") for i, r in enumerate(raw)]
        log.info("event %s: %d secret refs", env.event_id, len(refs))
        await self._update(env, lambda d: d.with_secret_refs(refs))
