"""Envelope parsing keeps the raw payload; canonical bytes are Go's re-marshalling (docs/protocol.md §3)."""

import base64
import json

import nacl.signing
import pytest

from plexd.base.errors import WireFormatError
from plexd.controlplane.envelope import Envelope, canonical_bytes, parse_envelope, sign_event


def test_canonical_bytes_built_by_hand():
    raw = '{ "b": 2, "a": "x<y>&z" }'
    got = canonical_bytes("peer_added", "evt_1", "2025-01-15T10:30:00.500+00:00", "n1", raw)
    assert got == (
        b'{"event_type":"peer_added","event_id":"evt_1","issued_at":"2025-01-15T10:30:00.5Z","nonce":"n1",'
        b'"payload":{"b":2,"a":"x\\u003cy\\u003e\\u0026z"}}'
    )


def test_missing_payload_signs_null():
    assert canonical_bytes("t", "e", "2025-01-15T10:30:00Z", "n", "").endswith(b'"payload":null}')


def test_sign_and_verify_round_trip_with_raw_payload():
    key = nacl.signing.SigningKey.generate()
    text = sign_event(key, "policy_updated", "evt_9", None, payload_raw='{"z":1,  "a":[ 1 ]}',
                      issued_at="2025-01-15T10:30:00.250000Z", nonce="abc")
    env = parse_envelope(text)
    assert env.payload_raw == '{"z":1,  "a":[ 1 ]}'
    assert env.payload() == {"z": 1, "a": [1]}
    key.verify_key.verify(env.canonical_bytes(), base64.b64decode(env.signature))


def test_case_insensitive_keys_and_last_duplicate_wins_like_go():
    env = parse_envelope('{"Event_Type":"a","event_id":"1","payload":{"x":1},"payload":{"y":2}}')
    assert env.event_type == "a"
    assert json.loads(env.payload_raw) == {"y": 2}


@pytest.mark.parametrize(
    ("data", "field"),
    [("{}", "event_type"), ('{"event_type":"x"}', "event_id"), ('{"event_type":1,"event_id":"e"}', "event_type"),
     ('{"event_type":"x","event_id":"e","issued_at":"never"}', "issued_at"), ("[1]", ""), ("{", ""),
     ('{"event_type":"x","event_id":"e"} trailing', "")],
)
def test_bad_envelopes_name_the_problem(data, field):
    with pytest.raises(WireFormatError) as info:
        parse_envelope(data)
    assert info.value.path == field


def test_the_payload_is_parsed_once_and_a_bad_one_fails_each_time():
    env = parse_envelope('{"event_type":"a","event_id":"1","payload":{"x":[1,2]}}')
    assert env.payload() is env.payload() and env.payload() == {"x": [1, 2]}
    bad = Envelope("a", "1", "", "", '{"x": [1, 2', "")  # not JSON (parse_envelope would not let it through)
    for _ in range(2):
        with pytest.raises(WireFormatError, match="payload"):
            bad.payload()
