"""Shared helpers for the mesh e2e tests (lab nodes driven from the test process)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import pytest
from nacl.public import PrivateKey

from plexd.converge.engine import Engine
from plexd.devplane.lab import Lab, LabNode
from plexd.machine.links import Links
from plexd.machine.wireguard.kernel import KernelBackend
from plexd.machine.wireguard.userspace import UserspaceBackend
from plexd.mesh.wireguard_domain import WireGuardDomain
from plexd.state.desired import DesiredState
from plexd.state.model import Peer

# Both WireGuard backends, for `parametrize`; the kernel one is the kernel tier's (run in the VM: scripts/kernel-vm.sh).
BACKENDS = ["userspace", pytest.param("kernel", marks=pytest.mark.kernel)]


def keypair() -> tuple[str, str]:
    k = PrivateKey.generate()
    return base64.b64encode(bytes(k)).decode(), base64.b64encode(bytes(k.public_key)).decode()


@dataclass
class MeshNode:
    """One lab node driven from the test process by an engine with one WireGuard domain (wireguard-go runs inside
    the node)."""

    lab_node: LabNode
    node_id: str
    private_key: str
    public_key: str
    mesh_ip: str
    backend: UserspaceBackend | KernelBackend
    domain: WireGuardDomain
    converger: Engine

    @property
    def kind(self) -> str:
        return "kernel" if isinstance(self.backend, KernelBackend) else "userspace"

    def desired(self, others: list[MeshNode], **kw) -> DesiredState:
        d = DesiredState.initial(interface="wg0", listen_port=51820, mtu=1420, private_key=self.private_key,
                                 mesh_ip=self.mesh_ip, **kw)
        return d.with_peers([o.as_peer() for o in others])

    def as_peer(self) -> Peer:
        return Peer(id=self.node_id, public_key=self.public_key, mesh_ip=self.mesh_ip,
                    endpoint=f"{self.lab_node.address}:51820", allowed_ips=(f"{self.mesh_ip}/32",))

    def wg_dump(self, lab: Lab) -> list[list[str]]:
        out = lab.exec(self.lab_node, ["wg", "show", "wg0", "dump"]).stdout
        return [line.split("\t") for line in out.splitlines()]


def mesh_node(lab: Lab, index: int, kind: str = "userspace") -> MeshNode:
    node = lab.nodes[index - 1] if index <= len(lab.nodes) else lab.add_node()
    priv, pub = keypair()
    backend: UserspaceBackend | KernelBackend = (
        KernelBackend("wg0", netns=node.netns) if kind == "kernel"
        else UserspaceBackend("wg0", socket_dir=node.sock_dir, launch_prefix=node.wrap([])))
    domain = WireGuardDomain(backend, Links("wg0", netns=node.netns))
    return MeshNode(node, f"n_{index}", priv, pub, f"10.100.0.{index}", backend, domain, Engine([domain]))


def ping(lab: Lab, node: MeshNode, ip: str) -> bool:
    """One echo through the tunnel, allowing for wireguard-go's 5 s handshake retry twice: right after a device
    change the first initiation may go to a port that just closed, and under load the retry can land late."""
    return lab.exec(node.lab_node, ["ping", "-c", "1", "-w", "15", "-i", "0.2", ip], check=False).returncode == 0

