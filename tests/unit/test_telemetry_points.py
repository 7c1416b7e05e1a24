"""The metrics stream's points, written straight into JSON text from the device's counter rows: each text is one
compact JSON object with the §1.14 shape, keys in the Go agent's order, and the texts kept from the collection
before never leak into the next one (a peer's new handshake, a peer gone, a new desired state)."""

from __future__ import annotations

import base64
import json

from hypothesis import given
from hypothesis import strategies as st

from plexd.base.gojson import format_unix
from plexd.state.model import Peer
from plexd.telemetry.points import MetricPoints

STAMP = "2026-11-26T09:00:00.5Z"
NOW = 1_790_000_000.0


def key(i: int) -> str:
    return base64.b64encode(bytes([i]) * 32).decode()


def row(i: int, sec: int, nsec: int, rx: int, tx: int) -> tuple[str, str, str, str, str]:
    """A counter row as the device writes it: the key in hex, the numbers as digits."""
    return base64.b64decode(key(i)).hex(), str(sec), str(nsec), str(tx), str(rx)


def tunnel(peer_id: str, handshake: float, rx: int, tx: int) -> dict:
    return {"timestamp": STAMP, "group": "tunnel", "peer_id": peer_id, "data": {
        "peer_id": peer_id, "last_handshake_time": format_unix(handshake) if handshake else "0001-01-01T00:00:00Z",
        "rx_bytes": rx, "tx_bytes": tx, "handshake_succeeded": handshake > 0,
        "handshake_stale": NOW - handshake > 300}}


def test_points_in_order_with_the_go_shapes_and_key_order():
    peers = {"n_a": Peer("n_a", key(1), "10.100.0.2"), "n_b": Peer("n_b", key(2), "10.100.0.3"),
             "n_off": Peer("n_off", key(3), "10.100.0.4")}
    device = [row(1, int(NOW) - 31, 750_000_000, 10, 20),
              row(2, 0, 0, 0, 0),  # never shook hands; n_off is not on the device
              row(9, int(NOW), 0, 5, 5)]  # on the device, not desired: no point
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


def test_a_stale_handshake_no_device_and_a_handshake_past_year_9999():
    peers = {"n_a": Peer("n_a", key(1), "10.100.0.2")}
    [text] = MetricPoints().texts(STAMP, None, [row(1, int(NOW) - 301, 0, 1, 2)], peers, {}, NOW)
    assert json.loads(text)["data"]["handshake_stale"] is True
    assert MetricPoints().texts(STAMP, None, None, peers, {}, NOW) == []
    points = MetricPoints()
    for _ in range(2):  # and again, from the texts kept from the collection before
        [text] = points.texts(STAMP, None, [row(1, 10**19, 0, 1, 2)], peers, {}, NOW)
        data = json.loads(text)["data"]  # a device's nonsense: written as never, the whole point agreeing
        assert (data["last_handshake_time"], data["handshake_succeeded"], data["handshake_stale"]) == (
            "0001-01-01T00:00:00Z", False, True)


def test_texts_kept_from_the_collection_before_follow_the_device_and_the_desired_state():
    points = MetricPoints()
    peers = {"n_a": Peer("n_a", key(1), "10.100.0.2"), "n_b": Peer("n_b", key(2), "10.100.0.3")}
    points.texts(STAMP, None, [row(1, int(NOW) - 100, 0, 1, 1), row(2, int(NOW) - 100, 0, 1, 1)], peers, {}, NOW)
    [text] = points.texts(STAMP, None, [row(1, int(NOW) - 5, 0, 9, 8)], {"n_a": peers["n_a"]}, {}, NOW)
    assert json.loads(text) == tunnel("n_a", NOW - 5, 9, 8)
    assert set(points._ids) == {"n_a"} and set(points._times) == {(str(int(NOW) - 5), "0")}  # nothing of n_b
    # A new desired state gives the key to another peer id: the points say so at once.
    [text] = points.texts(STAMP, None, [row(1, int(NOW) - 5, 0, 9, 8)], {"n_z": Peer("n_z", key(1), "10.1.0.9")},
                          {}, NOW)
    assert json.loads(text)["peer_id"] == "n_z"


def test_a_desired_key_that_is_not_base64_names_no_device_row():
    peers = {"n_bad": Peer("n_bad", "not base64!", "10.100.0.2"), "n_a": Peer("n_a", key(1), "10.100.0.3")}
    texts = MetricPoints().texts(STAMP, None, [row(1, 0, 0, 0, 0)], peers, {}, NOW)
    assert [json.loads(t)["peer_id"] for t in texts] == ["n_a"]


@given(peer_id=st.text(max_size=40), sec=st.one_of(st.just(0), st.integers(1, 4 * 10**9)),
       nsec=st.integers(0, 999_999_999), rx=st.integers(0, 2**64 - 1), tx=st.integers(0, 2**64 - 1))
def test_any_peer_id_and_counters_make_valid_encodable_json(peer_id, sec, nsec, rx, tx):
    peers = {peer_id: Peer(peer_id, key(1), "10.100.0.2")}
    [text] = MetricPoints().texts(STAMP, None, [row(1, sec, nsec, rx, tx)], peers, {}, NOW)
    text.encode()  # a lone surrogate in an id is escaped, never an unencodable row
    assert json.loads(text) == tunnel(peer_id, sec + nsec / 1e9, rx, tx)
