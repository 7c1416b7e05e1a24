"""The node's mesh: one engine, one desired model (mirrored to data_dir for an offline start).

    events ──edit──▶ DesiredStore ◀──replace_from_pull── reconciler (GET /state)
                          │
                     Gate.converge() ──▶ Engine.converge (every domain: observe → plan → apply)
                     Gate.apply_events() ──▶ Engine.apply_delta (what the events touched, no machine read)
                          │
                     the gate decides full or delta, and whether to apply, only plan (dry run, an operator's
                     hold: drift reported as held) or keep a live device until the first pull (plexd.converge.gate)
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plexd.base import mesh_caches
from plexd.base.clock import Clock
from plexd.controlplane.client import PeerEndpoint
from plexd.controlplane.event_signing import InvalidSigningKeys, NonceStore, Verifier, key_fingerprint, load_signing_key
from plexd.controlplane.ledger import EventLedger
from plexd.converge.change import Correction
from plexd.converge.coalesce import Requests
from plexd.converge.engine import ConvergeResult, Engine
from plexd.converge.gate import Gate
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

def _trim_caches(desired: DesiredState) -> None:
    """The converge's memo caches kept to what the mesh holds now (`plexd.base.mesh_caches`)."""
    mesh_caches.trim(lambda: len(desired.peers) + sum(len(p.allowed_ips) for p in desired.peers.values())
                     + 2 * sum(len(p.rules) for p in desired.policies))  # a rule is in two chains


