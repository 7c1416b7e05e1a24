"""The ingress domain (bridge mode): TCP from outside the mesh to mesh services, by the control plane's rules.

Desired: the state's `bridge.ingress` / `ingress_config` rules (`plexd.state.bridge_blocks`), each checked here
against what only this node knows: a target must be a mesh address (inside `policy.mesh_range`), never this machine
or anything outside the mesh (the Go agent dialed whatever it was given, loopback included: docs/decisions.md, Go
defect D8); a `terminate` rule's certificate and key must load. Observed: whether each port still listens. The plan,
each change also its drift line:

    IngressListening     ingress_listener_started   a port with rules does not listen (first start, or it died)
    IngressStopped       ingress_listener_stopped   a port listens that no rule wants any more
    IngressRuleSynced    ingress_rule_updated       a rule added, changed or withdrawn on a listening port

A port that cannot be bound (taken by another program) is an error line naming it; the other ports serve.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import ssl
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from plexd.base.atomicfile import write_atomic
from plexd.bridge.ingress_port import IDLE_TIMEOUT, MAX_PER_SOURCE, IngressPort
from plexd.bridge.once import OnceLog
from plexd.converge.change import Change
from plexd.converge.domain import DomainResult
from plexd.state.bridge_blocks import Ingress, IngressRule
from plexd.state.desired import DesiredState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngressListening(Change):
    correction_type: ClassVar[str] = "ingress_listener_started"
    port: int
    first: bool

    @property
    def detail(self) -> str:
        return f"ingress port {self.port}: " + ("not listening yet" if self.first else "its listener is gone; "
                                                 "listening again")


@dataclass(frozen=True)
class IngressStopped(Change):
    correction_type: ClassVar[str] = "ingress_listener_stopped"
    port: int

    @property
    def detail(self) -> str:
        return f"ingress port {self.port}: no rule wants it any more; closed"


@dataclass(frozen=True)
class IngressRuleSynced(Change):
    correction_type: ClassVar[str] = "ingress_rule_updated"
    rule_id: str
    what: str

    @property
    def detail(self) -> str:
        return f"ingress rule {self.rule_id}: {self.what}"


@dataclass(frozen=True)
class Wanted:
    rules: Mapping[int, tuple[IngressRule, ...]]  # by listen port
    refused: tuple[str, ...]


@dataclass(frozen=True)
class IngressSeen:
    wanted: Wanted
    listening: frozenset[int]


class IngressDomain:
    name = "ingress"
    touches_machine = True
    acts_while_held = False

    def __init__(self, data_dir: str, *, host: str = "0.0.0.0", mesh_range: Sequence[str] = (),
                 allowed_sources: Sequence[str] = (), idle_timeout: float = IDLE_TIMEOUT,
                 max_per_source: int = MAX_PER_SOURCE) -> None:
        """`idle_timeout`, `max_per_source`: each port's (`plexd.bridge.ingress_port`), from `bridge.ingress`."""
        self.host = host
        self.mesh = [ipaddress.ip_network(r, strict=False) for r in mesh_range]
        self.allowed_sources = tuple(allowed_sources)
        self.idle_timeout, self.max_per_source = idle_timeout, max_per_source
        self.cert_dir = Path(data_dir) / "bridge"
        self._ports: dict[int, IngressPort] = {}
        self._served: dict[str, IngressRule] = {}  # rule id -> the rule as the ports serve it
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._applied: Ingress | None = None
        self._applied_once = False
        self._last = Wanted({}, ())
        self._started_ports: set[int] = set()
        self._said = OnceLog(log)

    def _wanted(self, desired: DesiredState) -> Wanted:
        ingress = desired.ingress
        if ingress is None or not ingress.enabled:
            return Wanted({}, ingress.refused if ingress is not None else ())
        refused = list(ingress.refused)
        by_port: dict[int, list[IngressRule]] = {}
        for rule in ingress.rules:
            problem = self._target_problem(rule.target[0], desired.mesh_ip) or self._tls_problem(rule)
            if problem:
                refused.append(f"ingress rule {rule.rule_id}: refused: {problem}")
                continue
            by_port.setdefault(rule.listen_port, []).append(rule)
        return Wanted({p: tuple(rs) for p, rs in by_port.items()}, tuple(refused))

    def _target_problem(self, host: str, own_mesh_ip: str) -> str:
        ip = ipaddress.ip_address(host)
        if not any(ip.version == net.version and ip in net for net in self.mesh):
            return f"target {host} is outside the mesh ({', '.join(map(str, self.mesh))}): ingress forwards only " \
                   "to mesh addresses"
        if host == own_mesh_ip:
            return f"target {host} is this bridge itself"
        return ""

    def _tls_problem(self, rule: IngressRule) -> str:
        if rule.mode != "terminate":
            return ""
        try:
            self._context(rule)
        except (ssl.SSLError, OSError, ValueError) as e:
            return f"its certificate and key do not load: {e}"
        return ""

    def _context(self, rule: IngressRule) -> ssl.SSLContext:
        """The TLS context of a terminate rule: its chain and key in a 0600 file (the ssl module loads from
        files only), kept by content, loaded once."""
        digest = hashlib.sha256((rule.cert_pem + "\0" + rule.key_pem).encode()).hexdigest()[:24]
        if digest not in self._contexts:
            self.cert_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = self.cert_dir / f"ingress-{digest}.pem"
            write_atomic(path, (rule.cert_pem.strip() + "\n" + rule.key_pem.strip() + "\n").encode(), mode=0o600)
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                context.load_cert_chain(path)
            finally:
                path.unlink(missing_ok=True)  # loaded: the key need not stay on disk
            self._contexts[digest] = context
        return self._contexts[digest]

    async def observe(self, desired: DesiredState) -> IngressSeen:
        return IngressSeen(self._wanted(desired), frozenset(p for p, port in self._ports.items() if port.listening))

    def plan(self, desired: DesiredState, seen: IngressSeen) -> DomainResult:
        changes: list[Change] = []
        for port in sorted(seen.wanted.rules):
            if port not in seen.listening:
                changes.append(IngressListening(port, first=port not in self._started_ports))
        changes += [IngressStopped(port) for port in sorted(seen.listening - set(seen.wanted.rules))]
        wanted = {r.rule_id: r for rules in seen.wanted.rules.values() for r in rules}
        for rule_id, rule in wanted.items():
            if rule_id not in self._served:
                changes.append(IngressRuleSynced(rule_id, f"port {rule.listen_port} to "
                                                 f"{rule.target[0]}:{rule.target[1]} ({rule.mode}); added"))
            elif self._served[rule_id] != rule:
                changes.append(IngressRuleSynced(rule_id, "changed; updated"))
        changes += [IngressRuleSynced(rule_id, "no longer wanted; removed") for rule_id in self._served
                    if rule_id not in wanted]
        return DomainResult(tuple(changes), seen.wanted.refused)

    async def apply(self, desired: DesiredState, planned: DomainResult, seen: Any) -> DomainResult:
        wanted: Wanted = seen.wanted if isinstance(seen, IngressSeen) else self._last
        errors: list[str] = []
        for port in [p for p in self._ports if p not in wanted.rules]:
            await self._ports.pop(port).close()
        for port, rules in wanted.rules.items():
            current = self._ports.get(port)
            if current is None or not current.listening:
                if current is not None:
                    await current.close()
                current = IngressPort(self.host, port, allowed_sources=self.allowed_sources,
                                      tls_context=self._context, idle_timeout=self.idle_timeout,
                                      max_per_source=self.max_per_source)
                try:
                    await current.start()
                except OSError as e:
                    self._ports.pop(port, None)
                    errors.append(f"ingress port {port}: cannot listen on {self.host}:{port}: {e.strerror or e} "
                                  f"(rules {', '.join(r.rule_id for r in rules)} not served)")
                    continue
                self._ports[port] = current
                self._started_ports.add(port)
            current.set_rules(rules)
        self._served = {r.rule_id: r for port, rules in wanted.rules.items() if port in self._ports for r in rules}
        self._last = wanted
        self._applied = desired.ingress
        self._applied_once = True
        self._said.errors((*planned.errors, *errors))
        # What could not be done is an error line, not a correction (it would be reported at every reconcile).
        done = tuple(c for c in planned.changes if not (isinstance(c, IngressListening) and c.port not in self._ports)
                     and not (isinstance(c, IngressRuleSynced) and c.rule_id not in self._served
                              and not c.what.endswith("removed")))
        return DomainResult(done, tuple(errors))

    async def apply_delta(self, desired: DesiredState, touched: Collection[str] | None) -> DomainResult | None:
        if self._applied_once and desired.ingress is self._applied:
            return DomainResult()
        return None

    async def teardown(self) -> None:
        for port in list(self._ports.values()):
            await port.close()
        self._ports.clear()
        self._served.clear()

    def status(self) -> Mapping[str, Any] | None:
        if not self._applied_once:
            return None
        return {"rules": [{"rule_id": r.rule_id, "listen_port": r.listen_port, "target": f"{r.target[0]}:{r.target[1]}",
                           "mode": r.mode, "hostname": r.hostname} for r in self._served.values()],
                "ports": [p.status() for _, p in sorted(self._ports.items())],
                "connections": sum(p.active for p in self._ports.values()),
                "refused": list(self._last.refused)}
