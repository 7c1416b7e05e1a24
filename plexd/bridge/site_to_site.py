"""Site-to-site: WireGuard tunnels (`wg-s2s-*`) from this bridge to remote sites' gateways.

Each tunnel is one interface with its own kept key (`plexd.bridge.interface_keys`, by tunnel id: the remote end is
configured with it once), one peer (the remote gateway, its `remote_subnets` as allowed IPs), a route per remote subnet
in the mesh table, and forwarding turned on for the tunnel, the mesh interface and the interfaces that hold the tunnel's
`local_subnets` (their previous values are put back when the tunnel goes: never forced to 0). What a remote site may
reach is only its `local_subnets` (`plexd.firewall.ruleset`): the Go agent let it reach everything the bridge could
(docs/decisions.md, Go defect D8). Forwarding is limited the same way (`plexd.bridge.forwarding`): what arrives through
the tunnel to its local subnets, what arrives from the mesh or a local subnet's LAN to its remote subnets, and nowhere
else (a LAN's forwarding was on for its hosts to reach the remote site, not the Internet).

Refused, each tunnel by itself with the reason: a remote subnet inside the mesh range or this machine's own
networks, a default route unless `bridge.site_to_site.allow_default_route`, a local subnet inside the mesh, a
remote subnet another tunnel already has, and (but for an allowed default route) whatever the mesh's route guard
refuses (`interfaces.RouteGuard`: the control plane's address, a peer's endpoint, the tunnel's own remote end,
more of the address space in all than `mesh.max_route_percent`, ...): the routes go in the mesh's table, looked
up before the main one, so they steer this machine's own traffic too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from plexd.bridge.forwarding import Forward
from plexd.bridge.interface_keys import interface_key
from plexd.bridge.interfaces import RouteGuard, Wanted, clash_reason, own_networks
from plexd.bridge.user_access import overlap_reason
from plexd.bridge.wgif import InterfaceSpec
from plexd.machine.links import Underlay
from plexd.machine.wireguard import PeerConfig
from plexd.state.desired import DesiredState

KEEPALIVE = 25  # a remote gateway behind NAT stays reachable


DEFAULT_ROUTES = ("0.0.0.0/0", "::/0")


def lan_interfaces(subnets: Sequence[str], underlay: Underlay) -> tuple[str, ...]:
    """The interfaces holding an address inside one of `subnets` (where the local sites are)."""
    found = []
    for text in subnets:
        net = ipaddress.ip_network(text)
        for address, name in sorted(underlay.on):
            iface = ipaddress.ip_interface(address)
            if name and iface.version == net.version and (iface.ip in net or iface.network.overlaps(net)):
                found.append(name)
    return tuple(dict.fromkeys(n for n in found if n != "lo"))


def tunnel_specs(data_dir: str, mesh_interface: str, mesh_range: Sequence[str], allow_default_route: bool,
                 reserved_ports: Mapping[int, str] | None = None):
    """`reserved_ports`: UDP ports this machine's other parts listen on (the relay's), by who."""
    keys: dict[str, tuple[str, str]] = {}

    def specs(desired: DesiredState, underlay: Underlay) -> Wanted:
        s2s = desired.site_to_site
        if s2s is None or not s2s.enabled:
            return Wanted({}, s2s.refused if s2s is not None else ())
        own = own_networks(underlay)
        refused = list(s2s.refused)
        wanted: dict[str, InterfaceSpec] = {}
        taken: dict[str, str] = {}
        status = []
        access = desired.user_access
        taken_ports = {**({access.listen_port: "user access"} if access is not None and access.enabled else {}),
                       **(reserved_ports or {}), desired.listen_port: "the mesh interface"}
        guard = RouteGuard(desired)
        for tunnel in s2s.tunnels:
            problems = []
            clash = clash_reason(tunnel.interface, tunnel.listen_port, mesh_interface, taken_ports)
            if clash:
                problems.append(clash)
            host, port = tunnel.remote_endpoint
            endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            owner = f"tunnel {tunnel.tunnel_id}"
            for cidr in tunnel.remote_subnets:
                reason = overlap_reason(cidr, mesh_range, own)
                if reason == "a default route" and allow_default_route:
                    reason = ""
                elif reason == "a default route":
                    reason += " (bridge.site_to_site.allow_default_route is off)"
                if cidr in taken:
                    reason = f"already tunnel {taken[cidr]}'s"
                if not reason and not (allow_default_route and cidr in DEFAULT_ROUTES):
                    # (a default route the operator allowed is theirs: it holds every address, so the guard
                    # would refuse it by definition)
                    reason = guard.reason(cidr, owner, endpoint=endpoint)
                if reason:
                    problems.append(f"remote subnet {cidr}: {reason}")
            for cidr in tunnel.local_subnets:
                reason = overlap_reason(cidr, mesh_range, ())
                if reason:
                    problems.append(f"local subnet {cidr}: {reason}")
            if problems:
                refused.append(f"site-to-site tunnel {tunnel.tunnel_id}: refused: " + "; ".join(problems))
                continue
            taken.update(dict.fromkeys(tunnel.remote_subnets, tunnel.tunnel_id))
            for cidr in tunnel.remote_subnets:
                guard.claim(cidr, owner)
            if tunnel.tunnel_id not in keys:
                keys[tunnel.tunnel_id] = interface_key(data_dir, tunnel.tunnel_id)
            private, public = keys[tunnel.tunnel_id]
            peer = PeerConfig(tunnel.remote_public_key, endpoint=endpoint,
                              allowed_ips=frozenset(tunnel.remote_subnets), psk=tunnel.psk,
                              persistent_keepalive=KEEPALIVE)
            remote, lans = tunnel.remote_subnets, lan_interfaces(tunnel.local_subnets, underlay)
            forwarding: dict[str, Forward] = {}
            for forward in (Forward(tunnel.interface, tunnel.local_subnets), Forward(mesh_interface, remote),
                            *(Forward(lan, remote, lan=True) for lan in lans)):
                forwarding.setdefault(forward.interface, forward)  # one limit an interface: the first named
            wanted[tunnel.interface] = InterfaceSpec(
                f"site-to-site {tunnel.tunnel_id}", tunnel.interface, private, tunnel.listen_port,
                {peer.public_key: peer}, frozenset(tunnel.remote_subnets), tuple(forwarding.values()))
            status.append({"tunnel_id": tunnel.tunnel_id, "interface": tunnel.interface, "public_key": public,
                           "listen_port": tunnel.listen_port, "local_subnets": list(tunnel.local_subnets),
                           "remote_subnets": list(tunnel.remote_subnets)})
        return Wanted(wanted, tuple(refused), {"tunnels": status})

    return specs
