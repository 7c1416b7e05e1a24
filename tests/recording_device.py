"""In-process daemons that need no namespaces: their config, and a stand-in for the WireGuard domain in the real
engine ("the device" is `peers`, a dict of peer ids to public keys, and drift is made by editing it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plexd.config.settings import Config
from plexd.config.settings import load as load_config
from plexd.converge.change import Correction
from plexd.converge.domain import DomainResult
from plexd.machine.wireguard import DeviceConfig, PeerConfig


@dataclass(frozen=True)
class FakeChange:
    correction_type: str
    detail: str

    def correction(self) -> Correction:
        return Correction(self.correction_type, self.detail)


@dataclass
class RecordingDomain:
    """Stands in for the WireGuard domain in the real engine: "the device" is a dict of peers."""

    name = "wireguard"
    touches_machine = True
    acts_while_held = False
    peers: dict = field(default_factory=dict)  # "the device": peer id -> public key
    calls: int = 0

    async def device(self):
        return DeviceConfig(peers={k: PeerConfig(public_key=k) for k in self.peers.values()})

    async def counters(self):
        return {}

    async def counter_rows(self):
        return []

    async def observe(self, desired):
        self.calls += 1
        return dict(self.peers)

    def plan(self, desired, observed):
        changes = []
        for pid, peer in desired.peers.items():
            if observed.get(pid) != peer.public_key:
                changes.append(FakeChange("peer_added", f"peer {pid}: missing from the device"))
        for pid in set(observed) - set(desired.peers):
            changes.append(FakeChange("peer_removed", f"peer {pid}: not desired"))
        return DomainResult(tuple(changes))

    async def apply(self, desired, planned, observed):
        self.peers = {pid: p.public_key for pid, p in desired.peers.items()}
        return DomainResult(planned.changes)

    async def apply_delta(self, desired, touched):
        return None  # no baseline kept: every event converges in full

    async def teardown(self):
        self.peers.clear()

    def status(self):
        return None

    def believed_peer_count(self):
        return None  # no baseline kept: the heartbeat reads the device (the fallback path)


def in_process_config(devplane, tmp_path) -> Config:
    """A daemon of the devplane's, everything under tmp_path, fast cycles, no deregistration at the end."""
    (tmp_path / "token").write_text(devplane.admin.create_token())
    return load_config(env={
        "PLEXD_CONFIG": "", "PLEXD_API": devplane.url, "PLEXD_API_ALLOW_INSECURE": "true",
        "PLEXD_DATA_DIR": str(tmp_path / "data"),
        "PLEXD_HOOKS_DIR": str(tmp_path / "hooks"), "PLEXD_TOKEN_FILE": str(tmp_path / "token"),
        "PLEXD_RECONCILE_INTERVAL": "1s", "PLEXD_HEARTBEAT_INTERVAL": "1s",
        "PLEXD_SHUTDOWN_DEREGISTER": "false", "PLEXD_NODE_API_SOCKET_PATH": str(tmp_path / "api.sock")})
