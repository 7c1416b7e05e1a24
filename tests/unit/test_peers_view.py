"""`plexd peers`: key → id mapping through the desired-state mirror, handshake ages, JSON shape."""

from __future__ import annotations

import json

from plexd.controlplane.ledger import EventLedger, MirrorChange
from plexd.machine.wireguard import DeviceConfig, PeerConfig
from plexd.mesh.peers import format_table, names_from_mirror, rows

K1, K2 = "A" * 43 + "=", "B" * 43 + "="


def test_rows_json_and_table(tmp_path) -> None:
    ledger = EventLedger(tmp_path / "events.db")  # as the daemon writes its mirror
    ledger.write(None, 0.0, MirrorChange('{"state":{}}', [("n_a", json.dumps(
        {"id": "n_a", "public_key": K1, "mesh_ip": "10.100.0.2"}))], [], full=True))
    names = names_from_mirror(tmp_path)
    dev = DeviceConfig(peers={
        K1: PeerConfig(K1, "10.0.0.2:51820", frozenset({"10.100.0.2/32"}), last_handshake=1000.0, rx=2048, tx=10),
        K2: PeerConfig(K2, "", frozenset({"10.100.0.9/32"})),
    })
    r = rows(dev, names)
    assert [x.id for x in r] == ["(unknown BBBBBBBB…)", "n_a"]
    doc = r[1].to_json(now=1012.0)
    assert doc == {"id": "n_a", "public_key": K1, "mesh_ip": "10.100.0.2", "endpoint": "10.0.0.2:51820",
                   "allowed_ips": ["10.100.0.2/32"], "latest_handshake": "1970-01-01T00:16:40Z",
                   "latest_handshake_age_seconds": 12.0, "rx_bytes": 2048, "tx_bytes": 10, "path": None}
    assert r[0].to_json(now=1012.0)["latest_handshake"] is None and r[0].mesh_ip == "10.100.0.9"
    table = format_table(r, now=1012.0).splitlines()
    assert table[0].split() == ["PEER", "MESH", "IP", "ENDPOINT", "PATH", "ALLOWED", "IPS", "HANDSHAKE", "RX", "TX"]
    assert "12s ago" in table[2] and "2.0 KiB" in table[2] and "never" in table[1]
    assert names_from_mirror(tmp_path / "missing") == {}


def test_a_peer_with_a_fallback_shows_which_path_the_device_is_on() -> None:
    relay = "203.0.113.1:51821"
    names = {K1: ("n_a", "10.100.0.2", relay), K2: ("n_b", "10.100.0.3", relay)}
    dev = DeviceConfig(peers={K1: PeerConfig(K1, relay), K2: PeerConfig(K2, "198.51.100.7:51820")})
    assert {r.id: r.path for r in rows(dev, names)} == {"n_a": "relay", "n_b": "direct"}
    assert "relay" in format_table(rows(dev, names), now=0.0).splitlines()[1].split()
