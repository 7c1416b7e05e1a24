"""The metrics stream's points, written straight into JSON text: each text is one compact JSON object with the
§1.14 shape, keys in the Go agent's order, and the texts kept from the collection before never leak into the
next one (a peer's new handshake, a peer gone)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from plexd.base.gojson import format_unix
from plexd.mesh.wireguard import PeerCounters
from plexd.state.model import Peer
from plexd.telemetry.points import MetricPoints

STAMP = "2026-11-26T09:00:00.5Z"
NOW = 1_790_000_000.0


def key(i: int) -> str:
    return f"{i:043d}="


def tunnel(peer_id: str, handshake: float, rx: int, tx: int) -> dict:
    return {"timestamp": STAMP, "group": "tunnel", "peer_id": peer_id, "data": {
        "peer_id": peer_id, "last_handshake_time": format_unix(handshake) if handshake else "0001-01-01T00:00:00Z",
        "rx_bytes": rx, "tx_bytes": tx, "handshake_succeeded": handshake > 0,
        "handshake_stale": NOW - handshake > 300}}


def test_points_in_order_with_the_go_shapes_and_key_order():
    peers = {"n_a": Peer("n_a", key(1), "10.100.0.2"), "n_b": Peer("n_b", key(2), "10.100.0.3"),
             "n_off": Peer("n_off", key(3), "10.100.0.4")}
    device = {key(1): PeerCounters(NOW - 30.25, 10, 20),
              key(2): PeerCounters(0.0, 0, 0)}  # never shook hands; n_off is not on the device
    texts = MetricPoints().texts(STAMP, {"cpu": 1.5}, device, peers, {"n_a": 420_000, "n_b": -1}, NOW)
    assert [json.loads(t) for t in texts] == [
        {"timestamp": STAMP, "group": "system", "data": {"cpu": 1.5}},
        tunnel("n_a", NOW - 30.25, 10, 20),
        tunnel("n_b", 0.0, 0, 0),
        {"timestamp": STAMP, "group": "latency", "peer_id": "n_a", "data": {"peer_id": "n_a", "rtt_nano": 420_000}},
        {"timestamp": STAMP, "group": "latency", "peer_id": "n_b", "data": {"peer_id": "n_b", "rtt_nano": -1}},
    ]
    assert texts[1] == json.dumps(tunnel("n_a", NOW - 30.25, 10, 20), separators=(",", ":"))
    assert texts[2].endswith('"handshake_succeeded":false,"handshake_stale":true}}')


def test_a_stale_handshake_and_no_device():
    peers = {"n_a": Peer("n_a", key(1), "10.100.0.2")}
    device = {key(1): PeerCounters(NOW - 301, 1, 2)}
    [text] = MetricPoints().texts(STAMP, None, device, peers, {}, NOW)
    assert json.loads(text)["data"]["handshake_stale"] is True
    assert MetricPoints().texts(STAMP, None, None, peers, {}, NOW) == []


def test_texts_kept_from_the_collection_before_follow_the_device():
    points = MetricPoints()
    peers = {"n_a": Peer("n_a", key(1), "10.100.0.2"), "n_b": Peer("n_b", key(2), "10.100.0.3")}
    first = {key(1): PeerCounters(NOW - 100, 1, 1), key(2): PeerCounters(NOW - 100, 1, 1)}
    points.texts(STAMP, None, first, peers, {}, NOW)
    second = {key(1): PeerCounters(NOW - 5, 9, 8)}
    [text] = points.texts(STAMP, None, second, {"n_a": peers["n_a"]}, {}, NOW)
    assert json.loads(text) == tunnel("n_a", NOW - 5, 9, 8)
    assert len(points._ids) == 1 and set(points._times) == {0.0, NOW - 5}  # nothing of n_b or the old handshake


@given(peer_id=st.text(max_size=40), handshake=st.one_of(st.just(0.0), st.floats(1.0, 4e9)),
       rx=st.integers(0, 2**64 - 1), tx=st.integers(0, 2**64 - 1))
def test_any_peer_id_and_counters_make_valid_encodable_json(peer_id, handshake, rx, tx):
    peers = {peer_id: Peer(peer_id, key(1), "10.100.0.2")}
    device = {key(1): PeerCounters(handshake, rx, tx)}
    [text] = MetricPoints().texts(STAMP, None, device, peers, {}, NOW)
    text.encode()  # a lone surrogate in an id is escaped, never an unencodable row
    assert json.loads(text) == tunnel(peer_id, handshake, rx, tx)
