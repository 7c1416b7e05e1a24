"""The relay domain (bridge mode): the UDP relay and its kernel fast path, converged to the relay sessions the
control plane assigns (docs/protocol.md §A2).

Desired: `desired.relay`, the sessions of the last listing (a state's `bridge.relay.sessions` or
`relay_config.sessions`, or the set after a `relay_session_assigned` / `_revoked` event). Each new listing
restarts the sessions' leases; while the control plane is unreachable they are refreshed, not expired
(`plexd.bridge.relay`). Each side's WireGuard public key, which the relay checks handshakes with, is its node's in
`desired.peers` (kept current by every apply: a rotated key is followed), else the one the session names; a side
with neither gets no handshake relayed, logged once and said in the session's status (`handshakes_refused`).
Observed: whether the relay's socket is still open, and the fast path's table and map elements as nftables lists
them. The plan, each change also its drift line:

    RelayListening        relay_listener_started    the relay's socket is not open (first start, or it died)
    RelaySessionAdded     relay_session_added       a session listed that the relay does not serve
    RelaySessionRemoved   relay_session_removed     a session the relay serves that is no longer listed
    RelayFastPathRestored relay_fastpath_restored   `inet plexd_relay` or its elements are not as the relay left them

The userspace relay forwards everything the fast path does not; a fast path that cannot be applied is an error
line and the relay keeps forwarding.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar

from plexd.base.clock import Clock
from plexd.base.errors import PlexdError
from plexd.bridge.fastpath import FAMILY, TABLE, Elements
from plexd.bridge.relay import Relay
from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.state.desired import DesiredState
from plexd.state.relay_block import RelaySessionSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayListening(Change):
    correction_type: ClassVar[str] = "relay_listener_started"
    address: str
    first: bool

    @property
    def detail(self) -> str:
        return f"relay {self.address}: " + ("not started yet" if self.first else "its socket is closed; reopened")


@dataclass(frozen=True)
class RelaySessionAdded(Change):
    correction_type: ClassVar[str] = "relay_session_added"
    session_id: str

    @property
    def detail(self) -> str:
        return f"relay session {self.session_id}: assigned, not served"


@dataclass(frozen=True)
class RelaySessionRemoved(Change):
    correction_type: ClassVar[str] = "relay_session_removed"
    session_id: str

    @property
    def detail(self) -> str:
        return f"relay session {self.session_id}: served, no longer assigned"


@dataclass(frozen=True)
class RelayFastPathRestored(Change):
    correction_type: ClassVar[str] = "relay_fastpath_restored"
    what: str

    @property
    def detail(self) -> str:
        return f"relay fast path {FAMILY} {TABLE}: {self.what}"


@dataclass(frozen=True)
class RelaySeen:
    listening: bool
    fastpath: Elements | None = None  # the live map elements; None: no fast path wanted or not installed yet
    table_missing: bool = False
    error: str = ""


class RelayDomain:
    name = "relay"
    touches_machine = True
    acts_while_held = False

    def __init__(self, host: str, port: int, *, fastpath_address: str = "",
                 cp_reachable: Callable[[], bool] = lambda: True, clock: Clock | None = None) -> None:
        self.relay = Relay(host, port, cp_reachable=cp_reachable, clock=clock)
        self.address = f"{host}:{port}"
        self.fastpath_address = fastpath_address
        self._started = False
        self._served: RelaySessionSet | None = None
        self._logged_refusals: set[tuple[str, str]] = set()
        self._logged_keyless: set[tuple[str, str]] = set()

    async def observe(self, desired: DesiredState) -> RelaySeen:
        fastpath = self.relay.fastpath
        if fastpath is None or not fastpath.installed:
            return RelaySeen(self.relay.listening)
        try:
            objects = await asyncio.to_thread(fastpath.nft.list_table, FAMILY, TABLE)
        except PlexdError as e:
            return RelaySeen(self.relay.listening, error=f"relay: reading {FAMILY} {TABLE}: {e}")
        if objects is None:
            return RelaySeen(self.relay.listening, table_missing=True)
        return RelaySeen(self.relay.listening, live_elements(objects))

    def plan(self, desired: DesiredState, seen: RelaySeen) -> DomainResult:
        changes: list[Change] = []
        if not seen.listening:
            changes.append(RelayListening(self.address, first=not self._started))
        served = set(self._served.sessions) if self._served is not None else set()
        wanted = set(desired.relay.sessions) if desired.relay is not None else set()
        changes += [RelaySessionAdded(sid) for sid in sorted(wanted - served)]
        changes += [RelaySessionRemoved(sid) for sid in sorted(served - wanted)]
        fastpath = self.relay.fastpath
        if seen.table_missing:
            changes.append(RelayFastPathRestored("table missing; recreated"))
        elif fastpath is not None and seen.fastpath is not None and seen.fastpath != fastpath.current:
            missing = len(set(fastpath.current.items()) - set(seen.fastpath.items()))
            extra = len(set(seen.fastpath.items()) - set(fastpath.current.items()))
            changes.append(RelayFastPathRestored(f"{missing} element(s) missing, {extra} not the relay's; synced"))
        return DomainResult(tuple(changes), (seen.error,) if seen.error else ())

    async def apply(self, desired: DesiredState, planned: DomainResult, seen: Any) -> DomainResult:
        errors: list[str] = []
        if not self.relay.listening:
            try:
                await self._listen()
            except OSError as e:
                return DomainResult(errors=(f"relay: cannot listen on {self.address}: {e.strerror or e}",))
        if desired.relay is not self._served:  # a new listing: the sessions' leases start again
            self._served = desired.relay
            self.relay.set_sessions(list(desired.relay or ()))
            self._note_refusals(desired.relay)
        self.relay.set_peer_keys(peer_keys(desired))
        self._note_keyless()
        fastpath = self.relay.fastpath
        if fastpath is not None and isinstance(seen, RelaySeen):
            if seen.table_missing:
                fastpath.installed = False
            elif seen.fastpath is not None:
                fastpath.current = dict(seen.fastpath)  # the next sync diffs against what is really there
        await self.relay.sync_fastpath()
        if self.relay.fastpath_error:
            errors.append(f"relay: fast path not applied (the userspace relay forwards): {self.relay.fastpath_error}")
        return DomainResult(planned.changes, tuple(errors))

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        if not self._started:
            return None
        seen = RelaySeen(self.relay.listening)
        return await self.apply(desired, self.plan(desired, seen), seen)

    async def _listen(self) -> None:
        if self._started:
            await self.relay.stop()  # what is left of the dead one: its tasks and fast path
        await self.relay.start()
        self._started = True
        if self.fastpath_address:
            try:
                await self.relay.enable_fastpath(self.fastpath_address)
            except (ValueError, PlexdError) as e:
                self.relay.fastpath_error = str(e)

    async def teardown(self) -> None:
        await self.relay.stop()

    def status(self) -> dict[str, Any] | None:
        if not self._started:
            return None
        doc = self.relay.status()
        doc["refused"] = [{"session_id": r.session_id, "reason": r.reason}
                          for r in (self._served.refused if self._served is not None else [])]
        return doc

    def _note_keyless(self) -> None:
        for sid, flow in self.relay.table.flows.items():
            for node_id in flow.keyless:
                if (sid, node_id) not in self._logged_keyless:
                    self._logged_keyless.add((sid, node_id))
                    log.warning("relay session %s: no WireGuard public key for %s (not a peer in the state, and the "
                                "session names none): none of its handshakes are relayed", sid, node_id)

    def _note_refusals(self, sessions: RelaySessionSet | None) -> None:
        for r in sessions.refused if sessions is not None else []:
            if (r.session_id, r.reason) not in self._logged_refusals:
                self._logged_refusals.add((r.session_id, r.reason))
                log.error("%s", r.reason)


def peer_keys(desired: DesiredState) -> dict[str, str]:
    """The public keys of the nodes the relay sessions name, from the state's peers."""
    ids = {x for s in desired.relay or () for x in (s.peer_a_id, s.peer_b_id)}
    return {pid: desired.peers[pid].public_key for pid in ids if pid in desired.peers}


def live_elements(objects: list[Any]) -> Elements:
    """The fast path's `fwd_addr` and `fwd_port` maps, as nftables lists them, joined back into
    sender address -> the other side's address."""
    maps: dict[str, dict[tuple[str, int], Any]] = {"fwd_addr": {}, "fwd_port": {}}
    for obj in objects:
        m = obj.get("map") if isinstance(obj, dict) else None
        if not isinstance(m, dict) or m.get("name") not in maps:
            continue
        for key, value in m.get("elem") or []:
            concat = key.get("concat") if isinstance(key, dict) else None
            if isinstance(concat, list) and len(concat) == 2:
                maps[m["name"]][(str(concat[0]), int(concat[1]))] = value
    return {sender: (str(ip), int(maps["fwd_port"][sender])) for sender, ip in maps["fwd_addr"].items()
            if sender in maps["fwd_port"]}

