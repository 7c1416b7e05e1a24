"""The one code path that touches the mesh: observe the live machine, diff, apply the minimal changes.

`await converger.converge(desired)` is the whole API for callers (startup, the periodic reconciler, event
handlers). It never raises for things the machine or the control plane can cause: failures are logged with the
peer or setting they concern and returned in `ConvergeResult.errors`, so the daemon keeps running and the next
converge tries again (level-triggered).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ipaddress
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from plexd.clock import Clock
from plexd.correction import Correction
from plexd.delta import peer_delta, touched_peers
from plexd.desired import DesiredState, split_endpoint
from plexd.errors import PlexdError
from plexd.mesh.first_contact import FirstContact
from plexd.mesh.links import LinkOp, Links
from plexd.mesh.wireguard import DeviceUpdate, WireGuardBackend, WireGuardError, key_fingerprint
from plexd.plan import (
    Change,
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
    simulate,
)

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT = 3.0


@dataclass(frozen=True)
class ConvergeResult:
    """What one converge did. `changes` lists only what was applied successfully (or planned, when dry_run)."""

    changes: tuple[Change, ...] = ()
    errors: tuple[str, ...] = ()
    skipped_peers: tuple[tuple[str, str], ...] = ()  # (peer id, reason): invalid peers left out
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors

    def corrections(self) -> list[Correction]:
        """What this converge changed, one drift-report line each."""
        return [c.correction() for c in self.changes]


@functools.lru_cache(maxsize=1 << 16)
def _is_ip_endpoint(endpoint: str) -> bool:
    try:
        ipaddress.ip_address(split_endpoint(endpoint)[0])
        return True
    except ValueError:
        return False


class DomainOutcome(Protocol):
    @property
    def changes(self) -> Sequence[Change]: ...

    @property
    def errors(self) -> Sequence[str]: ...


class Domain(Protocol):
    """A further piece of machine state converged beside the WireGuard device and its link (the firewall).

    `converge(desired, full=True)` reads the live state, diffs and applies; `full=False` (events) diffs against
    the state as the domain's last apply left it. Both return the changes applied (planned, with dry_run) and
    errors, never raise for what the machine does. Domains converge before the peers: a new peer meets its rules.
    """

    name: str

    async def converge(self, desired: DesiredState, *, full: bool, dry_run: bool = False) -> DomainOutcome: ...

    async def teardown(self) -> None: ...


@dataclass(frozen=True)
class _Baseline:
    """What the last apply left: the model it was for, and the machine as it then was (observed at the last full
    converge, with every change applied since). The event path diffs against this instead of reading the device."""

    desired: DesiredState
    believed: Observed


class Converger:
    """Owns one WireGuard device and its link. One converge at a time.

    Two entry points: `converge()` reads the live machine and diffs everything (start-up, the periodic reconcile,
    `reconcile --once`); `apply_delta()` applies only what changed in the model since the last apply (events)."""

    def __init__(self, wireguard: WireGuardBackend, links: Links, *, clock: Clock | None = None,
                 domains: Sequence[Domain] = ()) -> None:
        self.wireguard = wireguard
        self.links = links
        self.domains = tuple(domains)
        self.clock = clock or Clock()
        self._lock = asyncio.Lock()
        self._names: dict[str, str] = {}  # public key -> peer id, labels for peers no longer desired
        self._baseline: _Baseline | None = None
        self.last_result: ConvergeResult | None = None
        self.first_contact = FirstContact(self._send_held_kicks)
        self.corrections: collections.Counter[str] = collections.Counter()  # drift corrected, by type (metrics)

    async def observe(self) -> Observed:
        # The link is read in a worker thread while the device is read on the loop: the two overlap.
        link, device = await asyncio.gather(self.links.observe(), self.wireguard.observe())
        return Observed(device=device, link=link, process_gone=self.wireguard.process_gone(),
                        peer_names=dict(self._names))

    async def converge(self, desired: DesiredState, *, dry_run: bool = False) -> ConvergeResult:
        async with self._lock:
            try:
                result = await self._converge(desired, dry_run)
            except PlexdError as e:
                log.error("converge failed: %s", e)
                result = ConvergeResult(errors=(str(e),), skipped_peers=desired.rejected, dry_run=dry_run)
            self.last_result = result
            return result

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None = None) -> ConvergeResult:
        """Apply what changed in `desired` since the last apply, without reading the device back: O(change).

        Falls back to a full converge when there is no baseline (start, or the last apply failed), when something
        other than peers changed, or when the delta itself fails (the device went away, a peer was refused).
        `touched`: the peer ids the edits since the last apply named (a superset is fine); None: find them."""
        async with self._lock:
            try:
                result = await self._delta(desired, touched)
            except PlexdError as e:
                log.warning("applying an event's change failed (%s); converging in full", e)
                result = None
            if result is None:
                self._baseline = None
                try:
                    result = await self._converge(desired, False)
                except PlexdError as e:
                    log.error("converge failed: %s", e)
                    result = ConvergeResult(errors=(str(e),), skipped_peers=desired.rejected)
            self.last_result = result
            return result

    async def _domains(self, desired: DesiredState, *, full: bool,
                       dry_run: bool = False) -> tuple[list[Change], list[str]]:
        changes: list[Change] = []
        errors: list[str] = []
        for domain in self.domains:
            outcome = await domain.converge(desired, full=full, dry_run=dry_run)
            changes.extend(outcome.changes)
            errors.extend(outcome.errors)
        return changes, errors

    async def _delta(self, desired: DesiredState, named: Collection[str] | None) -> ConvergeResult | None:
        base = self._baseline
        if base is None:
            return None
        if named is None:
            touched = touched_peers(base.desired, desired)
        else:
            before, after = base.desired.peers, desired.peers
            touched = [pid for pid in named if before.get(pid) is not after.get(pid)]
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
        domain_changes, domain_errors = await self._domains(desired, full=False)
        if changes:
            update = self._device_update(desired, changes)
            if not update.is_empty():
                await self.wireguard.apply(update)  # WireGuardError: the full converge finds out why
            failures = await self.links.apply(link_ops(changes))
            if failures:
                return None
        self._baseline = _Baseline(desired, simulate(base.believed, changes))
        self.first_contact.applied(changes)
        for c in changes:
            log.debug("applied: %s", c.detail)
        return ConvergeResult((*domain_changes, *changes), tuple(domain_errors), desired.rejected, False)

    async def _converge(self, desired: DesiredState, dry_run: bool) -> ConvergeResult:
        errors: list[str] = []
        for pid, peer in desired.peers.items():
            self._names[peer.public_key] = pid
        unresolved = desired
        desired, resolve_errors = await self._resolve_endpoints(desired)
        errors.extend(resolve_errors)

        observed = await self.observe()
        if observed.link is not None and not observed.link.is_wireguard:
            raise WireGuardError(
                f"interface {desired.interface} already exists and is a {observed.link.kind or 'non-WireGuard'} "
                "link, not WireGuard: delete it or set mesh.interface to another name"
            )
        changes = [c for c in diff(desired, observed, self.clock.now().timestamp())
                   if not self.first_contact.hides(c)]
        # The other domains first (the firewall): a peer added below already meets its rules.
        domain_changes, domain_errors = await self._domains(desired, full=True, dry_run=dry_run)
        if dry_run:
            if self._baseline is not None:  # nothing applied, but the machine was read: believe what was seen
                self._baseline = replace(self._baseline, believed=observed)
            return ConvergeResult((*domain_changes, *changes), (*domain_errors, *errors), desired.rejected, dry_run)
        if not changes:
            self._baseline = _Baseline(unresolved, observed) if not errors else None
            self._corrected(domain_changes)
            return ConvergeResult(tuple(domain_changes), (*domain_errors, *errors), desired.rejected, False)

        applied: list[Change] = []
        if isinstance(changes[0], InterfaceMissing | UserspaceProcessGone):
            await self.wireguard.ensure_device()  # PlexdError (missing binary, ...) ends this converge
            applied.append(changes[0])
            log.info("%s", changes[0].detail, extra={"interface": desired.interface})

        failed_keys, device_errors = await self._apply_device(self._device_update(desired, changes))
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

        ops = link_ops(changes)
        failures = await self.links.apply(ops)
        failed_ops: set[LinkOp] = set()
        for op, why in failures:
            msg = f"interface {desired.interface}: {op.action} {op.value if op.value is not None else ''}: {why}"
            log.error("%s", msg, extra={"interface": desired.interface})
            errors.append(msg)
            failed_ops.add(op)
        applied.extend(c for c in changes if isinstance(c, LinkChange) and c.link_op() not in failed_ops)

        self.first_contact.applied(applied)
        self._corrected([*domain_changes, *applied])
        # The next event diffs against this (only when everything applied: otherwise the device is not known).
        self._baseline = _Baseline(unresolved, simulate(observed, applied)) if not errors else None
        return ConvergeResult((*domain_changes, *applied), (*domain_errors, *errors), desired.rejected, False)

    def _corrected(self, changes: Sequence[Change]) -> None:
        for c in changes:
            log.info("corrected: %s", c.detail, extra={"correction": c.correction_type})
            self.corrections[c.correction_type] += 1

    def _device_update(self, desired: DesiredState, changes: Sequence[Change]) -> DeviceUpdate:
        """The changes as one device transaction, less the first handshakes this node leaves to the peer."""
        held = self.first_contact.hold(desired.public_key, first_contacts(changes))
        return device_update(changes, held)

    async def _send_held_kicks(self, update: DeviceUpdate) -> None:
        async with self._lock:
            await self.wireguard.apply(update)

    async def _apply_device(self, update: DeviceUpdate) -> tuple[set[str], list[str]]:
        """Send all device changes in one transaction; if refused, retry piece by piece to name the culprit."""
        if update.is_empty():
            return set(), []
        try:
            await self.wireguard.apply(update)
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
                await self.wireguard.apply(piece)
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

    def believed_peer_count(self) -> int | None:
        """Peers on the device as the last full read saw them plus every change applied since; None when that is
        not known (start, or the last apply failed). Lets the heartbeat count without dumping the device."""
        base = self._baseline
        if base is None or base.believed.device is None:
            return None
        return len(base.believed.device.peers)

    async def teardown(self) -> None:
        """Remove the device (and its link) and every domain's state: shutdown with deregistration."""
        self._baseline = None
        self.first_contact.cancel()
        for domain in self.domains:
            await domain.teardown()
        await self.wireguard.delete_device()
        try:
            await self.links.delete_link()
        except PlexdError as e:
            log.warning("%s", e)
        self.links.close()

