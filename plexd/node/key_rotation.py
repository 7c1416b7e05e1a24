"""WireGuard key rotation (docs/protocol.md §1.6): a new key pair, swapped on the device, announced, kept.

Asked for by the heartbeat's ``rotate_keys``, the ``rotate_keys`` event or ``plexd rotate-keys``. One at a time:

1. The new private key is written to ``data_dir/private_key.next`` (0600): the intent.
2. The device takes it, through the converge (`private_key_updated`). WireGuard drops the sessions; what the node
   sends meanwhile waits in WireGuard's queue for the next handshake.
3. ``POST /v1/keys/rotate``. The control plane sends the new public key to every peer (``peer_key_rotated``); each
   re-adds us under it and handshakes at once, which our device (already on the new key) answers, and the queued
   packets go out. Swapping before announcing is what makes this work: a peer's handshake with the new key can
   never reach a device still on the old one.
4. Taken: ``private_key.next`` is renamed over ``private_key`` (the commit), and the returned peers are applied.
   Refused (400, 403, 404, 409): the old key goes back on the device and the intent is dropped. No answer (the
   network, a 5xx): the old key goes back too, the intent stays, and the POST is tried again with backoff; the
   control plane may have taken it, and the next try, the same public key again, settles it either way.

A crash anywhere leaves ``private_key`` as the key the control plane knew before, or the new one once taken, and
maybe ``private_key.next``: the next start finishes that rotation first thing (the same POST, the same key).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from plexd.base.backoff import Backoff
from plexd.base.errors import PlexdError
from plexd.base.failpoint import failpoint
from plexd.base.wgkeys import b64, generate_private_key, public_key_of
from plexd.controlplane.client_errors import AuthError, ControlPlaneError, PermanentError
from plexd.converge.engine import Mode
from plexd.identity.identity_store import NEXT_PRIVATE_KEY_FILE, IdentityStore
from plexd.machine.wireguard import clamp_private_key, key_fingerprint
from plexd.node.agent import Agent
from plexd.node.domain_list import wireguard
from plexd.node.mesh import MeshHandle

log = logging.getLogger(__name__)

REFUSED_STATUSES = (400, 403, 404, 409)


class RotationFailed(PlexdError):
    """The rotation did not happen; the node kept its key. `retrying`: the intent stays and is tried again."""

    def __init__(self, message: str, *, retrying: bool) -> None:
        super().__init__(message)
        self.retrying = retrying


class KeyRotation:
    def __init__(self, agent: Agent, mesh: MeshHandle, *, backoff: Backoff | None = None) -> None:
        self.agent = agent
        self.mesh = mesh
        self.store = IdentityStore(agent.config.data_dir)
        self.backoff = backoff or Backoff(base=2.0, cap=60.0)
        self._wanted = asyncio.Event()
        self._lock = asyncio.Lock()
        self.rotations = 0
        self.last_at: float | None = None
        self.last_error = ""

    def request(self, reason: str) -> None:
        log.info("key rotation requested: %s", reason)
        self._wanted.set()

    def status(self) -> dict[str, Any]:
        return {"rotations": self.rotations, "last_at": self.last_at, "last_error": self.last_error,
                "pending": self.store.path(NEXT_PRIVATE_KEY_FILE).exists()}  # no read: status has no side effects

    async def run(self) -> None:
        """The service: a rotation left by the last run first, then each one asked for."""
        if self.store.next_private_key() is not None:
            self.request("a rotation the last run did not finish")
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            await self._until_settled()

    async def _until_settled(self) -> None:
        while True:
            try:
                await self.rotate()
            except RotationFailed as exc:
                if not exc.retrying:
                    return
                delay = self.backoff.next_delay()
                log.warning("%s; trying again in %.0fs", exc, delay)
                await asyncio.sleep(delay)
                continue
            self.backoff.reset()
            return

    async def rotate(self) -> dict[str, Any]:
        """One rotation, to the end. Returns what changed; raises RotationFailed with the node on its old key."""
        await self.mesh.gate.wait_known()  # until the state is applied, converges leave the device alone
        async with self._lock:
            identity = self.agent.identity
            assert identity is not None
            new = resumed = self.store.next_private_key()
            if new is None:
                new = generate_private_key()
                self.store.write_next_private_key(new)
            public = b64(public_key_of(new))
            old_key = self.mesh.get_desired().private_key
            if not await self._use(b64(new), "key rotation: the new key"):
                await self._use(old_key, "key rotation undone: the old key")
                if resumed is None:  # nothing was announced: forget it
                    self.store.drop_next_private_key()
                raise self._failed("the device did not take the new key (corrections are held, or the converge "
                                   "failed: see the log)", retrying=resumed is not None)
            try:
                peers = await self.agent.authed(lambda: self.agent.client.rotate_keys(identity.node_id, public))
            except ControlPlaneError as exc:
                await self._use(old_key, "key rotation undone: the old key")
                refused = isinstance(exc, PermanentError | AuthError) or exc.status in REFUSED_STATUSES
                if refused:
                    self.store.drop_next_private_key()
                    raise self._failed(str(exc), retrying=False) from None
                raise self._failed(f"{exc}; the new key is kept for the next try", retrying=True) from None
            failpoint("rotation.announced")
            self.store.commit_next_private_key()
            self.agent.identity = replace(identity, private_key=new)
            self.mesh.store.edit(lambda d: d.with_peers_updated(peers), "key rotation", [p.id for p in peers])
            self.mesh.request_converge("key rotation: updated peers")
            self.rotations += 1
            self.last_at, self.last_error = time.time(), ""
            log.info("rotated the WireGuard key: public key %s (was %s); %d peer(s) updated", key_fingerprint(public),
                     key_fingerprint(identity.public_key), len(peers))
            return {"public_key": public, "previous_public_key": identity.public_key, "updated_peers": len(peers)}

    def _failed(self, why: str, *, retrying: bool) -> RotationFailed:
        self.last_error = f"key rotation failed: {why}"
        return RotationFailed(self.last_error, retrying=retrying)

    async def _use(self, private_key: str, why: str) -> bool:
        """Put `private_key` in the desired model (journaled: a state pull in flight keeps it) and converge now.
        False when the device did not take it. Asked of the device itself, not of the converge's errors: some of
        those stay while the node runs (nftables missing, a peer's name that does not resolve), and a rotation
        judged by them never succeeded, and a resumed one flipped the device between its keys for ever."""
        self.mesh.store.edit(lambda d: d.with_private_key(private_key), why, ())
        result = await self.mesh.gate.converge()
        if result.mode is not Mode.APPLIED:
            log.warning("%s: not applied (corrections are held: plexd reconcile release)", why)
            return False
        try:
            device = await wireguard(self.mesh.engine).device()
        except PlexdError as exc:
            log.warning("%s: the device cannot be read (%s)", why, exc)
            return False
        if device is None or device.private_key != clamp_private_key(private_key):
            log.warning("%s: not applied%s", why, f" ({'; '.join(result.errors)})" if result.errors else "")
            return False
        return True
