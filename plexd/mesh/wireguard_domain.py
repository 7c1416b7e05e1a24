"""The WireGuard domain: the mesh device, its link, addresses and routes (the engine's first citizen).

Full converge: `observe` resolves peer host names (WireGuard takes IP endpoints only, as `wg` does) and reads the
device and the link together; `plan` is the pure diff (`plexd.mesh.mesh_plan`), less the first handshakes this node
leaves to the peer (`plexd.mesh.first_contact`); `apply` sends every device change as one transaction (retried piece by
piece to name a refused peer) and the link changes after it. Events (`apply_delta`) diff only the touched peers
against the machine as the last apply left it (`_Baseline`): no device read, O(change).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from plexd.base.clock import Clock
from plexd.base.errors import PlexdError
from plexd.base.mesh_caches import bounded_by_mesh
from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.machine.links import LinkOp, Links
from plexd.machine.wireguard import (
    CounterRow,
    DeviceConfig,
    DeviceUpdate,
    PeerCounters,
    WireGuardBackend,
    WireGuardError,
    key_fingerprint,
)
from plexd.mesh.delta import peer_delta, touched_peers
from plexd.mesh.first_contact import FirstContact
from plexd.mesh.mesh_plan import (
    InterfaceMissing,
    LinkChange,
    ListenPortWrong,
    Observed,
    PeerChange,
    PrivateKeyWrong,
    UserspaceProcessGone,
    device_update,
    diff,
    first_contacts,
    link_ops,
    peer_config,
    rekey_kicks,
    simulate,
    target,
)
from plexd.state.desired import DesiredState, split_endpoint

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT = 3.0
# Link writes made only once the device has taken its changes: a route leaves after its peer, never before (a packet
# for a removed peer's address is dropped by the device, not sent to the default route).
_AFTER_DEVICE = frozenset({"route_del", "main_route_del"})


@bounded_by_mesh
@functools.lru_cache(maxsize=1 << 16)
def _is_ip_endpoint(endpoint: str) -> bool:
    try:
        ipaddress.ip_address(split_endpoint(endpoint)[0])
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class MeshObserved:
    """The live device and link, and the desired model with its peers' host names resolved."""

    machine: Observed
    resolved: DesiredState
    errors: tuple[str, ...]  # endpoints that did not resolve (those peers are configured without one)
    first_contacts: Mapping[str, int] = field(default_factory=dict)  # kicks not yet applied when the device was read


@dataclass(frozen=True)
class _Baseline:
    """What the last apply left: the model it was for, and the machine as it then was (observed at the last full
    converge, with every change applied since). The event path diffs against this instead of reading the device."""

    desired: DesiredState
    believed: Observed


def _retrieved(done: asyncio.Future[Any]) -> None:
    """A simulation nobody waited for (the apply failed) keeps no exception unretrieved."""
    if not done.cancelled():
        done.exception()


