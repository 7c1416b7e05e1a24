"""The node's mesh: one engine, one desired model (mirrored to data_dir for an offline start).

    events ──edit──▶ DesiredStore ◀──replace_from_pull── reconciler (GET /state)
                          │
                     MeshHandle.converge() ──▶ Engine.converge (every domain: observe → plan → apply)
                     MeshHandle.apply_events() ──▶ Engine.apply_delta (what the events touched, no machine read)
                          │
                     the engine's hold: while an operator holds, converges only plan (drift is reported as held)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plexd.base.clock import Clock
from plexd.controlplane.client import PeerEndpoint
from plexd.controlplane.event_signing import InvalidSigningKeys, NonceStore, Verifier, key_fingerprint, load_signing_key
from plexd.controlplane.ledger import EventLedger
from plexd.converge.change import Correction
from plexd.converge.coalesce import Requests
from plexd.converge.engine import ConvergeResult, Engine, Mode
from plexd.converge.hold import ReconcileHold
from plexd.identity.identity_store import Identity
from plexd.node.domain_list import wireguard
from plexd.node.protected import ProtectedAddresses
from plexd.nodeapi import cache as node_cache
from plexd.state.desired import DesiredState, split_endpoint
from plexd.state.desired_store import DesiredStore
from plexd.state.model import SigningKeys, State
from plexd.state.route_limits import RouteLimits

log = logging.getLogger(__name__)

class MeshHandle:
    """Holds the desired model and converges the machine to it through the engine; one per daemon."""

    def __init__(self, engine: Engine, desired: DesiredState,
                 protected: ProtectedAddresses | None = None, known: bool = True) -> None:
        self.engine = engine
        self.store = DesiredStore(desired)  # its on_changed is the group commit's (set by the assembly)
        # False until the first state pull: a device already up (left by the last plexd) is kept as it is rather
        # than converged to a mirror that may be older than it; without a device the mirror brings it up.
        self._known = asyncio.Event()
        self.on_timed: Callable[[str, float], None] | None = None  # (full | events, seconds): the metrics
        self.known = known
        # Set by the assembly: write the mirror now (after a state pull), not at the end of the group window.
        self.persist: Callable[[], None] | None = None
        self._told_unknown = False
        self.protected = protected
        self._limits_known = protected is None
        self._refusals_seen: set[tuple[str, ...]] = set()
        self._refusals_new: list[Correction] = []
        self._policy_noted: object = None  # the compiled policy `_note_policy` last went through
        self._requests = Requests(self.apply_events)  # events ask for an apply; bursts coalesce
        # One apply at a time, and the model read once the turn has come: an apply that waited behind a reconcile
        # must not then apply the model as it was before that reconcile's state pull.
        self._lock = asyncio.Lock()
        self.busy_since: float | None = None  # monotonic start of the converge holding the lock
        self._fresh: DesiredState | None = None  # the model the last full converge left the machine matching
        # Awaited once, before the first converge: the NAT discovery's hand-over of the listen port at start.
        self.before_first_converge: Callable[[], Awaitable[None]] | None = None
        self._pull_changed_nothing = False

    @property
    def hold(self) -> ReconcileHold:
        """The engine's: `plexd reconcile hold` sets it, status shows it."""
        return self.engine.hold

    @property
    def known(self) -> bool:
        """Whether the control plane's state has been applied (until then an existing device is left alone)."""
        return self._known.is_set()

    @known.setter
    def known(self, value: bool) -> None:
        if value:
            self._known.set()
        else:
            self._known.clear()

    async def wait_known(self) -> None:
        await self._known.wait()

    def request_converge(self, reason: str) -> None:
        """An event changed the desired model: apply it soon, without making the event stream wait (coalesced:
        `plexd.converge.coalesce`)."""
        self._requests.request(reason)

    @property
    def pending_requests(self) -> int:
        return self._requests.pending

    async def converge_requested(self) -> None:
        """The service that serves `request_converge` (supervised like every other)."""
        await self._requests.serve()

    async def route_limits(self) -> RouteLimits:
        """Re-read the protected addresses (before every state pull)."""
        if self.protected is None:
            return self.store.value.route_limits
        limits = await self.protected.refresh()
        self._limits_known = True
        return limits

    def _note_refusals(self, desired: DesiredState) -> None:
        """Log each refused peer and route once, and queue it for the next drift report."""
        for pid, reason in desired.rejected:
            if ("peer", pid, reason) not in self._refusals_seen:
                self._refusals_seen.add(("peer", pid, reason))
                shown = printable(pid)  # an id from outside, refused maybe for being unprintable
                log.warning("peer %s skipped: %s", shown, reason, extra={"peer": shown})
                self._refusals_new.append(Correction("peer_rejected", f"peer {shown}: {reason}"))
        for pid, prefix, reason in desired.refused_routes:
            if ("route", pid, prefix, reason) not in self._refusals_seen:
                self._refusals_seen.add(("route", pid, prefix, reason))
                log.warning("peer %s: allowed IP %s refused: %s", pid, prefix, reason, extra={"peer": pid})
                self._refusals_new.append(Correction("allowed_ip_rejected", f"peer {pid}: {prefix} {reason}"))
        if len(self._refusals_seen) > 10_000:  # bounded: forget, at worst a refusal is logged again
            self._refusals_seen.clear()

    def _note_policy(self, desired: DesiredState) -> None:
        """Log each skipped policy rule once and report it; a rule naming an unknown node is only logged (a
        control plane that sends only visible peers makes that usual). O(rules), so once per policy version:
        policies change with a state pull (a reconcile's or a refresh's), never with an event."""
        if not desired.enforce_policy:
            return
        compiled = desired.compiled_policy
        if compiled is self._policy_noted:
            return  # the same policies as last time (compiled once per version): already noted
        self._policy_noted = compiled
        for skipped in compiled.skipped:
            if ("policy", str(skipped)) not in self._refusals_seen:
                self._refusals_seen.add(("policy", str(skipped)))
                log.warning("policy rule skipped: %s", printable(str(skipped), 300),
                            extra={"policy": printable(skipped.policy_id)})
                self._refusals_new.append(Correction("policy_rule_rejected", printable(str(skipped), 300)))
        for unknown in compiled.unknown_nodes(desired.peers):
            if ("policy", str(unknown)) not in self._refusals_seen:
                self._refusals_seen.add(("policy", str(unknown)))
                log.info("%s", printable(str(unknown), 300), extra={"policy": printable(unknown.policy_id)})

    def set_peer_endpoints(self, endpoints: Iterable[PeerEndpoint], why: str = "endpoint exchange") -> int:
        """Peers' endpoints from the control plane (the NAT endpoint exchange): each peer looked up by id, only
        its endpoint changed, applied through the converge engine like an event. An endpoint that is not
        HOST:PORT is refused and the peer keeps the one it has. Returns how many changed."""
        changed = 0
        for pe in endpoints:
            peer = self.store.value.peers.get(pe.peer_id)
            if peer is None or not pe.endpoint or peer.endpoint == pe.endpoint:
                continue
            try:
                split_endpoint(pe.endpoint)
            except ValueError as exc:
                log.warning("%s: endpoint of peer %s refused: %s", why, printable(pe.peer_id), printable(str(exc)))
                continue
            self.store.edit(lambda d, pid=pe.peer_id, ep=pe.endpoint: d.with_peer_endpoint(pid, ep), why,
                            (pe.peer_id,))
            changed += 1
        if changed:
            self.request_converge(why)
        return changed

    def take_refusals(self) -> list[Correction]:
        """Refusals not reported yet (the reconciler adds them to its drift report)."""
        out, self._refusals_new = self._refusals_new, []
        return out

    def get_desired(self) -> DesiredState:
        return self.store.value

    def enforcement(self) -> tuple[str, str]:
        """(enforced | degraded | disabled, why it is not enforced): for status, heartbeat and `plexd policies`."""
        firewall = self.engine.status().get("firewall")
        if firewall is None:
            return "disabled", "no firewall domain in this daemon"
        if not self.store.value.enforce_policy:
            return "disabled", firewall["reason"]
        return firewall["enforcement"], firewall["reason"]

    async def converge(self, *, dry_run: bool = False) -> ConvergeResult:
        """Converge the machine; while held (or before the first pull, with a device up) only plan."""
        async with self._lock:
            with self._timed("full"):
                return await self._converge_locked(dry_run)

    @contextlib.contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        self.busy_since = start = time.monotonic()
        try:
            yield
        finally:
            self.busy_since = None
            if self.on_timed is not None:
                self.on_timed(kind, time.monotonic() - start)

    def stuck_for(self) -> float:
        """How long the converge now running has been at it (0 when none runs): the watchdog's other half."""
        return time.monotonic() - self.busy_since if self.busy_since is not None else 0.0

    async def _converge_locked(self, dry_run: bool) -> ConvergeResult:
        if self.before_first_converge is not None:
            wait, self.before_first_converge = self.before_first_converge, None
            await wait()
        if not self._limits_known:  # the first converge (from the mirror) already protects the underlay
            limits = await self.route_limits()
            self.store.replace(self.store.value.with_route_limits(limits))
        self._note_refusals(self.store.value)
        self._note_policy(self.store.value)
        skip, self._pull_changed_nothing = self._pull_changed_nothing, False
        if skip and not dry_run and self._fresh == self.store.value and self.hold.current() is None:
            # The drift phase of this reconcile read the machine and converged it to this very model, and the
            # state pull changed nothing: reading the machine again would only cost.
            return ConvergeResult()
        model = self.store.value
        result = await self._converge(dry_run)
        self._fresh = model if result.mode is Mode.APPLIED and result.ok else None
        return result

    def pulled(self) -> None:
        """A state pull was applied (`state_applier`): if it left the model as the last full converge had it,
        the converge that follows it has nothing to do."""
        self._pull_changed_nothing = self._fresh is not None and self._fresh == self.store.value

    async def _converge(self, dry_run: bool) -> ConvergeResult:
        if not self.known and not dry_run and await self._device_up():
            if not self._told_unknown:
                self._told_unknown = True
                log.info("the WireGuard device %s is already up: keeping it as it is until the control plane's "
                         "state arrives", self.store.value.interface)
            return await self.engine.converge(self.store.value, keep_machine=True)
        # While held the engine only plans (the result says dry_run); the reconciler shows what it did not correct.
        return await self.engine.converge(self.store.value, dry_run=dry_run)

    async def plan(self, model: DesiredState) -> ConvergeResult:
        """What converging to `model` would change, the daemon's own model untouched (a dry run's pull)."""
        async with self._lock:
            with self._timed("full"):
                return await self.engine.converge(model, dry_run=True)

    async def _device_up(self) -> bool:
        try:
            device = wireguard(self.engine)
        except LookupError:
            return False
        return await device.device() is not None

    async def apply_events(self) -> ConvergeResult:
        """Apply what events changed in the model: only the touched peers and routes (`Engine.apply_delta`).
        While held, or before the first state pull, this plans in full like any converge."""
        async with self._lock:
            # A refresh's pull went through `pulled()`, but this apply does not read the machine: the next full
            # converge must not take the pull as one whose changes a full converge already made.
            self._pull_changed_nothing = False
            with self._timed("events"):
                # Held: plan in full, and leave the touched peers for the apply after the hold (taken now, they
                # were lost: the next event's delta moved the baseline past them and a removed peer stayed).
                if not self._limits_known or not self.known or self.hold.current() is not None:
                    return await self._converge_locked(False)
                touched = self.store.take_touched()
                desired = self.store.value
                result = await self.engine.apply_delta(desired, touched)
                # After the change is live: noting skipped rules walks every rule of a new policy (~2 ms at 1,000)
                self._note_refusals(desired)
                self._note_policy(desired)
                return result

    async def peers_on_device(self) -> tuple[int, int] | None:
        """(peers on the live device, peers with a handshake in the last 3 minutes); None without a device."""
        device = await wireguard(self.engine).device()
        if device is None:
            return None
        now = time.time()
        recent = sum(1 for p in device.peers.values() if p.last_handshake and now - p.last_handshake < 180)
        return len(device.peers), recent


