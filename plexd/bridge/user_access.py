"""User access: people's devices (plain WireGuard clients) reach the mesh through the bridge's `wg-access`.

The interface's key is generated once and kept (`plexd.bridge.interface_keys`); its public key and port are in
`plexd status --json` and the status reports, so a client can be configured and stays configured across
restarts. Peers come from the control plane, each with the prefixes it may use as its own; routes for those
prefixes go in the mesh table, and forwarding is turned on for the access interface and the mesh interface
only (`plexd.bridge.forwarding`). What an access peer may reach is the policy's to say: the firewall filters
what arrives on the access interface with the same rules as the mesh (`plexd.firewall.ruleset`), so a peer
reaches a node only where a rule allows its prefix to; and what it sends is forwarded nowhere outside the mesh
range, which holds every address a policy can name (so a rule's `*` means the mesh, never the bridge's LAN, a
remote site or the Internet). From the mesh, only the access peers' prefixes are forwarded to.

Access clients are addressed like nodes, from the mesh range (so the policy can name them: a policy CIDR lies
in `policy.mesh_range`), on addresses no node has. Refused, each peer by itself with the reason: a prefix holding
a node's mesh address, a prefix in this machine's own networks, a default route, a prefix another access peer
already has, and whatever the mesh's route guard refuses (`interfaces.RouteGuard`: the control plane's address,
a peer's endpoint, more of the address space than `mesh.max_route_percent`, ...).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from plexd.bridge.forwarding import Forward
from plexd.bridge.interface_keys import interface_key
from plexd.bridge.interfaces import RouteGuard, Wanted, clash_reason, own_networks
from plexd.bridge.wgif import InterfaceSpec
from plexd.machine.links import Underlay
from plexd.machine.wireguard import PeerConfig
from plexd.state.bridge_blocks import TUNNEL_PREFIX
from plexd.state.desired import DesiredState

PART = "user access"


def overlap_reason(cidr: str, mesh_range: Sequence[str], own: Sequence[object]) -> str:
    """Why `cidr` cannot be routed to a bridge's peer or tunnel ("" when it can)."""
    net = ipaddress.ip_network(cidr)
    if net.prefixlen == 0:
        return "a default route"
    for text in mesh_range:
        mesh = ipaddress.ip_network(text)
        if mesh.version == net.version and mesh.overlaps(net):
            return f"overlaps the mesh ({mesh})"
    for other in own:
        if getattr(other, "version", 0) == net.version and other.overlaps(net):  # type: ignore[attr-defined]
            return f"overlaps this machine's own network {other}"
    return ""


def _holds_node(cidr: str, mesh_ips: Sequence[str]) -> str:
    net = ipaddress.ip_network(cidr)
    for text in mesh_ips:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            continue
        if ip.version == net.version and ip in net:
            return f"holds the mesh address {ip} of a node"
    return ""


def access_specs(data_dir: str, mesh_interface: str, reserved_ports: Mapping[int, str] | None = None):
    """`reserved_ports`: UDP ports this machine's other parts listen on (the relay's), by who."""
    key: list[tuple[str, str]] = []

    def specs(desired: DesiredState, underlay: Underlay) -> Wanted:
        access = desired.user_access
        if access is None or not access.enabled:
            return Wanted({}, access.refused if access is not None else ())
        clash = _clash(access.interface, access.listen_port, desired)
        if clash:
            return Wanted({}, (*access.refused, f"user access: refused: {clash}"))
        if not key:
            key.append(interface_key(data_dir, "access"))
        private, public = key[0]
        own = own_networks(underlay)
        nodes = [desired.mesh_ip, *(p.mesh_ip for p in desired.peers.values() if p.mesh_ip)]
        refused = list(access.refused)
        peers: dict[str, PeerConfig] = {}
        taken: dict[str, str] = {}
        guard = RouteGuard(desired)
        for peer in access.peers:
            name = peer.label or peer.public_key[:8] + "…"
            problems = [f"{c}: {r}" for c in peer.allowed_ips
                        if (r := overlap_reason(c, (), own) or _holds_node(c, nodes)
                            or (f"already access peer {taken[c]}'s" if c in taken else "")
                            or guard.reason(c, f"access peer {name}"))]
            if problems:
                refused.append(f"user access peer {name}: refused: " + "; ".join(problems))
                continue
            taken.update(dict.fromkeys(peer.allowed_ips, name))
            for cidr in peer.allowed_ips:
                guard.claim(cidr, f"access peer {name}")
            peers[peer.public_key] = PeerConfig(peer.public_key, allowed_ips=frozenset(peer.allowed_ips),
                                                psk=peer.psk)
        forwarding = (Forward(access.interface, desired.mesh_range), Forward(mesh_interface, tuple(taken)))
        spec = InterfaceSpec(PART, access.interface, private, access.listen_port, peers, frozenset(taken),
                             forwarding)
        status = {"interface": access.interface, "public_key": public, "listen_port": access.listen_port,
                  "peer_count": len(peers)}
        return Wanted({access.interface: spec}, tuple(refused), status)

    def _clash(name: str, port: int, desired: DesiredState) -> str:
        if name.startswith(TUNNEL_PREFIX):
            return f"interface {name} is named like a site-to-site tunnel's ({TUNNEL_PREFIX}N)"
        # Not the tunnels' ports: on a clash the tunnel is the one refused (site_to_site checks this port), so
        # one mistake never takes both down.
        taken = {**(reserved_ports or {}), desired.listen_port: "the mesh interface"}
        return clash_reason(name, port, mesh_interface, taken)

    return specs
