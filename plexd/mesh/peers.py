"""`plexd peers`: the live device's peers with the names an operator knows (the `wg show` / `tailscale status`
view). Reads the device only; public keys are mapped to peer ids through the desired-state mirror in data_dir."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexd.base.errors import PlexdError
from plexd.controlplane.ledger import read_mirror
from plexd.machine.wireguard import DeviceConfig, key_fingerprint
from plexd.mesh.mesh_plan import normalize_endpoint

if TYPE_CHECKING:
    from plexd.config.settings import Config



@dataclass(frozen=True)
class PeerRow:
    id: str
    public_key: str
    mesh_ip: str
    endpoint: str
    allowed_ips: tuple[str, ...]
    latest_handshake: float  # Unix seconds, 0 = never
    rx_bytes: int
    tx_bytes: int
    path: str | None = None  # "relay" on its fallback endpoint (a bridge's relay), "direct"; None: it has no fallback

    def to_json(self, now: float) -> dict[str, Any]:
        hs = self.latest_handshake
        return {
            "id": self.id, "public_key": self.public_key, "mesh_ip": self.mesh_ip, "endpoint": self.endpoint,
            "allowed_ips": list(self.allowed_ips),
            "latest_handshake": datetime.fromtimestamp(hs, UTC).isoformat().replace("+00:00", "Z") if hs else None,
            "latest_handshake_age_seconds": round(now - hs, 1) if hs else None,
            "rx_bytes": self.rx_bytes, "tx_bytes": self.tx_bytes, "path": self.path,
        }


def names_from_mirror(data_dir: str | Path) -> dict[str, tuple[str, str, str]]:
    """public key -> (peer id, mesh IP, fallback endpoint) from the daemon's desired-state mirror; {} without one."""
    try:
        doc = read_mirror(data_dir) or {}
        peers = (doc.get("state") or {}).get("peers") or []
        return {p["public_key"]: (p.get("id", ""), p.get("mesh_ip", ""), p.get("fallback_endpoint") or "")
                for p in peers if p.get("public_key")}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def rows(device: DeviceConfig, names: dict[str, tuple[str, str, str]]) -> list[PeerRow]:
    out = []
    for key, p in device.peers.items():
        pid, mesh_ip, fallback = names.get(key, ("", "", ""))
        if not mesh_ip and len(p.allowed_ips) == 1:
            mesh_ip = next(iter(p.allowed_ips)).split("/")[0]
        # The path is what the device is given: its fallback endpoint (the relay), or not (plexd.services.paths).
        path = None if not fallback else ("relay" if p.endpoint == normalize_endpoint(fallback) else "direct")
        out.append(PeerRow(pid or f"(unknown {key_fingerprint(key)})", key, mesh_ip, p.endpoint,
                           tuple(sorted(p.allowed_ips)), p.last_handshake, p.rx, p.tx, path))
    return sorted(out, key=lambda r: r.id)


def age(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s ago"
    return f"{s // 3600}h{s % 3600 // 60:02d}m ago"


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def format_table(peer_rows: list[PeerRow], now: float) -> str:
    header = ["PEER", "MESH IP", "ENDPOINT", "PATH", "ALLOWED IPS", "HANDSHAKE", "RX", "TX"]
    data = [[r.id, r.mesh_ip or "-", r.endpoint or "-", r.path or "-", ",".join(r.allowed_ips) or "-",
             age(now - r.latest_handshake) if r.latest_handshake else "never", human_bytes(r.rx_bytes),
             human_bytes(r.tx_bytes)] for r in peer_rows]
    if not data:
        return "no peers"
    widths = [max(len(row[i]) for row in [header, *data]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *data])


async def observe_device(config: Config) -> DeviceConfig:
    from plexd.machine.wireguard_select import wireguard_backend

    device = await wireguard_backend(config).observe()  # observing never starts a userspace process
    if device is None:
        raise PlexdError(f"the mesh interface {config.mesh.interface} does not exist: is 'plexd up' running?")
    return device


async def peers_report(config: Config) -> tuple[list[PeerRow], float]:
    device = await observe_device(config)
    return rows(device, names_from_mirror(config.data_dir)), time.time()
