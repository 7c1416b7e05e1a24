"""The one list of domains: `build_engine(config)` for the daemon, `reconcile --once`, `plexd deregister` and the
lab. Adding a piece of machine state to plexd means writing its domain (`plexd.converge.domain.Domain`) and adding
it here, in the order it must apply (the firewall before the device: a new peer meets its rules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from plexd.access.domain import AccessHooks, SessionsDomain
from plexd.bridge.domain import RelayDomain
from plexd.bridge.forwarding import ForwardingLedger
from plexd.bridge.ingress import IngressDomain
from plexd.bridge.interfaces import InterfacesDomain
from plexd.bridge.site_to_site import tunnel_specs
from plexd.bridge.user_access import access_specs
from plexd.bridge.wgif import WgInterface
from plexd.config.settings import Config
from plexd.converge.engine import Engine
from plexd.firewall.domain import FirewallDomain
from plexd.mesh.domain import WireGuardDomain
from plexd.mesh.links import Links
from plexd.mesh.select import wireguard_backend
from plexd.nat.domain import NatEndpointDomain, NatHooks
from plexd.nodeapi.cache import NodeStateCache
from plexd.trust.domain import SigningKeyFile


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
    host, port = split_host_port(config.bridge.relay.listen)
    return Engine([
        FirewallDomain(config.mesh.interface, enabled=config.policy.enabled, log_denied=config.policy.log_denied,
                       bridge=config.mode == "bridge"),
        NodeStateCache(config.data_dir),
        SigningKeyFile(config.data_dir, trusted_key),
        WireGuardDomain(wireguard_backend(config), links),
        *([SessionsDomain(config.data_dir, access)] if access is not None and config.access.enabled else []),
        *([RelayDomain(host, port, fastpath_address=config.bridge.relay.fastpath_address,
                       cp_reachable=cp_reachable)] if cp_reachable is not None and config.mode == "bridge" else []),
        *(bridge_interfaces(config) if config.mode == "bridge" else []),
        *([IngressDomain(config.data_dir, host=config.bridge.ingress.listen_address,
                         mesh_range=config.policy.mesh_range, allowed_sources=config.bridge.ingress.allowed_sources)]
          if cp_reachable is not None and config.mode == "bridge" else []),
        *([NatEndpointDomain(nat)] if nat is not None else []),
    ])


def bridge_interfaces(config: Config) -> list[InterfacesDomain]:
    """Bridge mode's WireGuard interfaces besides the mesh: user access and the site-to-site tunnels. Also in
    `reconcile --once` and `plexd deregister`: they are machine state like the mesh device (and must go with it)."""
    ledger = ForwardingLedger(config.data_dir)
    mesh = config.mesh

    def interface(name: str) -> WgInterface:
        return WgInterface(wireguard_backend(config, name),
                           Links(name, table=mesh.route_table, rule_priority=mesh.route_rule_priority), ledger)

    underlay = Links(mesh.interface)
    mesh_range = config.policy.mesh_range
    return [
        InterfacesDomain(USER_ACCESS, "user access", access_specs(config.data_dir, mesh.interface),
                         lambda d: d.user_access, interface, underlay, ledger, config.data_dir),
        InterfacesDomain(SITE_TO_SITE, "site-to-site", tunnel_specs(
            config.data_dir, mesh.interface, mesh_range, config.bridge.site_to_site.allow_default_route),
            lambda d: d.site_to_site, interface, underlay, ledger, config.data_dir),
    ]


USER_ACCESS = "user_access"
SITE_TO_SITE = "site_to_site"


def split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


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


def relay(engine: Engine) -> RelayDomain | None:
    """Bridge mode's relay: the heartbeat's `bridge` object reads it."""
    return cast(RelayDomain | None, engine.domain(RelayDomain.name))


def bridge_part(engine: Engine, name: str) -> InterfacesDomain | None:
    """`USER_ACCESS` or `SITE_TO_SITE`: the status and heartbeat read them."""
    return cast(InterfacesDomain | None, engine.domain(name))


def ingress(engine: Engine) -> IngressDomain | None:
    return cast(IngressDomain | None, engine.domain(IngressDomain.name))


def nat_endpoint(engine: Engine) -> NatEndpointDomain | None:
    """The control plane's record of this node's endpoint: the heartbeat's `nat` block and the status read it."""
    return cast(NatEndpointDomain | None, engine.domain(NatEndpointDomain.name))


def firewall(engine: Engine) -> FirewallDomain | None:
    """The firewall domain: `plexd policies` reads its table and ruleset."""
    return cast(FirewallDomain | None, engine.domain(FirewallDomain.name))
