"""The metrics stream's points (docs/protocol.md §1.14), written as the JSON texts the queue stores.

A collection at 1,000 peers is 1,000 tunnel points every 15 s: building a dict per point and encoding it was
most of the metrics stream's cost on an idle node, so tunnel points are written straight into their text from the
device's counter rows (its digits go into the text as they are). The texts are what
`plexd.telemetry.queue.encode` makes of the same points (keys in the same order, compact), with peer ids
ASCII-escaped so a lone surrogate from outside input can never make a row unencodable.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from typing import Any

from plexd.base.gojson import GO_ZERO_TIME, format_unix
from plexd.base.memo import ByIdentity
from plexd.machine.wireguard import CounterRow
from plexd.state.model import Peer
from plexd.telemetry.queue import encode

STALE_HANDSHAKE = 300.0  # §1.14: handshake_stale when older than 5 min
_NEVER = json.dumps(GO_ZERO_TIME)


class MetricPoints:
    """Renders one collection's points. Keeps, per desired state, which peer each device key is, and from the
    collection before the texts of peer ids and handshake times (a handshake changes every two minutes, a
    collection comes every 15 s), only those still in use."""

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}
        self._times: dict[tuple[str, str], str] = {}
        self._peer_of_key = ByIdentity[dict[str, str]](size=2)

    def texts(self, stamp: str, system: dict[str, Any] | None, rows: Sequence[CounterRow] | None,
              peers: Mapping[str, Peer], rtts: Mapping[str, int], now: float) -> list[str]:
        """The points, in order: system (when sampled), a tunnel point per desired peer on the device (in the
        device's order), latency."""
        out: list[str] = []
        if system is not None:
            out.append(encode({"timestamp": stamp, "group": "system", "data": system}))
        peer_of_key = self._peer_of_key.get(peers, None, lambda: _by_hex_key(peers))
        head = '{"timestamp":' + json.dumps(stamp) + ',"group":"tunnel","peer_id":'
        ids, times = self._ids, self._times
        kept_ids: dict[str, str] = {}
        kept_times: dict[tuple[str, str], str] = {}
        for key, sec, nsec, tx, rx in rows or ():
            peer_id = peer_of_key.get(key)
            if peer_id is None:
                continue
            pid = ids.get(peer_id) or json.dumps(peer_id)
            kept_ids[peer_id] = pid
            handshake = int(sec) + int(nsec) / 1e9
            if handshake > 0:
                when = times.get((sec, nsec)) or _time_text(handshake)
                kept_times[sec, nsec] = when
            else:
                when = _NEVER
            if when == _NEVER:  # none yet, or one the time cannot be written for: the point says never, all of it
                handshake = 0
            out.append(f'{head}{pid},"data":{{"peer_id":{pid},"last_handshake_time":{when},'
                       f'"rx_bytes":{rx},"tx_bytes":{tx},'
                       f'"handshake_succeeded":{"true" if handshake > 0 else "false"},'
                       f'"handshake_stale":{"true" if now - handshake > STALE_HANDSHAKE else "false"}}}}}')
        self._ids, self._times = kept_ids, kept_times
        for peer_id, rtt in rtts.items():
            out.append(encode({"timestamp": stamp, "group": "latency", "peer_id": peer_id,
                               "data": {"peer_id": peer_id, "rtt_nano": rtt}}))
        return out


def _time_text(seconds: float) -> str:
    try:
        return json.dumps(format_unix(seconds))
    except (OverflowError, OSError, ValueError):  # past year 9999: a device's nonsense, not a reason to fail
        return _NEVER


def _by_hex_key(peers: Mapping[str, Peer]) -> dict[str, str]:
    """Peer id by public key in hex, as the device's rows name them (a key that is not base64 names nobody)."""
    out: dict[str, str] = {}
    for peer_id, peer in peers.items():
        try:
            out[base64.b64decode(peer.public_key, validate=True).hex()] = peer_id
        except (binascii.Error, ValueError):
            continue
    return out