class MeshHandle:
    """Holds the desired model, and what is specific to the mesh around its converges (the gate's `Guard`): the
    protected addresses, refused peers and rules noted once, endpoints from the exchange. One per daemon; every
    converge goes through its `gate` (`plexd.converge.gate.Gate`)."""

    def __init__(self, engine: Engine, desired: DesiredState | DesiredStore,
                 protected: ProtectedAddresses | None = None, known: bool = True, *,
                 requests: Requests | None = None, hold: ReconcileHold | None = None,
                 before_first: Callable[[], Awaitable[None]] | None = None,
                 persist: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.store = desired if isinstance(desired, DesiredStore) else DesiredStore(desired)
        self.gate = Gate(engine, self.store, self, requests=requests or Requests(), hold=hold or ReconcileHold(),
                         known=known, before_first=before_first)
        self._persist = persist  # write the mirror now (after a state pull), not at the end of the group window
        self._told_kept = False
        self.protected = protected
        self._limits_known = protected is None
        self._refusals_seen: set[tuple[str, ...]] = set()
        self._refusals_new: list[Correction] = []
        self._policy_noted: object = None  # the compiled policy `_note_policy` last went through
        self.store.subscribe(_trim_caches)

    def request_converge(self, reason: str) -> None:
        """An event changed the desired model: apply it soon, without making the event stream wait (coalesced:
        `plexd.converge.coalesce`)."""
        self.gate.requests.request(reason)

    # -- the gate's guard ---------------------------------------------------------------------------------------

    @property
    def ready_for_delta(self) -> bool:
        return self._limits_known

    async def before_full(self) -> None:
        if not self._limits_known:  # the first converge (from the mirror) already protects the underlay
            limits = await self.route_limits()
            self.store.replace(self.store.value.with_route_limits(limits))
        self.after_apply(self.store.value)

    def after_apply(self, desired: DesiredState) -> None:
        self._note_refusals(desired)
        self._note_policy(desired)

    def after_full(self) -> None:
        mesh_caches.full_converge_done()

    async def machine_left_up(self) -> bool:
        try:
            device = wireguard(self.engine)
        except LookupError:
            return False
        if await device.device() is None:
            return False
        if not self._told_kept:
            self._told_kept = True
            log.info("the WireGuard device %s is already up: keeping it as it is until the control plane's "
                     "state arrives", self.store.value.interface)
        return True

    async def route_limits(self) -> RouteLimits:
        """Re-read the protected addresses (before every state pull, and in a reconcile that skips it)."""
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
        return set_peer_endpoints(self.store, self.gate.requests, endpoints, why)

    def pulled(self) -> None:
        """A state pull replaced the model: the machine may now be converged to it, and the mirror is written now
        rather than at the end of the group window."""
        self.gate.mark_known()
        self.gate.pulled()
        if self._persist is not None:
            self._persist()

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

    async def peers_on_device(self) -> tuple[int, int] | None:
        """(peers on the live device, peers with a handshake in the last 3 minutes); None without a device."""
        device = await wireguard(self.engine).device()
        if device is None:
            return None
        now = time.time()
        recent = sum(1 for p in device.peers.values() if p.last_handshake and now - p.last_handshake < 180)
        return len(device.peers), recent


def set_peer_endpoints(store: DesiredStore, requests: Requests, endpoints: Iterable[PeerEndpoint],
                       why: str = "endpoint exchange") -> int:
    """Peers' endpoints from the control plane (the NAT endpoint exchange): each peer looked up by id, only its
    endpoint changed, applied through the converge engine like an event. An endpoint that is not HOST:PORT is
    refused and the peer keeps the one it has. Returns how many changed."""
    changed = 0
    for pe in endpoints:
        peer = store.value.peers.get(pe.peer_id)
        if peer is None or not pe.endpoint or peer.endpoint == pe.endpoint:
            continue
        try:
            split_endpoint(pe.endpoint)
        except ValueError as exc:
            log.warning("%s: endpoint of peer %s refused: %s", why, printable(pe.peer_id), printable(str(exc)))
            continue
        store.edit(lambda d, pid=pe.peer_id, ep=pe.endpoint: d.with_peer_endpoint(pid, ep), why, (pe.peer_id,))
        changed += 1
    if changed:
        requests.request(why)
    return changed


@dataclass(frozen=True)
class PulledState:
    """A state pull and the desired model's sequence number when it was requested (see `plexd.state.desired_store`)."""

    state: State
    since: int
    limits: RouteLimits | None = None  # the protected addresses read just before the pull


class StatePull:
    """The reconciler's state source (`plexd.services.reconciler.StateSource`): GET /state, applied to the
    mesh's model (replaying the events applied while the pull was in flight) or planned on a copy of it.

    The state's `signing_keys` are never installed: the state body is not signed, so a key in it is only as good
    as the channel it came over. Keys change only through a signed `signing_key_rotated` event (signed with a key
    the node already trusts) or the registration response. A state that names a key this node does not trust is
    logged once per key (a rotation event this node missed, or someone slipping a key in)."""

    def __init__(self, mesh: MeshHandle, fetch: Callable[[], Awaitable[State]], verifier: Verifier | None) -> None:
        self._mesh = mesh
        self._fetch = fetch
        self._verifier = verifier  # None: a dry run's, which installs nothing
        self._noted: set[str] = set()
        self._last: tuple[Any, Any, Any] = (None, None, None)  # the state, route limits and model the last pull left

    async def fetch(self) -> PulledState:
        limits = await self._mesh.route_limits()
        since = self._mesh.store.mark()  # before the request: any event applied from now on is replayed on top
        return PulledState(await self._fetch(), since, limits)

    async def plan(self, pulled: PulledState) -> ConvergeResult:
        """The pulled state on a copy of the model, planned, nothing kept."""
        model = self._mesh.store.value
        if pulled.limits is not None:
            model = replace(model, route_limits=pulled.limits)
        return await self._mesh.gate.plan(model.with_state(pulled.state))

    def take_refusals(self) -> list[Correction]:
        return self._mesh.take_refusals()

    async def between_pulls(self) -> bool:
        """The protected addresses read again (a new LAN, gateway, resolver or control-plane address must not
        wait for the next pull to be guarded); True when the model took new ones."""
        limits = await self._mesh.route_limits()
        store = self._mesh.store
        if limits == store.value.route_limits:
            return False
        store.edit(lambda d: d.with_route_limits(limits), "protected addresses read again")
        return True

    def apply(self, pulled: PulledState) -> list[Correction]:
        mesh, state = self._mesh, pulled.state
        last_state, last_limits, last_model = self._last
        if state is last_state and pulled.limits == last_limits and mesh.store.value is last_model:
            # The client handed back the state it parsed last time (304, or the same bytes) and no event came
            # since: the model is what that pull made it. An idle reconcile rebuilds nothing (peers, route limits).
            mesh.gate.pulled()
            return []
        _note_foreign_key(self._verifier, state.signing_keys, self._noted)
        _note_bridge_block(state, mesh.engine, self._noted)

        def rebuild(d: DesiredState) -> DesiredState:
            return (replace(d, route_limits=pulled.limits) if pulled.limits is not None else d).with_state(state)

        replayed = mesh.store.replace_from_pull(rebuild, pulled.since)  # StalePull: pull again
        self._last = (state, pulled.limits, mesh.store.value)
        mesh.pulled()
        if replayed:
            log.info("state pull applied with %d event(s) that arrived during it replayed on top: %s",
                     len(replayed), ", ".join(replayed))
        return []


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
                                   mesh_range=mesh_range(config, identity))
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


def mesh_range(config: Any, identity: Identity) -> tuple[str, ...]:
    """The ranges policy CIDRs must fall in: the config's, or (when it says nothing) the range the control plane
    named at registration."""
    source_of = getattr(config, "source_of", lambda key: "default")
    if identity.domain_mesh_cidr and source_of("policy.mesh_range") == "default":
        return (identity.domain_mesh_cidr,)
    return tuple(config.policy.mesh_range)


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