@dataclass(frozen=True)
class PulledState:
    """A state pull and the desired model's sequence number when it was requested (see `plexd.state.desired_store`)."""

    state: State
    since: int
    limits: RouteLimits | None = None  # the protected addresses read just before the pull


def state_fetcher(mesh: MeshHandle, fetch: Callable[[], Awaitable[State]]) -> Callable[[], Awaitable[PulledState]]:
    async def fetch_state() -> PulledState:
        limits = await mesh.route_limits()
        since = mesh.store.mark()  # before the request: any event applied from now on is replayed on top
        return PulledState(await fetch(), since, limits)

    return fetch_state


def state_planner(mesh: MeshHandle) -> Callable[[PulledState], Awaitable[ConvergeResult]]:
    """`plan_state` for the reconciler: the pulled state on a copy of the model, planned, nothing kept."""
    async def plan(pulled: PulledState) -> ConvergeResult:
        model = mesh.store.value
        if pulled.limits is not None:
            model = replace(model, route_limits=pulled.limits)
        return await mesh.plan(model.with_state(pulled.state))

    return plan


def state_applier(mesh: MeshHandle, verifier: Verifier | None) -> Callable[[PulledState], list[Correction]]:
    """`apply_state` for the reconciler: replace the desired model (replaying the events applied while the pull
    was in flight).

    The state's `signing_keys` are never installed: the state body is not signed, so a key in it is only as good
    as the channel it came over. Keys change only through a signed `signing_key_rotated` event (signed with a key
    the node already trusts) or the registration response. A state that names a key this node does not trust is
    logged once per key (a rotation event this node missed, or someone slipping a key in)."""
    noted: set[str] = set()
    last: list[Any] = [None, None, None]  # the state object, route limits and model the last pull left

    def apply(pulled: PulledState) -> list[Correction]:
        state = pulled.state
        if state is last[0] and pulled.limits == last[1] and mesh.store.value is last[2]:
            # The client handed back the state it parsed last time (304, or the same bytes) and no event came
            # since: the model is what that pull made it. An idle reconcile rebuilds nothing (peers, route limits).
            mesh.pulled()
            return []
        _note_foreign_key(verifier, state.signing_keys, noted)
        _note_bridge_block(state, mesh.engine, noted)

        def rebuild(d: DesiredState) -> DesiredState:
            return (replace(d, route_limits=pulled.limits) if pulled.limits is not None else d).with_state(state)

        replayed = mesh.store.replace_from_pull(rebuild, pulled.since)  # StalePull: pull again
        last[:] = [state, pulled.limits, mesh.store.value]
        mesh.known = True
        mesh.pulled()
        if mesh.persist is not None:
            mesh.persist()
        if replayed:
            log.info("state pull applied with %d event(s) that arrived during it replayed on top: %s",
                     len(replayed), ", ".join(replayed))
        return []

    return apply


