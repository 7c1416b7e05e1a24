"""What `plexd.node.domain_list.build_engine` needs to list a bridge's domains (the relay, the user-access and
site-to-site interfaces, ingress), and the heartbeat blocks that read them.

Imported only where the node is a bridge (`build_engine`, the daemon's heartbeat and status reports): a node that
is not one never loads the relay, the extra interfaces, ingress and their helpers, about 0.6 MiB of modules in a
daemon whose budget is 50 MiB at 1,000 peers."""

from __future__ import annotations

from typing import Any, cast

from plexd.bridge.forwarding import ForwardingLedger
from plexd.bridge.ingress import IngressDomain
from plexd.bridge.interfaces import InterfacesDomain
from plexd.bridge.relay_domain import RelayDomain
from plexd.bridge.site_to_site import tunnel_specs
from plexd.bridge.status import heartbeat_blocks
from plexd.bridge.user_access import access_specs
from plexd.bridge.wgif import WgInterface
from plexd.config.settings import Config
from plexd.converge.engine import Engine
from plexd.machine.links import Links
from plexd.machine.wireguard_select import wireguard_backend

__all__ = ["IngressDomain", "RelayDomain", "bridge_heartbeat", "bridge_interfaces", "split_host_port"]

USER_ACCESS = "user_access"
SITE_TO_SITE = "site_to_site"


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
    relay_port = {split_host_port(config.bridge.relay.listen)[1]: "the relay"}
    return [
        InterfacesDomain(USER_ACCESS, "user access", access_specs(config.data_dir, mesh.interface, relay_port),
                         lambda d: d.user_access, interface, underlay, ledger, config.data_dir),
        InterfacesDomain(SITE_TO_SITE, "site-to-site", tunnel_specs(
            config.data_dir, mesh.interface, mesh_range, config.bridge.site_to_site.allow_default_route,
            relay_port), lambda d: d.site_to_site, interface, underlay, ledger, config.data_dir),
    ]


def split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def bridge_heartbeat(engine: Engine) -> dict[str, Any]:
    """The heartbeat's `bridge`, `user_access`, `ingress` and `site_to_site` objects, from the live domains."""
    served = cast(RelayDomain | None, engine.domain(RelayDomain.name))
    access, tunnels = (cast(InterfacesDomain | None, engine.domain(name)) for name in (USER_ACCESS, SITE_TO_SITE))
    served_ingress = cast(IngressDomain | None, engine.domain(IngressDomain.name))
    return heartbeat_blocks(served.relay.status() if served is not None else None,
                            access.status() if access is not None else None,
                            tunnels.status() if tunnels is not None else None,
                            served_ingress.status() if served_ingress is not None else None)
