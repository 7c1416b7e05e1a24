"""The metrics stream's points (plexd-protocol.md §1.14), written as the JSON texts the queue stores.

A collection at 1,000 peers is 1,000 tunnel points every 15 s: building a dict per point and encoding it was
most of the metrics stream's cost on an idle node, so tunnel points are written straight into their text. The
texts are what `plexd.telemetry.queue.encode` makes of the same points (keys in the same order, compact), with
peer ids ASCII-escaped so a lone surrogate from outside input can never make a row unencodable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from plexd.base.gojson import GO_ZERO_TIME, format_unix
from plexd.mesh.wireguard import PeerCounters
from plexd.state.model import Peer
from plexd.telemetry.queue import encode

STALE_HANDSHAKE = 300.0  # §1.14: handshake_stale when older than 5 min


class MetricPoints:
    """Renders one collection's points. Keeps the texts of peer ids and handshake times from the collection
    before (a handshake changes every two minutes, a collection comes every 15 s), only those still in use."""

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}
        self._times: dict[float, str] = {0.0: json.dumps(GO_ZERO_TIME)}

    def texts(self, stamp: str, system: dict[str, Any] | None, counters: Mapping[str, PeerCounters] | None,
              peers: Mapping[str, Peer], rtts: Mapping[str, int], now: float) -> list[str]:
        """The points, in order: system (when sampled), a tunnel point per desired peer on the device, latency."""
        out: list[str] = []
        if system is not None:
            out.append(encode({"timestamp": stamp, "group": "system", "data": system}))
        on_device = counters if counters is not None else {}
        head = '{"timestamp":' + json.dumps(stamp) + ',"group":"tunnel","peer_id":'
        ids, times = self._ids, self._times
        kept_ids: dict[str, str] = {}
        kept_times: dict[float, str] = {0.0: times[0.0]}
        for peer_id, peer in peers.items():
            live = on_device.get(peer.public_key)
            if live is None:
                continue
            pid = ids.get(peer_id) or json.dumps(peer_id)
            kept_ids[peer_id] = pid
            handshake = live.last_handshake
            when = times.get(handshake) or json.dumps(format_unix(handshake))
            kept_times[handshake] = when
            out.append(f'{head}{pid},"data":{{"peer_id":{pid},"last_handshake_time":{when},'
                       f'"rx_bytes":{live.rx},"tx_bytes":{live.tx},'
                       f'"handshake_succeeded":{"true" if handshake > 0 else "false"},'
                       f'"handshake_stale":{"true" if now - handshake > STALE_HANDSHAKE else "false"}}}}}')
        self._ids, self._times = kept_ids, kept_times
        for peer_id, rtt in rtts.items():
            out.append(encode({"timestamp": stamp, "group": "latency", "peer_id": peer_id,
                               "data": {"peer_id": peer_id, "rtt_nano": rtt}}))
        return out