class WireGuardDomain:
    name = "wireguard"
    touches_machine = True
    acts_while_held = False

    def __init__(self, backend: WireGuardBackend, links: Links, *, clock: Clock | None = None) -> None:
        self.backend = backend
        self.links = links
        self.clock = clock or Clock()
        self._device_lock = asyncio.Lock()  # one device transaction at a time (converges and held kicks)
        self._names: dict[str, str] = {}  # public key -> peer id, labels for peers no longer desired
        self._baseline: _Baseline | None = None
        # public key -> the model's endpoint at the last apply: a full diff that finds it changed since treats it
        # as news over roaming, as the event path does (else a switch the reconcile saw first was left undone)
        self._applied_endpoints: dict[str, str] = {}
        self.first_contact = FirstContact(self._send_held_kicks)

    # -- reading ----------------------------------------------------------------------------------------------

    async def read(self) -> Observed:
        """The device and the link; the link is read in a worker thread while the device is read on the loop."""
        link, device = await asyncio.gather(self.links.observe(), self.backend.observe())
        rules = link.rules if link is not None else await self.links.observe_rules()
        return Observed(device=device, link=link, process_gone=self.backend.process_gone(),
                        peer_names=dict(self._names), rules=rules)

    async def device(self) -> DeviceConfig | None:
        """The live device alone (None when there is none): for status, metrics and the checks around a converge.
        The engine's converge reads it with the link through `observe`."""
        return await self.backend.observe()

    async def counters(self) -> Mapping[str, PeerCounters] | None:
        """Each peer's last handshake and traffic, for the metrics endpoint (None: no device)."""
        return await self.backend.counters()

    async def counter_rows(self) -> list[CounterRow] | None:
        """The same as `counters`, as the device wrote them: the cheapest read there is."""
        return await self.backend.counter_rows()

    async def close(self) -> None:
        """Let go of the device without removing it (a userspace process is stopped)."""
        await self.backend.close()

    def believed_peer_count(self) -> int | None:
        """Peers on the device as the last full read saw them plus every change applied since; None when that is
        not known (start, or the last apply failed). Lets the heartbeat count without dumping the device."""
        base = self._baseline
        if base is None or base.believed.device is None:
            return None
        return len(base.believed.device.peers)

    def status(self) -> None:
        return None

    # -- the domain -------------------------------------------------------------------------------------------

    async def observe(self, desired: DesiredState) -> MeshObserved:
        for pid, peer in desired.peers.items():
            self._names[peer.public_key] = pid
        resolved, errors = await self._resolve_endpoints(desired)
        pending = self.first_contact.pending()  # before the read: a kick applied after it was not seen either
        machine = await self.read()
        # Labels only for keys that are desired or on the device: every key ever seen (rotations, short-lived
        # nodes) made the table grow for good, and it is copied at every read.
        on_device = machine.device.peers if machine.device is not None else {}
        wanted = {peer.public_key for peer in desired.peers.values()}
        self._names = {k: pid for k, pid in self._names.items() if k in on_device or k in wanted}
        if self._baseline is not None:  # the machine was read: believe what was seen (also when only planning)
            self._baseline = replace(self._baseline, believed=machine)
        return MeshObserved(machine, resolved, tuple(errors), pending)

    def plan(self, desired: DesiredState, observed: MeshObserved) -> DomainResult:
        link = observed.machine.link
        if link is not None and not link.is_wireguard:
            raise WireGuardError(
                f"interface {desired.interface} already exists and is a {link.kind or 'non-WireGuard'} "
                "link, not WireGuard: delete it or set mesh.interface to another name"
            )
        changes = [c for c in diff(observed.resolved, observed.machine, self.clock.now().timestamp(),
                                   self._applied_endpoints)
                   if not FirstContact.hides(c, observed.first_contacts)]
        return DomainResult(tuple(changes), observed.errors)

    async def apply(self, desired: DesiredState, planned: DomainResult, observed: MeshObserved) -> DomainResult:
        applying = asyncio.ensure_future(self._apply(observed.resolved, planned.changes))
        # The machine as it will be once every change applied, what the next event diffs against: pure, so worked
        # out in a thread while the kernel applies the changes (it holds no interpreter lock) rather than after
        # them. At 1,000 new peers it was most of what a converge cost beyond the device's own apply.
        simulating = asyncio.ensure_future(asyncio.to_thread(simulate, observed.machine, planned.changes))
        simulating.add_done_callback(_retrieved)
        try:
            applied, errors = await applying
            # Used only when everything applied (then `applied` holds exactly the planned changes); otherwise the
            # device is not known.
            clean = not errors and not planned.errors
            expected = await simulating if clean else None
        except BaseException:
            applying.cancel()
            self._baseline = None  # the device is not known any more
            raise
        self.first_contact.applied(applied)
        self._note_endpoints_full(observed.resolved, planned.changes, applied)
        self._baseline = _Baseline(desired, expected) if expected is not None else None
        return DomainResult(tuple(applied), tuple(errors))

    async def _apply(self, desired: DesiredState, changes: Sequence[Change]) -> tuple[list[Change], list[str]]:
        applied: list[Change] = []
        errors: list[str] = []
        if not changes:
            return applied, errors
        if isinstance(changes[0], InterfaceMissing | UserspaceProcessGone):
            await self.backend.ensure_device()  # PlexdError (missing binary, ...) ends this converge
            applied.append(changes[0])
            log.info("%s", changes[0].detail, extra={"interface": desired.interface})

        # The link's writes that cannot open a path around the tunnel (MTU, up, addresses, rules, new routes) go
        # beside the device's transaction: the kernel applies one while Python packs the other. A route for a peer
        # not yet on the device drops its packets, as a route to a removed one does; removals wait for the device.
        ops = link_ops(changes)
        alongside = [op for op in ops if op.action not in _AFTER_DEVICE]
        outcomes = await asyncio.gather(self._apply_device(self._device_update(desired, changes)),
                                        self.links.apply(alongside), return_exceptions=True)
        # Raised only once both finished: a failure of one leaves no write of the other still running.
        if failure := next((o for o in outcomes if isinstance(o, BaseException)), None):
            raise failure
        (failed_keys, device_errors), failures = outcomes
        errors.extend(device_errors)
        for c in changes:
            if isinstance(c, InterfaceMissing | UserspaceProcessGone | LinkChange):
                continue
            if isinstance(c, PeerChange):
                if c.public_key not in failed_keys:
                    applied.append(c)
            elif isinstance(c, PrivateKeyWrong | ListenPortWrong) and c.correction_type in failed_keys:
                continue  # refused: named in errors, not reported as corrected
            else:
                applied.append(c)

        failures += await self.links.apply([op for op in ops if op.action in _AFTER_DEVICE])
        failed_ops: set[LinkOp] = set()
        for op, why in failures:
            msg = f"interface {desired.interface}: {op.action} {op.value if op.value is not None else ''}: {why}"
            log.error("%s", msg, extra={"interface": desired.interface})
            errors.append(msg)
            failed_ops.add(op)
        applied.extend(c for c in changes if isinstance(c, LinkChange) and c.link_op() not in failed_ops)
        return applied, errors

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        """Apply what changed in `desired` since the last apply, without reading the device back: O(change).
        None (converge me in full): no baseline (start, or the last apply failed), something other than peers
        changed, a host name did not resolve, or the delta itself failed (the device went away, a peer refused)."""
        try:
            return await self._delta(desired, touched)
        except PlexdError as e:
            log.warning("applying an event's change failed (%s); converging in full", e)
            self._baseline = None
            return None

    async def _delta(self, desired: DesiredState, named: Collection[str] | None) -> DomainResult | None:
        base = self._baseline
        if base is None:
            return None
        if named is None:
            touched = touched_peers(base.desired, desired)
        else:
            before, after = base.desired.peers, desired.peers
            moved = base.desired.relayed ^ desired.relayed  # the same peer, put on its other path
            touched = [pid for pid in named if before.get(pid) is not after.get(pid) or pid in moved]
        resolved, errors = await self._resolve_endpoints(desired, touched)
        if errors:
            return None  # a full converge names them (and configures the peers without an endpoint)
        for pid in touched:
            peer = desired.peers.get(pid)
            if peer is not None:
                self._names[peer.public_key] = pid
        changes = peer_delta(base.desired, resolved, base.believed, self.clock.now().timestamp(), touched)
        if changes is None:
            return None
        if changes:
            update = self._device_update(desired, changes)
            if not update.is_empty():
                async with self._device_lock:
                    await self.backend.apply(update)  # WireGuardError: the full converge finds out why
            if await self.links.apply(link_ops(changes)):
                self._baseline = None
                return None
        self._baseline = _Baseline(desired, simulate(base.believed, changes))
        self.first_contact.applied(changes)
        for pid in touched:
            old, new = base.desired.peers.get(pid), resolved.shown_peer(pid)
            if old is not None and (new is None or new.public_key != old.public_key):
                self._applied_endpoints.pop(old.public_key, None)
            if new is not None:
                self._applied_endpoints[new.public_key] = peer_config(new, resolved.persistent_keepalive).endpoint
        return DomainResult(tuple(changes))

    def _note_endpoints_full(self, resolved: DesiredState, planned: Sequence[Change],
                             applied: Sequence[Change]) -> None:
        """After a full apply: every shown peer's model endpoint, but for peers whose change the device refused
        (their news is still news at the next try)."""
        refused = ({c.public_key for c in planned if isinstance(c, PeerChange)}
                   - {c.public_key for c in applied if isinstance(c, PeerChange)})
        before = self._applied_endpoints
        self._applied_endpoints = {
            key: before[key] if key in refused and key in before else peer.endpoint
            for key, peer in target(resolved).device.peers.items()}

    async def teardown(self) -> None:
        """Remove the device and its link (shutdown with deregistration)."""
        self._baseline = None
        self.first_contact.cancel()
        await self.backend.delete_device()
        try:
            await self.links.delete_link()
        except PlexdError as e:
            log.warning("%s", e)

    # -- the device -------------------------------------------------------------------------------------------

    def _device_update(self, desired: DesiredState, changes: Sequence[Change]) -> DeviceUpdate:
        """The changes as one device transaction, less the first handshakes this node leaves to the peer, plus a
        handshake to every peer under a new private key (`rekey_kicks`)."""
        held = self.first_contact.hold(desired.public_key, first_contacts(changes))
        return device_update(changes, held, rekey_kicks(changes, desired))

    async def _send_held_kicks(self, update: DeviceUpdate) -> None:
        async with self._device_lock:
            await self.backend.apply(update)

    async def _apply_device(self, update: DeviceUpdate) -> tuple[set[str], list[str]]:
        """Send all device changes in one transaction; if refused, retry piece by piece to name the culprit."""
        if update.is_empty():
            return set(), []
        async with self._device_lock:
            try:
                await self.backend.apply(update)
                return set(), []
            except WireGuardError as first:
                if len(update.peers) <= 1 and (update.private_key is None and update.listen_port is None):
                    pieces = [update]
                else:
                    # Device fields one per piece too: a refused listen port must not be blamed on the private key.
                    pieces = [u for u in (DeviceUpdate(private_key=update.private_key),
                                          DeviceUpdate(listen_port=update.listen_port)) if not u.is_empty()]
                    pieces += [DeviceUpdate(peers=(p,)) for p in update.peers]
                log.debug("batched set refused (%s); retrying %d pieces", first, len(pieces))
            failed: set[str] = set()
            errors: list[str] = []
            for piece in pieces:
                try:
                    await self.backend.apply(piece)
                except WireGuardError as e:
                    if piece.peers:
                        key = piece.peers[0].public_key
                        failed.add(key)
                        pid = self._names.get(key, key_fingerprint(key))
                        msg = f"peer {pid}: {e}"
                        log.error("%s", msg, extra={"peer": pid})
                    else:
                        msg = str(e)
                        log.error("%s", msg)
                        failed.add(PrivateKeyWrong.correction_type if piece.private_key is not None
                                   else ListenPortWrong.correction_type)
                    errors.append(msg)
            return failed, errors

    async def _resolve_endpoints(self, desired: DesiredState,
                                 only: Sequence[str] | None = None) -> tuple[DesiredState, list[str]]:
        """WireGuard takes IP endpoints only (as `wg` does, resolve host names first). `only`: these peer ids."""
        errors: list[str] = []
        loop = asyncio.get_running_loop()
        peers = desired.peers.items() if only is None else [(p, desired.peers[p]) for p in only if p in desired.peers]
        for pid, peer in list(peers):
            if not peer.endpoint or _is_ip_endpoint(peer.endpoint):
                continue
            host, port = split_endpoint(peer.endpoint)
            try:
                async with asyncio.timeout(RESOLVE_TIMEOUT):  # not wait_for: it can swallow a cancel on 3.11
                    infos = await loop.getaddrinfo(host, port, type=2)
                ip = infos[0][4][0]
                endpoint = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            except (OSError, TimeoutError, IndexError) as e:
                msg = f"peer {pid}: cannot resolve endpoint {peer.endpoint}: {e or 'timeout'}"
                log.warning("%s; configuring it without an endpoint", msg, extra={"peer": pid})
                errors.append(msg)
                endpoint = ""
            desired = replace(desired, peers={**desired.peers, pid: replace(peer, endpoint=endpoint)})
        return desired, errors
