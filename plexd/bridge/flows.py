"""The relay's flow table: which session and side a packet belongs to, learned from WireGuard indices.

A flow is not its source ip:port (a NAT rewrites that; the Go relay's defect). The control plane's session gives
each side a first-contact address, and each side's WireGuard public key is known (the bridge's peers by id, else
the session's own `peer_a_public_key` / `peer_b_public_key`). The response to a handshake initiation binds both
sides' indices to that session; from then on a packet is routed by its receiver index.

Handshakes are checked with WireGuard's mac1 (`wgheader.mac1_ok`), which needs public keys only:
- An initiation from a side's IP goes to the one counterpart whose public key verifies its mac1 (a node relayed
  to several peers sends them all from one port; the mac1 says which peer each is for). One that verifies for no
  counterpart of any session its IP could be in is dropped and counted (`bad_mac1`).
- A response is taken only when it answers a pending initiation (its receiver index is that initiation's sender
  index), comes from exactly where the relay sent the initiation, and its mac1 verifies with the initiator's key.
- A side whose key is unknown gets no handshake relayed either way (`Flow.keyless`, in the relay's status).

mac1 proves the sender knows the receiver's public key, not who the sender is: it shuts out a stranger behind the
same CGNAT (or spoofing its IP), who does not know the pair's keys, not a mesh member who does. So a side's address
still moves only on proof, never because a packet came from its IP: a verified handshake answered from the new
port, or a packet carrying an index of the established flow from the side's IP (a NAT remap). Pending initiations
are bounded per side, and one from a port the side was neither listed nor proven at never evicts a fresh one
from its address.

Pure and synchronous: `route()` gets a datagram and its source and returns where to send it.
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from plexd.bridge import wgheader
from plexd.state.relay_block import Address, RelaySession

# Indices a side keeps (WireGuard uses a new one per handshake, every ~2 min; a few cover rekey overlap).
INDICES_PER_SIDE = 4
# Initiations of a side waiting for their response: per side, so no one else's can evict them.
PENDING_PER_SIDE = 8
# An unanswered initiation is stale after this: WireGuard retries with a new one every 5 s (REKEY_TIMEOUT).
# A fresh one from the side's own address is never evicted by one from another port.
PENDING_SECONDS = 10.0
# WireGuard's REJECT_AFTER_TIME: keys this old are never used, so a side silent this long has no session through
# the relay left to divert, and where its next initiation comes from is the best guess of its port again.
SESSION_LIFETIME = 180.0
RETIRED_KEPT = 100  # withdrawn flows remembered, oldest forgotten first

A, B = 0, 1


@dataclass
class Pending:
    """An initiation forwarded and not yet answered."""

    source: Address  # where it came from: the side's address once answered
    target: Address  # where it went: the only address its response is accepted from
    at: float


@dataclass
class Side:
    node_id: str
    address: Address
    mac1_key: bytes | None = None  # from its WireGuard public key; None: unknown, no handshake of it is relayed
    indices: OrderedDict[int, None] = field(default_factory=OrderedDict)
    pending: OrderedDict[int, Pending] = field(default_factory=OrderedDict)  # by the initiation's sender index
    proven_at: float | None = None  # the last packet that proved `address` (None: only the control plane's word)


@dataclass
class Counters:
    packets_a_to_b: int = 0
    bytes_a_to_b: int = 0
    packets_b_to_a: int = 0
    bytes_b_to_a: int = 0
    last_activity: float | None = None
    address_changes: int = 0


@dataclass
class Flow:
    session: RelaySession
    sides: tuple[Side, Side]
    counters: Counters = field(default_factory=Counters)

    @property
    def stable(self) -> bool:
        """Both sides have completed a handshake through us: their current addresses are known."""
        return all(side.indices for side in self.sides)

    @property
    def keyless(self) -> list[str]:
        """The sides (node ids) whose public key is unknown: the session relays no handshake until it is known."""
        return [side.node_id for side in self.sides if side.mac1_key is None]


@dataclass
class Drops:
    malformed: int = 0       # not a WireGuard message
    unknown_source: int = 0  # an initiation from an IP no session lists
    bad_mac1: int = 0        # a handshake whose mac1 no public key it could be for verifies
    unknown_index: int = 0   # a receiver index no session has learned
    spoofed: int = 0         # a known index from an IP its side does not have


class FlowTable:
    def __init__(self) -> None:
        self.flows: dict[str, Flow] = {}
        self._by_index: dict[int, tuple[str, int]] = {}
        self._peer_keys: Mapping[str, str] = {}  # node id -> WireGuard public key (base64), the bridge's peers
        self.drops = Drops()
        # Flows of sessions withdrawn lately (never routed): the same session assigned again resumes with what it
        # had learned, instead of waiting for both ends' next handshake (WireGuard's ~15 s of silence first).
        self._retired: OrderedDict[str, Flow] = OrderedDict()

    # The desired sessions

    def set_sessions(self, sessions: list[RelaySession]) -> None:
        """Replace the sessions; a session whose assignment did not change keeps what it learned."""
        wanted = {s.session_id: s for s in sessions}
        for sid in list(self.flows):
            if sid not in wanted:
                self.remove(sid)
        for sid, session in wanted.items():
            flow = self.flows.get(sid)
            if flow is not None and _same_pair(flow.session, session):
                flow.session = session  # a new expires_at only
                continue
            if flow is not None:
                self.remove(sid)
            retired = self._retired.pop(sid, None)
            if retired is not None and _same_pair(retired.session, session):
                self._restore(retired, session)
                continue
            self.flows[sid] = Flow(session, (Side(session.peer_a_id, session.peer_a_endpoint),
                                             Side(session.peer_b_id, session.peer_b_endpoint)))
        self._resolve_keys()

    def set_peer_keys(self, keys: Mapping[str, str]) -> None:
        """The public keys of the nodes sessions may name (the state's peers): a side's key is its node's here,
        else the one its session names. A changed key applies to the next handshake; learned indices stay."""
        self._peer_keys = dict(keys)
        self._resolve_keys()

    def _resolve_keys(self) -> None:
        for flow in self.flows.values():
            listed = (flow.session.peer_a_public_key, flow.session.peer_b_public_key)
            for side, own in zip(flow.sides, listed, strict=True):
                side.mac1_key = _mac1_key(self._peer_keys.get(side.node_id) or own)

    def remove(self, session_id: str) -> None:
        flow = self.flows.pop(session_id, None)
        if flow is None:
            return
        for side in flow.sides:
            for index in side.indices:
                if self._by_index.get(index, ("", 0))[0] == session_id:
                    del self._by_index[index]
        self._retired[session_id] = flow
        while len(self._retired) > RETIRED_KEPT:
            self._retired.popitem(last=False)

    def _restore(self, flow: Flow, session: RelaySession) -> None:
        flow.session = session
        self.flows[session.session_id] = flow
        for n, side in enumerate(flow.sides):
            for index in side.indices:
                self._by_index.setdefault(index, (session.session_id, n))

    # Packets

    def route(self, data: bytes, source: Address, now: float) -> list[Address]:
        """Where to forward `data` that came from `source`; [] means dropped (and counted)."""
        header = wgheader.parse(data)
        if header is None:
            self.drops.malformed += 1
            return []
        if header.kind == wgheader.INITIATION:
            return self._initiation(header.sender or 0, data, source, now)
        if header.kind == wgheader.RESPONSE:
            return self._response(header.sender or 0, header.receiver or 0, data, source, now)
        return self._to_receiver(header.receiver or 0, data, source, now)

    def _initiation(self, sender: int, data: bytes, source: Address, now: float) -> list[Address]:
        # The sides it may come from (at its IP) whose counterpart's key verifies its mac1: that is who it is for.
        at_ip = False
        sides: list[tuple[Flow, int]] = []
        verified: dict[bytes, bool] = {}  # by key: a node in many sessions is checked once per peer
        for flow in self.flows.values():
            for i, side in enumerate(flow.sides):
                if side.address[0] != source[0]:
                    continue
                at_ip = True
                key = flow.sides[1 - i].mac1_key
                if key is None or side.mac1_key is None:  # its response could never be checked either
                    continue
                if key not in verified:
                    verified[key] = wgheader.mac1_ok(data, key)
                if verified[key]:
                    sides.append((flow, i))
        if not sides:
            if at_ip:
                self.drops.bad_mac1 += 1
            else:
                self.drops.unknown_source += 1
            return []
        # Several: nodes behind one IP with the same peer. The side at exactly this address, if one is; else
        # each waits, and the response's mac1 (the initiator's key) says whose it was.
        exact = [(flow, i) for flow, i in sides if flow.sides[i].address == source]
        targets = []
        for flow, i in exact or sides:
            side, target = flow.sides[i], self._initiation_target(flow.sides[1 - i], now)
            _remember(side, sender, Pending(source, target, now), now)
            self._count(flow, i, len(data), now)
            targets.append(target)
        return list(dict.fromkeys(targets))

    @staticmethod
    def _initiation_target(side: Side, now: float) -> Address:
        """Where an initiation for `side` goes: its address while it is live; else where its own latest
        initiation came from (behind a port-randomising NAT the control plane's port is never the real one, and
        that initiation opened the NAT's mapping towards the relay), else its address."""
        if _live(side, now):
            return side.address
        if side.pending:
            latest = next(reversed(side.pending.values()))
            if now - latest.at < PENDING_SECONDS:
                return latest.source
        return side.address

    def _response(self, sender: int, receiver: int, data: bytes, source: Address, now: float) -> list[Address]:
        answered = self._answered(receiver, data, source, now)
        if answered is None:
            return []
        flow, i, initiator = answered
        sid = flow.session.session_id
        if flow.sides[i].address != initiator or flow.sides[1 - i].address != source:
            # A handshake that moves a side: the flow's older indices went to whoever was at the old address
            # (perhaps someone who was sent an initiation while the side was unproven), so they prove nothing now.
            self._forget_indices(sid, flow)
        self._learn(sid, i, receiver, initiator, flow, now)  # its initiation was answered: it is there
        self._learn(sid, 1 - i, sender, source, flow, now)
        self._count(flow, 1 - i, len(data), now)
        return [flow.sides[i].address]

    def _answered(self, receiver: int, data: bytes, source: Address, now: float) -> tuple[Flow, int, Address] | None:
        """The flow and side whose pending initiation `receiver` this response answers, and where that initiation
        came from. Only from exactly where the initiation was sent, only from the responder's own address while
        it is live (an initiation sent elsewhere while it was not can no longer be answered), and only with a
        mac1 of the initiator's key. None when it answers nothing, counted."""
        answers = False
        for flow in self.flows.values():
            for i, side in enumerate(flow.sides):
                pending = side.pending.get(receiver)
                responder = flow.sides[1 - i]
                if pending is None or pending.target != source or (
                        source != responder.address and _live(responder, now)):
                    continue
                answers = True
                if side.mac1_key is not None and wgheader.mac1_ok(data, side.mac1_key):
                    del side.pending[receiver]
                    return flow, i, pending.source
        if answers:
            self.drops.bad_mac1 += 1
        else:
            self.drops.unknown_index += 1
        return None

    def _to_receiver(self, receiver: int, data: bytes, source: Address, now: float) -> list[Address]:
        found = self._established(receiver, source)
        if found is None:
            return []
        _, i, flow = found
        self._prove(flow, 1 - i, source, now)  # an index of this flow from the side's IP: a NAT remap at most
        self._count(flow, 1 - i, len(data), now)
        return [flow.sides[i].address]

    def _established(self, receiver: int, source: Address) -> tuple[str, int, Flow] | None:
        """The flow whose side `i` owns index `receiver`, when the packet comes from the other side's host (its
        port may change: NAT rebinding); None, counted as a drop, for an unknown index or another host."""
        known = self._by_index.get(receiver)
        if known is None:
            self.drops.unknown_index += 1
            return None
        sid, i = known
        flow = self.flows[sid]
        if flow.sides[1 - i].address[0] != source[0]:
            self.drops.spoofed += 1
            return None
        return sid, i, flow

    # Bookkeeping

    def _learn(self, sid: str, i: int, index: int, address: Address, flow: Flow, now: float) -> None:
        side = flow.sides[i]
        self._prove(flow, i, address, now)
        side.indices[index] = None
        side.indices.move_to_end(index)
        self._by_index[index] = (sid, i)
        while len(side.indices) > INDICES_PER_SIDE:
            old, _ = side.indices.popitem(last=False)
            if self._by_index.get(old) == (sid, i):
                del self._by_index[old]

    def _prove(self, flow: Flow, i: int, address: Address, now: float) -> None:
        """Side `i` of `flow` proved it is at `address` (always within its IP)."""
        side = flow.sides[i]
        side.proven_at = now
        if side.address != address:
            side.address = address
            flow.counters.address_changes += 1

    def _forget_indices(self, sid: str, flow: Flow) -> None:
        for i, side in enumerate(flow.sides):
            for index in side.indices:
                if self._by_index.get(index) == (sid, i):
                    del self._by_index[index]
            side.indices.clear()

    @staticmethod
    def _count(flow: Flow, from_side: int, size: int, now: float) -> None:
        c = flow.counters
        if from_side == A:
            c.packets_a_to_b += 1
            c.bytes_a_to_b += size
        else:
            c.packets_b_to_a += 1
            c.bytes_b_to_a += size
        c.last_activity = now


def _remember(side: Side, sender: int, pending: Pending, now: float) -> None:
    """Keep an initiation of `side` for its response, within the bound. The oldest one from a port the side is not
    at, or a stale one, goes first: someone else behind its IP cannot push out the side's own handshakes (a new
    one from another port is itself the one dropped when all the others are the side's, and fresh)."""
    side.pending[sender] = pending
    side.pending.move_to_end(sender)
    if len(side.pending) > PENDING_PER_SIDE:
        victim = next((k for k, p in side.pending.items()
                       if p.source != side.address or now - p.at >= PENDING_SECONDS), next(iter(side.pending)))
        del side.pending[victim]


@functools.lru_cache(maxsize=1024)
def _mac1_key(public_key: str) -> bytes | None:
    """mac1's key for a base64 public key; None for none (or one that is not a key)."""
    try:
        raw = base64.b64decode(public_key, validate=True)
    except (binascii.Error, ValueError):
        return None
    return wgheader.mac1_key(raw) if len(raw) == 32 else None


def _live(side: Side, now: float) -> bool:
    """Proven lately enough that a WireGuard session through the relay may still use its address."""
    return side.proven_at is not None and now - side.proven_at < SESSION_LIFETIME


def _same_pair(old: RelaySession, new: RelaySession) -> bool:
    return (old.peer_a_id, old.peer_a_endpoint, old.peer_b_id, old.peer_b_endpoint) == (
        new.peer_a_id, new.peer_a_endpoint, new.peer_b_id, new.peer_b_endpoint)