BRIDGE_PARTS = ("relay", "user_access", "site_to_site", "ingress")


def _note_bridge_block(state: State, engine: Engine, noted: set[str]) -> None:
    """A node (mode: node) has none of the bridge's domains: a bridge block in its state is said once, not served."""
    said = [name for name, wanted in (
        ("relay", bool(state.relay)),
        ("user_access", state.user_access is not None and state.user_access.enabled),
        ("site_to_site", state.site_to_site is not None and state.site_to_site.enabled),
        ("ingress", state.ingress is not None and state.ingress.enabled)) if wanted]
    if said and not any(engine.domain(name) for name in BRIDGE_PARTS) and "bridge" not in noted:
        noted.add("bridge")
        log.info("the state has a bridge block (%s), which only a bridge serves (mode: bridge); ignored here",
                 ", ".join(said))


def _note_foreign_key(verifier: Verifier | None, keys: SigningKeys | None, noted: set[str]) -> None:
    trusted = verifier.keys if verifier is not None else None
    if trusted is None or keys is None or not keys.current or keys.current in noted:
        return
    if keys.current in (trusted.current, trusted.previous):
        return
    noted.add(keys.current)
    log.warning("the state names signing key %s, which this node does not trust (it trusts %s); ignored: "
                "signing keys change only through a signed signing_key_rotated event or a registration",
                key_fingerprint(keys.current), key_fingerprint(trusted.current))


