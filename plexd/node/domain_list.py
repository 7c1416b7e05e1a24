"""The one list of domains: `build_engine(config)` for the daemon, `reconcile --once`, `plexd deregister` and the
lab. Adding a piece of machine state to plexd means writing its domain (`plexd.converge.domain.Domain`) and adding
it here, in the order it must apply (the firewall before the device: a new peer meets its rules)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import cast

from plexd.access.sessions_domain import AccessHooks, SessionsDomain
from plexd.config.settings import Config
from plexd.converge.engine import Engine
from plexd.firewall.firewall_domain import FirewallDomain
from plexd.machine.links import Links
from plexd.machine.wireguard_select import wireguard_backend
from plexd.mesh.wireguard_domain import WireGuardDomain
from plexd.nat.endpoint_domain import NatEndpointDomain, NatHooks
from plexd.nodeapi.cache import NodeStateCache
from plexd.trust.signing_key_domain import SigningKeyFile


def build_engine(config: Config, trusted_key: Callable[[], str | None] = lambda: None,
                 access: AccessHooks | None = None, cp_reachable: Callable[[], bool] | None = None,
                 nat: NatHooks | None = None) -> Engine:
    """`trusted_key`: the signing key the verifier trusts now (None: no verifier here, the key file is left as is).
    `access`: the daemon's hooks for the access sessions; without them (`reconcile --once`, `plexd deregister`)
    no session is served: a short-lived command must not open listeners it cannot keep. `cp_reachable`: whether
    the control plane answers now (the daemon's; a bridge's relay keeps its sessions while it does not); without
    it no relay runs, for the same reason. `nat`: the daemon's NAT discovery and uplink, when NAT traversal is on
    (the control plane's record of this node's endpoint is converged only by a daemon that discovers it)."""
    links = Links(config.mesh.interface, table=config.mesh.route_table, rule_priority=config.mesh.route_rule_priority)
    bridge = _bridge_modules() if config.mode == "bridge" else None
    serving = bridge is not None and cp_reachable is not None  # the relay's and ingress's listeners: daemon only
    host, port = bridge.split_host_port(config.bridge.relay.listen) if bridge is not None else ("", 0)
    firewall = FirewallDomain(config.mesh.interface, enabled=config.policy.enabled,
                              log_denied=config.policy.log_denied, bridge=config.mode == "bridge")
    sessions_on = access is not None and config.access.enabled
    return Engine([
        firewall,
        NodeStateCache(config.data_dir),
        SigningKeyFile(config.data_dir, trusted_key),
        WireGuardDomain(wireguard_backend(config), links),
        # sessions fail closed: none is open while the firewall cannot enforce the policy
        *([SessionsDomain(config.data_dir, access, unenforced=lambda: firewall.unenforced,
                          policy_enabled=config.policy.enabled)] if sessions_on else []),
        *([bridge.RelayDomain(host, port, fastpath_address=config.bridge.relay.fastpath_address,
                              cp_reachable=cp_reachable)] if serving else []),
        *(bridge.bridge_interfaces(config) if bridge is not None else []),
        *([bridge.IngressDomain(config.data_dir, host=config.bridge.ingress.listen_address,
                                mesh_range=config.policy.mesh_range,
                                allowed_sources=config.bridge.ingress.allowed_sources,
                                idle_timeout=config.bridge.ingress.idle_timeout,
                                max_per_source=config.bridge.ingress.max_per_source)] if serving else []),
        *([NatEndpointDomain(nat)] if nat is not None else []),
    ])


def _bridge_modules() -> ModuleType:
    # Imported here, not at the top: a node that is not a bridge never runs these (see plexd.bridge.wiring).
    from plexd.bridge import wiring

    return wiring


# Typed access to the domains others read, by name (engines in tests may leave some out).


def wireguard(engine: Engine) -> WireGuardDomain:
    """The WireGuard domain: the device the heartbeat, the metrics and `plexd peers` read. LookupError: none."""
    domain = engine.domain(WireGuardDomain.name)
    if domain is None:
        raise LookupError("this engine has no WireGuard domain")
    return cast(WireGuardDomain, domain)


def sessions(engine: Engine) -> SessionsDomain | None:
    """The access sessions domain: `plexd sessions` lists it, a plain stop closes its sessions."""
    return cast(SessionsDomain | None, engine.domain(SessionsDomain.name))


def nat_endpoint(engine: Engine) -> NatEndpointDomain | None:
    """The control plane's record of this node's endpoint: the heartbeat's `nat` block and the status read it."""
    return cast(NatEndpointDomain | None, engine.domain(NatEndpointDomain.name))


def firewall(engine: Engine) -> FirewallDomain | None:
    """The firewall domain: `plexd policies` reads its table and ruleset."""
    return cast(FirewallDomain | None, engine.domain(FirewallDomain.name))
