"""The relay's flow table: which session and side a packet belongs to, learned from WireGuard indices.

A flow is not its source ip:port (a NAT rewrites that; the Go relay's defect). The control plane's session gives
each side a first-contact address; a handshake initiation from a side's address is forwarded to the other side
of every session that side is in (a node relayed to two peers sends both from one port; the wrong peer drops
the initiation on its mac1, so only the right one answers), and the response binds both sides' indices to that
session. From then on a packet is routed by its receiver index, and the sending side's address follows the
packet's source when only the port changed (a NAT remap). An address may only move within its IP, so someone
who sniffs an index still has to spoof the side's IP to divert its traffic.

Pure and synchronous: `route()` gets a datagram and its source and returns where to send it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from plexd.bridge import wgheader
from plexd.bridge.sessions import Address, RelaySession

# Indices a side keeps (WireGuard uses a new one per handshake, every ~2 min; a few cover rekey overlap).
INDICES_PER_SIDE = 4
# Initiations waiting for their response (bounded: a flood of initiations cannot grow memory).
MAX_PENDING = 1024
RETIRED_KEPT = 100  # withdrawn flows remembered, oldest forgotten first

A, B = 0, 1


@dataclass
class Side:
    node_id: str
    address: Address
    indices: OrderedDict[int, None] = field(default_factory=OrderedDict)


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


@dataclass
class Drops:
    malformed: int = 0       # not a WireGuard message
    unknown_source: int = 0  # an initiation from an address no session lists
    unknown_index: int = 0   # a receiver index no session has learned
    spoofed: int = 0         # a known index from an IP its side does not have


class FlowTable:
    def __init__(self) -> None:
        self.flows: dict[str, Flow] = {}
        self._by_index: dict[int, tuple[str, int]] = {}
        # sender index of an initiation -> (source, candidate (session id, side) pairs)
        self._pending: OrderedDict[int, tuple[Address, list[tuple[str, int]]]] = OrderedDict()
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
        candidates = [(sid, i) for sid, flow in self.flows.items()
                      for i, side in enumerate(flow.sides) if side.address == source]
        if not candidates:
            # A known index of this sender's side from a new port: its NAT remapped, the session is the same.
            known = self._by_index.get(sender)
            if known is not None and self._side(*known).address[0] == source[0]:
                candidates = [known]
        if not candidates:
            candidates = [(sid, i) for sid, flow in self.flows.items()
                          for i, side in enumerate(flow.sides) if side.address[0] == source[0]]
        if not candidates:
            self.drops.unknown_source += 1
            return []
        # Behind a port-randomising NAT the port the control plane listed is not the one the relay sees: the
        # initiation tells it. Only when every candidate side is one node (two nodes behind one IP stay put).
        if len({self.flows[sid].sides[i].node_id for sid, i in candidates}) == 1:
            for sid, i in candidates:
                flow = self.flows[sid]
                self._move(flow, flow.sides[i], source)
        self._pending[sender] = (source, candidates)
        self._pending.move_to_end(sender)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        targets = []
        for sid, i in candidates:
            flow = self.flows[sid]
            self._count(flow, i, len(data), now)
            targets.append(flow.sides[1 - i].address)
        return list(dict.fromkeys(targets))

    def _response(self, sender: int, receiver: int, data: bytes, source: Address, now: float) -> list[Address]:
        pending = self._pending.pop(receiver, None)
        if pending is not None:
            initiator_address, candidates = pending
            chosen = _responder_match(self.flows, candidates, source)
            if chosen is None:
                self.drops.unknown_source += 1
                return []
            sid, i = chosen
            flow = self.flows[sid]
            self._learn(sid, i, receiver, initiator_address, flow)
        else:
            found = self._established(receiver, source)
            if found is None:
                return []
            sid, i, flow = found
        self._learn(sid, 1 - i, sender, source, flow)
        self._count(flow, 1 - i, len(data), now)
        return [flow.sides[i].address]

    def _to_receiver(self, receiver: int, data: bytes, source: Address, now: float) -> list[Address]:
        found = self._established(receiver, source)
        if found is None:
            return []
        _, i, flow = found
        self._move(flow, flow.sides[1 - i], source)
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

    def _side(self, sid: str, i: int) -> Side:
        return self.flows[sid].sides[i]

    def _learn(self, sid: str, i: int, index: int, address: Address, flow: Flow) -> None:
        side = flow.sides[i]
        self._move(flow, side, address)
        side.indices[index] = None
        side.indices.move_to_end(index)
        self._by_index[index] = (sid, i)
        while len(side.indices) > INDICES_PER_SIDE:
            old, _ = side.indices.popitem(last=False)
            if self._by_index.get(old) == (sid, i):
                del self._by_index[old]

    @staticmethod
    def _move(flow: Flow, side: Side, address: Address) -> None:
        if side.address != address:
            side.address = address
            flow.counters.address_changes += 1

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


def _same_pair(old: RelaySession, new: RelaySession) -> bool:
    return (old.peer_a_id, old.peer_a_endpoint, old.peer_b_id, old.peer_b_endpoint) == (
        new.peer_a_id, new.peer_a_endpoint, new.peer_b_id, new.peer_b_endpoint)


def _responder_match(flows: dict[str, Flow], candidates: list[tuple[str, int]],
                     source: Address) -> tuple[str, int] | None:
    """The candidate whose other side sent the response: its exact address first, else its IP (port remapped)."""
    live = [(sid, i) for sid, i in candidates if sid in flows]
    for sid, i in live:
        if flows[sid].sides[1 - i].address == source:
            return sid, i
    same_ip = [(sid, i) for sid, i in live if flows[sid].sides[1 - i].address[0] == source[0]]
    return same_ip[0] if len(same_ip) == 1 else None