def trusted_key(verifier: Verifier) -> Callable[[], str | None]:
    """The signing key `verifier` trusts now, for the key file's domain (`plexd.trust.signing_key_domain`)."""
    return lambda: verifier.keys.current if verifier.keys is not None else None


def build_verifier(data_dir: Path | str, clock: Clock, fallback_key: str,
                   ledger: EventLedger | None = None, node_id: Callable[[], str] | None = None) -> Verifier:
    """The verifier with the persisted key (the file wins, §5.4) and the nonces the ledger holds (the daemon's;
    `reconcile --once` verifies no events and opens none), refusing events bound to nodes other than `node_id`."""
    data_dir = Path(data_dir)
    key = load_signing_key(data_dir) or fallback_key
    verifier = Verifier(None, NonceStore(clock, ledger), clock, node_id=node_id)
    try:
        verifier.set_keys(SigningKeys(current=key))
    except InvalidSigningKeys as exc:
        # Every event will be refused until a re-registration brings a usable key; say so once, loudly.
        log.error("stored signing key unusable (%s); events are refused until the node registers again", exc)
    return verifier


# -- the desired model at start ---------------------------------------------------------------------------------


def initial_desired(config: Any, identity: Identity, mirror: dict | None) -> tuple[DesiredState, bool]:
    """The desired model at start: the interface settings from the config, peers and policies from the mirror
    of the last run (`EventLedger.mirror()`, when it belongs to this identity). Returns (model, restored)."""
    private_key = base64.b64encode(identity.private_key).decode()
    initial = DesiredState.initial(interface=config.mesh.interface, listen_port=config.mesh.listen_port,
                                   mtu=config.mesh.mtu, private_key=private_key, mesh_ip=identity.mesh_ip,
                                   node_id=identity.node_id, enforce_policy=config.policy.enabled,
                                   mesh_range=tuple(config.policy.mesh_range))
    mirrored = _from_mirror(mirror, private_key)
    if mirrored is None or mirrored.mesh_ip != initial.mesh_ip:
        # No mirror (a data_dir the Go agent left, or a lost events.db): the node API's cache files still say
        # what the control plane last sent about this node, until the first state pull.
        metadata, data, refs = node_cache.load(config.data_dir)
        return initial.with_node_state(metadata, data).with_secret_refs(refs), False
    # Peers and policies from the last run; the interface settings always come from the current config.
    return replace(mirrored, interface=initial.interface, listen_port=initial.listen_port, mtu=initial.mtu,
                   node_id=initial.node_id, enforce_policy=initial.enforce_policy,
                   mesh_range=initial.mesh_range), True


def _from_mirror(doc: dict | None, private_key: str) -> DesiredState | None:
    if doc is None:
        return None
    try:
        return DesiredState.from_json(doc, private_key=private_key)
    except Exception as exc:  # a foreign or damaged mirror must not stop the daemon; the state pull replaces it
        log.warning("ignoring an unreadable desired-state mirror: %s", exc)
        return None


def printable(text: str, limit: int = 80) -> str:
    """Outside text made safe to log and report: non-printable characters and lone surrogates escaped."""
    out = text[:limit].encode("ascii", "backslashreplace").decode("ascii")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in out) + ("…" if len(text) > limit else "")
