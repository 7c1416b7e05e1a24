"""The control plane's model: nodes, tokens, mesh IPs, policies, peer visibility, and the events they cause.

HTTP handlers (server.py, admin.py) parse and authenticate; everything that changes state happens here, in one
synchronous step on the event loop, so a change and the events it causes are never interleaved with another.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from plexd.base import gojson
from plexd.base.clock import Clock
from plexd.base.errors import ConfigError
from plexd.base.log import fingerprint
from plexd.devplane import platform_executions, session_issuer
from plexd.devplane.events import EventHub, Signer
from plexd.devplane.platform_events import PlatformHub
from plexd.devplane.request_tally import RequestTally
from plexd.devplane.store import Node, Store
from plexd.devplane.wire import DevplaneAPIError
from plexd.identity import node_secret

log = logging.getLogger(__name__)

MESH_NETWORK = ipaddress.ip_network("10.100.0.0/16")
DEFAULT_POLICY = {"id": "pol_default",
                  "rules": [{"src": "*", "dst": "*", "port": 0, "protocol": "", "action": "allow"}]}
UNREACHABLE_AFTER = 3  # missed heartbeat intervals
OFFLINE_AFTER = 10
EVENTS_KEPT = 200_000  # event log length; older events are pruned (the state pull covers them)


def valid_public_key(text: Any) -> bool:
    if not isinstance(text, str) or len(text) != 44:
        return False
    try:
        return len(base64.b64decode(text, validate=True)) == 32
    except ValueError:
        return False


@dataclass(frozen=True)
class _Rule:
    src: str
    dst: str
    src_net: Any
    dst_net: Any


def _net(side: str) -> Any:
    if "/" in side:
        try:
            return ipaddress.ip_network(side, strict=False)
        except ValueError:
            return None
    return None


REGISTER_RETRY_WINDOW = 300.0  # seconds: a lost register answer is asked for again within this
EXECUTION_COPIES_KEPT = 10  # acks (and results) kept per execution beyond the first
EXECUTIONS_KEPT_PER_NODE = 1000  # the oldest go: a node posting results for new ids cannot fill the disk

class Deployment:
    def __init__(
        self,
        store: Store,
        *,
        clock: Clock | None = None,
        heartbeat_interval: float = 30.0,
        ip_cooldown: float = 3600.0,
        replay_window: float = 300.0,
        dialect: str = "spec",
    ) -> None:
        self.store = store
        # The node-facing contract (docs/platform-dialect.md): "spec" (docs/protocol.md) or "platform". The model
        # is the same; the platform's events are told its way (platform_events) and its routes translate at the
        # edge (platform_routes).
        self.dialect = settle_dialect(store, dialect)
        self.clock = clock or Clock()
        self.heartbeat_interval = heartbeat_interval
        self.ip_cooldown = ip_cooldown
        self.replay_window = replay_window
        self.signer = Signer(store)
        self.nodes: dict[str, Node] = {n.id: n for n in store.load_nodes()}
        hub = PlatformHub if self.dialect == "platform" else EventHub
        self.hub = hub(store, self.signer, lambda node_id: self.nodes[node_id].num, clock_now=self.clock.now)
        self.by_secret: dict[str, Node] = {n.bearer: n for n in self.nodes.values() if not n.removed}
        # A node that deregistered itself keeps its secret (for re-registration only) and its mesh IP until it is
        # purged or an admin forgets it, so it rejoins as the same node (docs/decisions.md, Restart and rejoin).
        self.rejoinable: dict[str, Node] = {n.bearer: n for n in self.nodes.values() if _rejoinable(n)}
        self.used_ips: set[str] = {n.mesh_ip for n in self.nodes.values() if not n.removed or _rejoinable(n)}
        self.released_ips: dict[str, float] = store.released_ips()
        self._ip_scan_from = 1
        # A devplane that was down is not evidence that its nodes were: everyone gets a fresh heartbeat window
        # after a restart instead of being declared offline (and removed from every peer) at the first check.
        boot = self.clock.now().timestamp()
        for n in self.nodes.values():
            if not n.removed and n.status != "offline":
                n.last_seen = max(n.last_seen, boot)
        self._next_num = max((n.num for n in self.nodes.values()), default=0) + 1
        raw = store.get_meta("policies")
        self.policies: list[dict[str, Any]] = json.loads(raw) if raw is not None else [DEFAULT_POLICY]
        if raw is None:
            store.set_meta("policies", json.dumps(self.policies))
        self._compile_rules()
        self.faults: dict[str, Any] = {}
        self.requests = RequestTally()  # the agent API's requests, by node and route

    # -- helpers ------------------------------------------------------------------------------------------------

    def now_text(self) -> str:
        return gojson.format_time(self.clock.now())

    def live_nodes(self) -> Iterable[Node]:
        return (n for n in self.nodes.values() if not n.removed)

    def node(self, node_id: str, *, rejoinable: bool = False) -> Node:
        """A live node (with `rejoinable`, also one that deregistered itself and may come back)."""
        node = self.nodes.get(node_id)
        if node is None or (node.removed and not (rejoinable and _rejoinable(node))):
            raise DevplaneAPIError(404, f"unknown node {node_id!r}")
        return node

    def authenticate(self, bearer: str | None, node_id: str) -> Node:
        """The node a request is about, checked against its bearer token (§1.1: the node secret)."""
        if not bearer:
            raise DevplaneAPIError(401, "missing Authorization: Bearer <node secret>")
        caller = self.by_secret.get(bearer)
        if caller is None:
            raise DevplaneAPIError(401, "invalid node secret (the node may have been removed; re-register)")
        if caller.id != node_id:
            target = self.nodes.get(node_id)
            if target is None or target.removed:
                raise DevplaneAPIError(404, f"unknown node {node_id!r}")
            raise DevplaneAPIError(403, f"this node secret belongs to {caller.id}, not {node_id}")
        return caller

    def _save(self, node: Node) -> None:
        self.store.save_node(node)

    # -- policies and visibility (§9.2) -------------------------------------------------------------------------

    def _compile_rules(self) -> None:
        rules = []
        self.allow_all = False
        for pol in self.policies:
            if not isinstance(pol, dict) or not isinstance(pol.get("rules"), list):
                continue  # an unchecked document (test hook): only well-formed rules count here
            for r in pol["rules"]:
                if not isinstance(r, dict) or r.get("action") != "allow" or not isinstance(r.get("src"), str) \
                        or not isinstance(r.get("dst"), str):
                    continue
                src, dst = r.get("src", ""), r.get("dst", "")
                if src == "*" and dst == "*":
                    self.allow_all = True
                rules.append(_Rule(src, dst, _net(src), _net(dst)))
        self.rules = rules

    @staticmethod
    def _side(side: str, net: Any, node: Node) -> bool:
        if side == "*" or side == node.id:
            return True
        if net is not None:
            try:
                return ipaddress.ip_address(node.mesh_ip) in net
            except ValueError:
                return False
        return False

    def can_see(self, a: Node, b: Node) -> bool:
        if a.id == b.id:
            return False
        if self.allow_all or self.faults.get("ignore_visibility"):
            return True
        side = self._side
        return any(
            (side(r.src, r.src_net, a) and side(r.dst, r.dst_net, b))
            or (side(r.src, r.src_net, b) and side(r.dst, r.dst_net, a))
            for r in self.rules
        )

    def watchers(self, node: Node) -> list[str]:
        """Nodes that should hear about `node` (every registered node allowed to see it)."""
        return [n.id for n in self.live_nodes() if self.can_see(n, node)]

    def visible_peers(self, node: Node) -> list[Node]:
        return [n for n in self.live_nodes() if n.status != "offline" and self.can_see(node, n)]

    def set_policies(self, policies: list[dict[str, Any]]) -> None:
        before = self._visibility()
        self.policies = policies
        self._compile_rules()
        after = self._visibility()
        with self.store.transaction():
            self.store.set_meta("policies", json.dumps(policies))
            everyone = [n.id for n in self.live_nodes()]
            ids = [p["id"] for p in policies if isinstance(p, dict) and isinstance(p.get("id"), str)]
            self.hub.publish(everyone, "policy_updated", {"policy_ids": ids})
            for peer in self.live_nodes():
                if peer.status == "offline":
                    continue
                added = [n for n in everyone if (n, peer.id) in after and (n, peer.id) not in before]
                removed = [n for n in everyone if (n, peer.id) in before and (n, peer.id) not in after]
                if added:
                    self.hub.publish(added, "peer_added", peer.peer())
                if removed:
                    self.hub.publish(removed, "peer_removed", {"peer_id": peer.id})
        log.info("policies replaced: %d policies", len(policies))

    def _visibility(self) -> set[tuple[str, str]]:
        nodes = list(self.live_nodes())
        return {(a.id, b.id) for a in nodes for b in nodes if self.can_see(a, b)}

    # -- mesh IPs -----------------------------------------------------------------------------------------------

    def _allocate_ip(self) -> str:
        """Lowest free address of 10.100.0.0/16, skipping x.x.x.0/255 and addresses still in their cooldown."""
        now = self.clock.now().timestamp()
        base = int(MESH_NETWORK.network_address)
        resting: int | None = None  # lowest offset skipped only because of its cooldown
        for offset in range(self._ip_scan_from, MESH_NETWORK.num_addresses - 1):
            if offset & 0xFF in (0, 255):  # some stacks treat .0 and .255 of a /24 specially
                continue
            ip = str(ipaddress.IPv4Address(base + offset))
            if ip in self.used_ips:
                continue
            released = self.released_ips.get(ip)
            if released is not None:
                if now - released < self.ip_cooldown:
                    resting = offset if resting is None else resting
                    continue
                del self.released_ips[ip]
                self.store.forget_released_ip(ip)
            self._ip_scan_from = offset + 1 if resting is None else resting
            return ip
        raise DevplaneAPIError(503, f"mesh network {MESH_NETWORK} is full")

    def _release_ip(self, ip: str) -> None:
        now = self.clock.now().timestamp()
        self.used_ips.discard(ip)
        self.released_ips[ip] = now
        self.store.release_ip(ip, now)
        offset = int(ipaddress.IPv4Address(ip)) - int(MESH_NETWORK.network_address)
        self._ip_scan_from = min(self._ip_scan_from, offset)

    # -- registration (§1.3) ------------------------------------------------------------------------------------

    def register(self, body: dict[str, Any], bearer: str | None) -> dict[str, Any]:
        token = (body.get("token") or "").strip()
        public_key = body.get("public_key") or ""
        hostname = (body.get("hostname") or "").strip()
        if not valid_public_key(public_key):
            raise DevplaneAPIError(400, "public_key: must be the standard base64 encoding of 32 bytes (44 characters)")
        known = self.by_secret.get(bearer or "") or self.rejoinable.get(bearer or "") if not token else None
        if known is not None:
            return self._reregister(known, body)
        if not token:
            token = (bearer or "").strip()
        if not token:
            raise DevplaneAPIError(401, "missing bootstrap token (body 'token' or Authorization: Bearer)")
        status = self.store.token_status(token)
        if status == "used":
            # The same registration again (the same token and public key): its answer was lost on the way (a
            # client timeout on a busy machine) and the node retries. It gets the same identity, not a spent token.
            earlier = self.nodes.get(self.store.token_node(token) or "")
            if (earlier is not None and not earlier.removed and earlier.public_key == public_key
                    and self.within_retry_window(earlier)):
                log.info("registration repeated with the same token and key; same answer",
                         extra={"node_id": earlier.id, "token": fingerprint(token)})
                return self._register_response(earlier)
            raise DevplaneAPIError(401, "bootstrap token already used; create a new one")
        if status == "unknown":
            raise DevplaneAPIError(401, "unknown bootstrap token")
        refusal = self.store.token_refusal(token, self.clock.now().timestamp())
        if refusal:
            raise DevplaneAPIError(401, f"bootstrap token {refusal}; create a new one")
        if not hostname:
            raise DevplaneAPIError(400, "hostname: must not be empty")
        if any(n.hostname == hostname for n in self.live_nodes()):
            raise DevplaneAPIError(409, f"hostname {hostname!r} is already registered")
        self.refuse_taken_key(public_key, None)
        node = self.new_node(
            "n_" + secrets.token_hex(6), hostname, public_key,
            secrets.token_urlsafe(24),  # 32 ASCII chars: its raw bytes are the AES-256 key (§5.5)
            # The node offered separate keys for bearer and secrets (plexd.identity.node_secret): take them.
            kdf=node_secret.HKDF_SHA256 if body.get(node_secret.FIELD) == node_secret.HKDF_SHA256 else "",
            metadata=dict(body.get("metadata") or {}),
            capabilities=body.get("capabilities"),
        )
        if not self.enroll(node, token):
            raise DevplaneAPIError(401, "bootstrap token already used; create a new one")
        log.info("node registered", extra={"node_id": node.id, "hostname": hostname, "mesh_ip": node.mesh_ip,
                                           "token": fingerprint(token)})
        return self._register_response(node)

    def new_node(self, node_id: str, hostname: str, public_key: str, secret: str, **more: Any) -> Node:
        """A node with the next mesh IP and number, not yet known to anyone: `enroll` commits it."""
        node = Node(id=node_id, hostname=hostname, public_key=public_key, mesh_ip=self._allocate_ip(), secret=secret,
                    registered_at=self.now_text(), last_seen=self.clock.now().timestamp(), num=self._next_num,
                    **more)
        self._next_num += 1
        return node

    def enroll(self, node: Node, token: str, also: Callable[[], None] | None = None) -> bool:
        """Commit a new node and spend its token (and do `also`) in one transaction, telling its watchers; False
        when the token was spent meanwhile (nothing is written)."""
        with self.store.transaction():
            if not self.store.use_token(token, node.id, node.registered_at):
                return False
            self._save(node)
            if also is not None:
                also()
            self.hub.publish(self.watchers(node), "peer_added", node.peer())
        # Known in memory only once the transaction is committed: a failure above leaves no half-registered node
        # (its retry would be told "hostname already registered")
        self.nodes[node.id] = node
        self.by_secret[node.bearer] = node
        self.used_ips.add(node.mesh_ip)
        return True

    def within_retry_window(self, node: Node) -> bool:
        """A used token answers the same registration again only this long after it was used (the Go agent
        retries for at most 5 minutes): a spent token and a public key every peer sees must not hand out the
        node's secret for ever."""
        try:
            used = gojson.parse_time(node.registered_at).timestamp()
        except ValueError:
            return False
        return self.clock.now().timestamp() - used <= REGISTER_RETRY_WINDOW

    def refuse_taken_key(self, public_key: str, owner: Node | None) -> None:
        """Two peers with one WireGuard key: a control plane must never serve that."""
        taken = next((n for n in self.nodes.values() if n.public_key == public_key and n is not owner
                      and (not n.removed or _rejoinable(n))), None)
        if taken is not None:
            raise DevplaneAPIError(409, f"public key already belongs to node {taken.id}")

    def _reregister(self, node: Node, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("public_key") != node.public_key:
            raise DevplaneAPIError(409, f"node {node.id} is registered with another public key; "
                                 "register afresh with a bootstrap token")
        rejoined = node.removed
        if rejoined and any(n.hostname == node.hostname for n in self.live_nodes()):
            raise DevplaneAPIError(409, f"hostname {node.hostname!r} was registered by another node while {node.id} "
                                        "was away; forget one of them")
        with self.store.transaction():
            if rejoined:  # it deregistered itself earlier: it comes back as the same node, and its peers are told
                node.removed = False
                node.status = "online"
                del self.rejoinable[node.bearer]
                self.by_secret[node.bearer] = node
                self.hub.publish(self.watchers(node), "peer_added", node.peer())
            self._mark_seen(node)
            self._save(node)
        log.info("node rejoined after deregistering" if rejoined else "node re-registered with its node secret",
                 extra={"node_id": node.id})
        return self._register_response(node)

    def _register_response(self, node: Node) -> dict[str, Any]:
        return {
            "node_id": node.id,
            "mesh_ip": node.mesh_ip,
            "signing_public_key": self.signer.public_key,
            "node_secret_key": node.secret,
            "peers": [p.peer() for p in self.visible_peers(node)],
            **({node_secret.FIELD: node.kdf} if node.kdf else {}),  # the derivation taken: the node uses it
        }

    def remove(self, node: Node, reason: str, *, rejoinable: bool = False) -> None:
        """Deregister (by the node) or forget (by the admin): peers are told and the secret stops working, except
        that a node deregistering itself without purging (`rejoinable`) may re-register with it, keeping its mesh
        IP; a purge or an admin's forget revokes the secret and releases the IP."""
        watchers = self.watchers(node) if not node.removed else []
        with self.store.transaction():
            node.removed = True
            node.status = "deregistered" if rejoinable else "removed"
            self._save(node)
            self.by_secret.pop(node.bearer, None)
            if rejoinable:
                self.rejoinable[node.bearer] = node
            else:
                self.rejoinable.pop(node.bearer, None)
                self._release_ip(node.mesh_ip)
            if watchers:
                self.hub.publish(watchers, "peer_removed", {"peer_id": node.id})
        self.hub.close_streams(node.id)
        log.info("node %s: %s", reason, node.id, extra={"node_id": node.id})

    # -- liveness -----------------------------------------------------------------------------------------------

    def _mark_seen(self, node: Node) -> None:
        """Record a sign of life; a node coming back from offline is announced to its peers again."""
        node.last_seen = self.clock.now().timestamp()
        was_offline = node.status == "offline"
        node.status = "online"
        if was_offline:
            self.hub.publish(self.watchers(node), "peer_added", node.peer())
            log.info("node back online", extra={"node_id": node.id})

    @staticmethod
    def _still_here(node: Node) -> None:
        """A node removed while its request was being read (deregistered, forgotten) is not written back to life."""
        if node.removed:
            raise DevplaneAPIError(401, f"node {node.id} is no longer registered")

    def heartbeat(self, node: Node, body: dict[str, Any], *, nat_type: str | None = None,
                  sticky: tuple[str, ...] = ()) -> dict[str, bool]:
        """Record a heartbeat; the answer's flags are one-shot except those in `sticky` (the platform repeats
        `rotate_keys` until the rotation is done). `nat_type` defaults to the spec body's `nat.type`."""
        self._still_here(node)
        if nat_type is None:
            nat = body.get("nat") or {}
            nat_type = nat.get("type") if isinstance(nat, dict) else None
        with self.store.transaction():
            self._mark_seen(node)
            node.last_heartbeat = body
            if nat_type:
                node.nat_type = nat_type
            flags = {flag: bool(node.flags.get(flag, False) if flag in sticky else node.flags.pop(flag, False))
                     for flag in ("reconcile", "rotate_keys")}
            self._save(node)
            self.store.add_record(node.id, "heartbeat", self.now_text(), json.dumps(body))
        return flags

    def check_liveness(self) -> None:
        """Mark nodes unreachable after 3 missed heartbeats and offline after 10 (peers then drop them)."""
        now = self.clock.now().timestamp()
        for node in list(self.live_nodes()):
            missed = (now - node.last_seen) / self.heartbeat_interval
            if missed >= OFFLINE_AFTER and node.status != "offline":
                with self.store.transaction():
                    node.status = "offline"
                    self._save(node)
                    self.hub.publish(self.watchers(node), "peer_removed", {"peer_id": node.id})
                log.info("node offline after %d missed heartbeats", OFFLINE_AFTER, extra={"node_id": node.id})
            elif UNREACHABLE_AFTER <= missed < OFFLINE_AFTER and node.status == "online":
                node.status = "unreachable"
                self._save(node)
                log.info("node unreachable", extra={"node_id": node.id})

    async def run_liveness(self) -> None:
        tick = max(0.05, min(self.heartbeat_interval / 2, 5.0))
        last_prune = self.clock.monotonic()
        while True:
            await self.clock.sleep(tick)
            try:
                self.check_liveness()
                if self.clock.monotonic() - last_prune >= 60:
                    last_prune = self.clock.monotonic()
                    self.prune_events()
            except Exception:  # never let the monitor die; it is the only one
                log.exception("liveness check failed")

    def prune_events(self) -> int:
        """Keep the newest EVENTS_KEPT events; a client further behind replays from the state instead."""
        if self.hub.seq <= EVENTS_KEPT:
            return 0
        removed = self.store.prune_events(self.hub.seq - EVENTS_KEPT)
        if removed:
            log.info("pruned %d old events from the log", removed)
        return removed

    # -- endpoints and keys -------------------------------------------------------------------------------------

    def set_endpoint(self, node: Node, endpoint: str, nat_type: str | None = None) -> None:
        self._still_here(node)
        with self.store.transaction():
            changed = endpoint != node.endpoint
            node.endpoint = endpoint
            if nat_type is not None:
                node.nat_type = nat_type
            self._save(node)
            if changed:
                self.hub.publish(self.watchers(node), "peer_endpoint_changed", node.peer())

    def peer_endpoints(self, node: Node) -> list[dict[str, str]]:
        return [{"peer_id": p.id, "endpoint": p.endpoint} for p in self.visible_peers(node) if p.endpoint]

    def rotate_node_key(self, node: Node, new_public_key: str) -> list[dict[str, Any]]:
        if not valid_public_key(new_public_key):
            raise DevplaneAPIError(400, "new_public_key: must be the standard base64 encoding of 32 bytes "
                                        "(44 characters)")
        self._still_here(node)
        self.refuse_taken_key(new_public_key, node)
        with self.store.transaction():
            node.public_key = new_public_key
            self._save(node)
            self.hub.publish(self.watchers(node), "peer_key_rotated", node.peer())
        return [p.peer() for p in self.visible_peers(node)]

    def arm_key_rotation(self, node: Node) -> None:
        """Ask the node for a new mesh key: its next heartbeat answers `rotate_keys` (the platform dialect repeats
        it until the node completes the rotation, and tells an open stream at once)."""
        with self.store.transaction():
            node.flags["rotate_keys"] = True
            self._save(node)
            if self.dialect == "platform":
                self.hub.publish([node.id], "rotate_keys", {"node_id": node.id})

    # -- state (§4.1) and secrets (§8.5) ------------------------------------------------------------------------

    def state(self, node: Node) -> dict[str, Any]:
        fallback = self.fallbacks(node)
        out: dict[str, Any] = {
            "peers": [p.peer() | ({"fallback_endpoint": fallback[p.id]} if p.id in fallback else {})
                      for p in self.visible_peers(node)],
            "policies": self.policies,
            "signing_keys": self.signer.keys(self.clock.now()),
        }
        if node.metadata:
            out["metadata"] = node.metadata
        out["data"] = list(node.data.values())
        out["secret_refs"] = node.secret_refs()
        out["sessions"] = session_issuer.block(node, self.clock.now())
        out["bridge"] = node.bridge  # null: nothing desired from this node as a bridge
        return out

    @staticmethod
    def fallbacks_paired(bridge: Node) -> list[str]:
        relay = (bridge.bridge or {}).get("relay") or {}
        return [x for s in relay.get("sessions") or [] if isinstance(s, dict)
                for x in (s.get("peer_a_id"), s.get("peer_b_id")) if isinstance(x, str)]

    def fallbacks(self, node: Node) -> dict[str, str]:
        """Peer id -> the relay that carries its pair with `node`: every relay session a bridge serves names a
        pair, and each side gets the bridge's relay as the other's `fallback_endpoint`. The relay's address is
        the block's `relay.endpoint` (the devplane's own key; a bridge ignores it)."""
        out: dict[str, str] = {}
        for bridge in self.live_nodes():
            relay = (bridge.bridge or {}).get("relay") or {}
            endpoint = relay.get("endpoint")
            if not isinstance(endpoint, str) or not endpoint:
                continue
            for s in relay.get("sessions") or []:
                pair = (s.get("peer_a_id"), s.get("peer_b_id")) if isinstance(s, dict) else ()
                if node.id in pair:
                    other = pair[1] if pair[0] == node.id else pair[0]
                    if isinstance(other, str):
                        out[other] = endpoint
        return out

    def set_bridge(self, node: Node, block: dict[str, Any] | None) -> None:
        """A bridge node's `bridge` block (docs/protocol.md §A2.1), served in its state from now on; the
        node is told to pull it (`bridge_config_updated`, which only triggers a pull, as in Go)."""
        relay = (block or {}).get("relay") or {}
        paired = {x for s in relay.get("sessions") or [] if isinstance(s, dict)
                  for x in (s.get("peer_a_id"), s.get("peer_b_id")) if isinstance(x, str) and x in self.nodes}
        with self.store.transaction():
            paired |= {x for x in self.fallbacks_paired(node) if x in self.nodes}  # pairs it relayed lose theirs
            routed = node.routed()
            node.bridge = block
            self._save(node)
            if node.routed() != routed:  # the prefixes it carries changed: every node that sees it pulls
                paired |= set(self.watchers(node))
            # Only a pull, as in Go: the bridge for its block, the relayed nodes for their peers' fallbacks.
            self.hub.publish(sorted({node.id} | paired), "bridge_config_updated", {})
        log.info("bridge block of node %s set (%s)", node.id, "none" if block is None else ", ".join(sorted(block)))

    # -- access sessions (plexd.devplane.session_issuer) --------------------------------------------------------

    def create_session(self, node: Node, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        now = self.clock.now()
        with self.store.transaction():
            session_issuer.prune(node, now)
            session, token = session_issuer.create(node, self.signer.key, now, body)
            self._save(node)
            self.hub.publish([node.id], "session_setup", {"session_id": session["session_id"]})
        log.info("session %s (%s) created for node %s until %s", session["session_id"], session["kind"], node.id,
                 session["expires_at"])
        return session, token

    def revoke_session(self, node: Node, session_id: str) -> None:
        with self.store.transaction():
            session_issuer.revoke(node, session_id, self.clock.now())
            self._save(node)
            self.hub.publish([node.id], "session_revoked", {"session_id": session_id})
        log.info("session %s of node %s revoked", session_id, node.id)

    def session_activity(self, node: Node, session_id: str, body: Any) -> None:
        with self.store.transaction():
            record = session_issuer.record_activity(node, session_id, body)
            self._save(node)
            self.store.add_record(node.id, "session", self.now_text(), json.dumps(record, separators=(",", ":")))

    def secret(self, node: Node, key: str) -> dict[str, Any]:
        entry = node.secrets.get(key)
        if entry is None:
            raise DevplaneAPIError(404, f"node {node.id} has no secret {key!r}")
        nonce = os.urandom(12)
        aes_key = node_secret.secrets_key(node.secret, node.kdf)
        if aes_key is None:
            raise DevplaneAPIError(500, f"node {node.id}'s secret is not a usable AES-256 key")
        sealed = AESGCM(aes_key).encrypt(nonce, entry["value"].encode("utf-8"), None)
        return {"key": key, "ciphertext": base64.b64encode(sealed).decode(), "nonce": base64.b64encode(nonce).decode(),
                "version": entry["version"]}

    # -- admin changes that notify the node ---------------------------------------------------------------------

    def _state_event(self, node: Node) -> None:
        self.hub.publish([node.id], "node_state_updated",
                         {"metadata": node.metadata, "data": list(node.data.values())})

    def set_metadata(self, node: Node, metadata: dict[str, str]) -> None:
        with self.store.transaction():
            node.metadata = dict(metadata)
            self._save(node)
            self._state_event(node)

    def set_data(self, node: Node, key: str, content_type: str, payload: Any) -> dict[str, Any]:
        old = node.data.get(key)
        entry = {"key": key, "content_type": content_type, "payload": payload,
                 "version": (old["version"] + 1) if old else 1, "updated_at": self.now_text()}
        with self.store.transaction():
            node.data[key] = entry
            self._save(node)
            self._state_event(node)
        return entry

    def record_reports(self, node: Node, entries: list[dict[str, Any]], deleted: list[str]) -> None:
        self._still_here(node)
        with self.store.transaction():
            self.store.add_record(node.id, "report", self.now_text(),
                                  json.dumps({"entries": entries or None, "deleted": deleted or None}))
            for entry in entries:
                node.reports[entry["key"]] = entry
            for key in deleted:
                node.reports.pop(key, None)
            self._save(node)

    def set_secret(self, node: Node, key: str, value: str) -> int:
        old = node.secrets.get(key)
        version = (old["version"] + 1) if old else 1
        with self.store.transaction():
            node.secrets[key] = {"value": value, "version": version}
            self._save(node)
            self.hub.publish([node.id], "node_secrets_updated", {"secret_refs": node.secret_refs()})
        return version

    def request_action(self, node: Node, action: str, parameters: dict[str, Any], timeout: str | None,
                       checksum: str | None, action_type: str | None = None) -> str:
        """Publish an action_request. Without a checksum, a hook's is taken from the node's last capabilities
        (as a real control plane would: it asks for the hook it was told about). The platform dialect queues it
        in the node's `executions` block instead (platform_executions; `action_type` builtin or hook)."""
        if self.dialect == "platform":
            return platform_executions.queue(self, node, action, parameters, timeout, action_type)
        execution_id = "exec_" + secrets.token_hex(8)
        if not checksum:
            checksum = announced_checksum(node.capabilities, action)
        payload = {
            "execution_id": execution_id, "action": action, "parameters": parameters,
            "timeout": timeout or "", "checksum": checksum or "",
            "triggered_by": {"type": "control_plane", "session_id": "", "user_id": "", "email": ""},
        }
        doc = {"execution_id": execution_id, "action": action, "parameters": parameters, "timeout": timeout or "",
               "checksum": checksum or "", "requested_at": self.now_text(), "ack": None, "result": None}
        with self.store.transaction():
            self.store.save_execution(node.id, execution_id, doc)
            self.hub.publish([node.id], "action_request", payload)
        return execution_id

    def resend_action(self, node: Node, execution_id: str) -> str:
        """Publish an execution's action_request again, as a new event (a control plane retrying): the node must
        refuse it as a duplicate, never run it twice. Returns the new event id."""
        if self.dialect == "platform":
            return platform_executions.resend(self, node, execution_id)
        doc = self.store.execution(node.id, execution_id)
        if doc is None or doc.get("requested_at") is None:
            raise KeyError(execution_id)
        payload = {"execution_id": execution_id, "action": doc["action"], "parameters": doc["parameters"],
                   "timeout": doc["timeout"], "checksum": doc["checksum"],
                   "triggered_by": {"type": "control_plane", "session_id": "", "user_id": "", "email": ""}}
        with self.store.transaction():
            return self.hub.publish([node.id], "action_request", payload)

    def record_execution(self, node: Node, execution_id: str, part: str, body: dict[str, Any]) -> None:
        """Keep the first ack and result as they came; every later one is appended to `acks` / `results`, so a
        test sees a duplicate being refused (or, were it ever, run twice)."""
        with self.store.transaction():
            known = self.store.execution(node.id, execution_id)
            doc = known or {
                "execution_id": execution_id, "action": "", "parameters": None, "timeout": "", "checksum": "",
                "requested_at": None, "ack": None, "result": None}
            later = doc.setdefault(part + "s", [])
            if len(later) < EXECUTION_COPIES_KEPT:  # enough to see a duplicate; a node repeating itself for ever
                later.append(body)                  # grew one row without bound, rewritten whole at each
            if doc.get(part) is None:
                doc[part] = body
            self.store.save_execution(node.id, execution_id, doc)
            if known is None:  # only a new row can take the node past the bound
                self.store.prune_executions(node.id, EXECUTIONS_KEPT_PER_NODE)

    def rotate_signing_key(self, transition_seconds: float) -> dict[str, str]:
        """New deployment key; the announcement is signed with the OLD key, the only one agents trust yet."""
        new, keys = self.signer.next_keys(self.clock.now(), transition_seconds)
        with self.store.transaction():
            self.hub.publish([n.id for n in self.live_nodes()], "signing_key_rotated", keys)
            self.signer.install(new, keys)
        log.info("signing key rotated; previous key accepted until %s", keys["transition_expires"])
        return keys


async def cancel_quietly(task: asyncio.Task[Any]) -> None:
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


def announced_checksum(capabilities: Any, action: str) -> str:
    """The checksum a node announced for hook `action`, or '' (a built-in, or not announced)."""
    hooks = capabilities.get("hooks") if isinstance(capabilities, dict) else None
    for hook in hooks or ():
        if isinstance(hook, dict) and hook.get("name") == action:
            return str(hook.get("checksum") or "")
    return ""


DIALECTS = ("spec", "platform")


def settle_dialect(store: Store, dialect: str) -> str:
    """The dialect a database serves is the one it was made with: node ids, tokens and secrets differ between the
    two. A file from before dialects existed is a spec one once it holds nodes."""
    if dialect not in DIALECTS:
        raise ConfigError(f"dialect {dialect!r}: must be one of {', '.join(DIALECTS)}")
    made = store.get_meta("dialect")
    if made is None:
        made = "spec" if store.load_nodes() else dialect
        store.set_meta("dialect", made)
    if made != dialect:
        raise ConfigError(f"database {store.path} serves the {made} dialect, not {dialect}; use a new --db path")
    return dialect


def _rejoinable(node: Node) -> bool:
    """Deregistered by itself, not purged nor forgotten: its secret still re-registers it."""
    return node.removed and node.status == "deregistered"
