"""Who sends the first handshake to a peer: the side with the lower public key, at once; the other a beat later.

Two nodes learn of each other (a new peer, a new endpoint) from the same control-plane event, at the same moment.
If both turned their persistent keepalive on at once, both would send a handshake initiation; each answers the
other's initiation, which replaces its own handshake state, so both drop the answer to their own ("Received
invalid response message" in wireguard-go's log) and neither has a session until the 5 s retry, sometimes the 15 s
one. The lab saw it for one pair in four.

So the node whose key sorts higher holds its kick back (`plexd.mesh.mesh_plan.device_update`'s `held`) and sends it
`FOLLOW_DELAY` later: by then the leader's initiation has made a session (the kick then only sends a keepalive),
or it never arrived (a NAT that needs our packet first) and our initiation goes out alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from plexd.base.errors import PlexdError
from plexd.machine.wireguard import DeviceUpdate, PeerUpdate
from plexd.mesh.mesh_plan import Change, PeerAdded, PeerKeepaliveChanged, PeerKeyChanged, PeerRemoved

log = logging.getLogger(__name__)

FOLLOW_DELAY = 1.0


def leads(own_key: str, peer_key: str) -> bool:
    """Whether we send the first handshake to `peer_key` (`own_key` "" when there is no private key: we lead).
    Any order both sides compute alike will do."""
    return own_key < peer_key


class FirstContact:
    """The kicks this node held back (public key -> keepalive to turn on) and the one task that sends them.

    `send` applies a device update under the WireGuard domain's device lock. A held peer's keepalive reads 0 on the
    device until its kick has been applied: a full converge takes `pending()` just before it reads the device, and
    `hides` keeps it from reporting that 0 as drift. The kick runs on its own task, so it may go out while the
    converge reads, or between its read and its plan: what counts is what was not yet applied when it read."""

    def __init__(self, send: Callable[[DeviceUpdate], Awaitable[None]], delay: float = FOLLOW_DELAY) -> None:
        self._send = send
        self.delay = delay
        self.held: dict[str, tuple[int, float]] = {}  # public key -> (keepalive, when to kick, loop time)
        self._kicking: dict[str, int] = {}  # public key -> keepalive, of the kick on its way to the device
        self._task: asyncio.Task[None] | None = None

    def hold(self, own_key: str, kicks: Mapping[str, int]) -> frozenset[str]:
        """Of the peers `kicks` would handshake with now, the ones that lead: held back, and returned."""
        held = {key: keepalive for key, keepalive in kicks.items() if not leads(own_key, key)}
        if not held:
            return frozenset()
        due = asyncio.get_running_loop().time() + self.delay
        # a peer held already keeps its kick's time: endpoints changing faster than the delay (a flapping path)
        # must not push it back for ever, now that each held change leaves its keepalive off
        self.held.update((key, (keepalive, min(due, self.held.get(key, (0, due))[1])))
                         for key, keepalive in held.items())
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="first-contact")
        return frozenset(held)

    def pending(self) -> dict[str, int]:
        """The kicks not applied yet (public key -> keepalive): held, or on their way to the device."""
        return {**{key: keepalive for key, (keepalive, _) in self.held.items()}, **self._kicking}

    @staticmethod
    def hides(change: Change, pending: Mapping[str, int]) -> bool:
        """A keepalive still off, read while its kick was `pending`: as it must be, not drift."""
        return (isinstance(change, PeerKeepaliveChanged) and change.have == 0
                and change.want == pending.get(change.public_key))

    def applied(self, changes: Iterable[Change]) -> None:
        """Forget held peers these applied changes removed, renamed or set the keepalive of. Not for a keepalive
        set to the held value (the change the hold itself keeps off until its kick), nor for a key removed and added
        back in the same transaction (it moved to another peer id: its hold is the new peer's)."""
        changes = list(changes)
        added = {c.public_key for c in changes if isinstance(c, PeerAdded | PeerKeyChanged)}
        for c in changes:
            if isinstance(c, PeerKeepaliveChanged):
                held = self.held.get(c.public_key)
                if held is None or c.want != held[0]:
                    self.held.pop(c.public_key, None)
            elif isinstance(c, PeerRemoved) and c.public_key not in added:
                self.held.pop(c.public_key, None)
            elif isinstance(c, PeerKeyChanged) and c.old_key not in added:
                self.held.pop(c.old_key, None)

    def cancel(self) -> None:
        self.held.clear()
        self._kicking.clear()
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.held:
            await asyncio.sleep(max(0.0, min(due for _, due in self.held.values()) - loop.time()))
            now = loop.time()
            due = {key: keepalive for key, (keepalive, when) in self.held.items() if when <= now}
            for key in due:
                del self.held[key]
            if due:
                self._kicking = due
                try:
                    await self._kick(due)
                finally:
                    self._kicking = {}

    async def _kick(self, due: Mapping[str, int]) -> None:
        # Off, then on: WireGuard sends a keepalive (a handshake initiation when there is no session yet).
        # update_only: a peer removed meanwhile is not added back.
        off = [PeerUpdate(public_key=k, update_only=True, persistent_keepalive=0) for k in due]
        on = [PeerUpdate(public_key=k, update_only=True, persistent_keepalive=v) for k, v in due.items()]
        try:
            await self._send(DeviceUpdate(peers=(*off, *on)))
        except PlexdError as e:  # the device went away: the next converge puts the keepalive back
            log.warning("could not turn on the keepalive of %d peer(s) after their first contact: %s", len(due), e)
