"""Event verification (docs/protocol.md §3): Go canonical bytes, order of checks, key transition, nonces."""

from __future__ import annotations

import base64
import json
import os
from datetime import UTC, datetime, timedelta

import nacl.signing
import pytest

from plexd.base.clock import FakeClock
from plexd.controlplane.envelope import parse_envelope, sign_event
from plexd.controlplane.event_signing import (
    EventRejected,
    InvalidSigningKeys,
    NonceStore,
    NonceStoreFull,
    Verifier,
    load_signing_key,
    persist_signing_key,
)
from plexd.state.model import SigningKeys

NOW = datetime(2025, 1, 15, 10, 30, tzinfo=UTC)


def b64(key: nacl.signing.SigningKey) -> str:
    return base64.b64encode(bytes(key.verify_key)).decode()


@pytest.fixture
def clock():
    return FakeClock(NOW)


@pytest.fixture
def key():
    return nacl.signing.SigningKey.generate()


@pytest.fixture
def verifier(clock, key):
    return Verifier(SigningKeys(current=b64(key)), NonceStore(clock), clock)


def signed(key, *, event_id="evt_1", issued_at="2025-01-15T10:30:00Z", nonce="n-1", payload_raw='{"id":"n_a"}',
           event_type="peer_added"):
    return parse_envelope(sign_event(key, event_type, event_id, None, payload_raw=payload_raw,
                                     issued_at=issued_at, nonce=nonce))


def envelope_signed_over(key, wire_text: str, go_bytes: bytes) -> str:
    """Attach a signature over `go_bytes` (what the Go agent re-marshals) to an envelope written as `wire_text`."""
    sig = base64.b64encode(key.sign(go_bytes).signature).decode()
    return wire_text[:-1] + f',"signature":"{sig}"}}'


# --- Go canonical bytes ---------------------------------------------------------------------------------------


def test_go_canonical_bytes_unsorted_keys_html_escapes_fraction_and_offset(clock, key, verifier):
    # Wire text as a Go control plane might write it: spaces, payload keys unsorted, <>& raw, .500000000 fraction,
    # a +02:00 offset. The Go agent signs its own re-marshalling of it, spelled out here byte for byte.
    wire = ('{"event_type": "peer_added", "event_id": "evt_x", "issued_at": "2025-01-15T12:29:00.500000000+02:00",'
            ' "nonce": "nz", "payload": { "z": 1, "a": "x<y>&z", "m": [ 1 , 2 ] }}')
    go_bytes = (b'{"event_type":"peer_added","event_id":"evt_x","issued_at":"2025-01-15T12:29:00.5+02:00",'
                b'"nonce":"nz","payload":{"z":1,"a":"x\\u003cy\\u003e\\u0026z","m":[1,2]}}')
    env = parse_envelope(envelope_signed_over(key, wire, go_bytes))
    assert env.canonical_bytes() == go_bytes
    verifier.verify(env)


def test_signature_over_sorted_keys_is_rejected(key, verifier):
    wire = '{"event_type":"t","event_id":"e","issued_at":"2025-01-15T10:30:00Z","nonce":"n","payload":{"b":2,"a":1}}'
    sorted_bytes = (b'{"event_type":"t","event_id":"e","issued_at":"2025-01-15T10:30:00Z","nonce":"n",'
                    b'"payload":' + json.dumps({"b": 2, "a": 1}, sort_keys=True, separators=(",", ":")).encode()
                    + b"}")
    env = parse_envelope(envelope_signed_over(key, wire, sorted_bytes))
    with pytest.raises(EventRejected) as info:
        verifier.verify(env)
    assert info.value.reason == "bad_signature"


def test_utc_offset_zero_and_trailing_zeros_are_normalised(key, verifier):
    wire = '{"event_type":"t","event_id":"e","issued_at":"2025-01-15T10:30:00.000+00:00","nonce":"n","payload":null}'
    go = b'{"event_type":"t","event_id":"e","issued_at":"2025-01-15T10:30:00Z","nonce":"n","payload":null}'
    verifier.verify(parse_envelope(envelope_signed_over(key, wire, go)))


# --- every rejection, in order ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "reason"), [("signature", "missing_signature"), ("nonce", "missing_nonce"),
                                               ("issued_at", "missing_issued_at")])
def test_presence(key, verifier, field, reason):
    doc = json.loads(sign_event(key, "t", "e", {}, issued_at="2025-01-15T10:30:00Z", nonce="n"))
    doc[field] = ""
    with pytest.raises(EventRejected) as info:
        verifier.verify(parse_envelope(json.dumps(doc)))
    assert info.value.reason == reason


def test_go_zero_time_counts_as_missing(key, verifier):
    with pytest.raises(EventRejected) as info:
        verifier.verify(signed(key, issued_at="0001-01-01T00:00:00Z"))
    assert info.value.reason == "missing_issued_at"


def test_window_exactly_five_minutes_is_accepted_both_ways(key, verifier):
    verifier.verify(signed(key, issued_at="2025-01-15T10:25:00Z", nonce="old"))
    verifier.verify(signed(key, issued_at="2025-01-15T10:35:00Z", nonce="new"))


def test_stale_and_future_rejected(key, verifier):
    with pytest.raises(EventRejected) as info:
        verifier.verify(signed(key, issued_at="2025-01-15T10:24:59.999Z"))
    assert info.value.reason == "stale"
    with pytest.raises(EventRejected) as info:
        verifier.verify(signed(key, issued_at="2025-01-15T10:35:00.001Z"))
    assert info.value.reason == "future"


def test_window_checked_before_signature(verifier):
    forged = signed(nacl.signing.SigningKey.generate(), issued_at="2025-01-15T09:00:00Z")
    with pytest.raises(EventRejected) as info:
        verifier.verify(forged)
    assert info.value.reason == "stale"


def test_bad_base64_signature(key, verifier):
    doc = json.loads(sign_event(key, "t", "e", {}, issued_at="2025-01-15T10:30:00Z", nonce="n"))
    doc["signature"] = "not base64!!"
    with pytest.raises(EventRejected) as info:
        verifier.verify(parse_envelope(json.dumps(doc)))
    assert info.value.reason == "bad_signature_encoding"


def test_tampered_payload_fails(key, verifier):
    doc = json.loads(sign_event(key, "t", "e", {"id": "a"}, issued_at="2025-01-15T10:30:00Z", nonce="n"))
    doc["payload"] = {"id": "b"}
    with pytest.raises(EventRejected) as info:
        verifier.verify(parse_envelope(json.dumps(doc)))
    assert info.value.reason == "bad_signature"


def test_forged_event_does_not_consume_the_nonce(key, verifier):
    with pytest.raises(EventRejected):
        verifier.verify(signed(nacl.signing.SigningKey.generate(), nonce="shared"))
    verifier.verify(signed(key, nonce="shared"))  # the genuine event with the same nonce still passes
    with pytest.raises(EventRejected) as info:
        verifier.verify(signed(key, nonce="shared", event_id="evt_2"))
    assert info.value.reason == "duplicate_nonce"


def test_no_key_known(clock, key):
    v = Verifier(None, NonceStore(clock), clock)
    with pytest.raises(EventRejected) as info:
        v.verify(signed(key))
    assert info.value.reason == "no_signing_key"


# --- key transition --------------------------------------------------------------------------------------------


def test_previous_key_only_while_transition_lasts(clock, key):
    new = nacl.signing.SigningKey.generate()
    expires = "2025-01-15T10:31:00Z"
    v = Verifier(SigningKeys(current=b64(new), previous=b64(key), transition_expires=expires), NonceStore(clock),
                 clock)
    v.verify(signed(key, nonce="a"))  # previous key, inside the transition
    v.verify(signed(new, nonce="b"))
    clock.advance(60)  # now == transition_expires: no longer "now < expires"
    with pytest.raises(EventRejected) as info:
        v.verify(signed(key, nonce="c", issued_at="2025-01-15T10:31:00Z"))
    assert info.value.reason == "bad_signature"
    v.verify(signed(new, nonce="d", issued_at="2025-01-15T10:31:00Z"))


def test_previous_key_without_transition_expiry_is_never_accepted(clock, key):
    new = nacl.signing.SigningKey.generate()
    v = Verifier(SigningKeys(current=b64(new), previous=b64(key)), NonceStore(clock), clock)
    with pytest.raises(EventRejected):
        v.verify(signed(key))


@pytest.mark.parametrize("keys", [
    SigningKeys(current=""),
    SigningKeys(current="AAAA"),  # 3 bytes
    SigningKeys(current=base64.b64encode(os.urandom(33)).decode()),
    SigningKeys(current="%%%notbase64"),
    SigningKeys(current=base64.b64encode(os.urandom(32)).decode(), previous="AAAA",
                transition_expires="2025-02-01T00:00:00Z"),
    SigningKeys(current=base64.b64encode(os.urandom(32)).decode(), transition_expires="tomorrow"),
])
def test_invalid_key_updates_are_refused_and_old_keys_kept(clock, key, verifier, keys):
    with pytest.raises(InvalidSigningKeys):
        verifier.set_keys(keys)
    verifier.verify(signed(key))  # still verifying with the old key


def test_set_keys_reports_change_and_callback(clock, key):
    seen = []
    v = Verifier(None, NonceStore(clock), clock, on_keys_changed=seen.append)
    assert v.set_keys(SigningKeys(current=b64(key))) is True
    assert v.set_keys(SigningKeys(current=b64(key))) is False
    assert len(seen) == 1


# --- nonce store -------------------------------------------------------------------------------------------------


def test_nonce_ttl_from_issued_at(clock):
    store = NonceStore(clock)
    assert store.add("a", NOW - timedelta(minutes=4))
    assert not store.add("a", NOW)
    clock.advance(61 + 0.001)
    store.add("b", NOW)  # triggers expiry: "a" was issued 5 min 1 s ago
    assert "a" not in store and "b" in store


def test_nonce_store_refuses_when_full_and_forgets_nothing(clock):
    store = NonceStore(clock, max_entries=3)
    for i in range(3):
        assert store.add(f"n{i}", NOW + timedelta(seconds=i))
    with pytest.raises(NonceStoreFull):
        store.add("n3", NOW + timedelta(seconds=3))
    assert len(store) == 3 and "n0" in store and "n3" not in store
    assert not store.add("n0", NOW)  # still a replay
    clock.advance(300 + 1)  # n0 expires: room for one
    assert store.add("n3", NOW + timedelta(seconds=301))
    assert "n0" not in store and store.refused_full == 1


# --- signing key persistence ---------------------------------------------------------------------------------


def test_persist_signing_key(tmp_path, key):
    persist_signing_key(tmp_path, b64(key))
    path = tmp_path / "signing_public_key"
    assert path.read_text() == b64(key)  # raw base64, no newline
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert load_signing_key(tmp_path) == b64(key)
    assert not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(InvalidSigningKeys):
        persist_signing_key(tmp_path, "AAAA")
    assert path.read_text() == b64(key)


# --- binding to the addressed nodes ----------------------------------------------------------------------------


def test_an_event_bound_to_other_nodes_is_refused_before_its_nonce_is_taken(clock, key):
    store = NonceStore(clock)
    for_b = Verifier(SigningKeys(current=b64(key)), store, clock, node_id=lambda: "n_b")
    env = signed(key, payload_raw='{"id":"n_x","target_node_ids":["n_a","n_c"]}', nonce="bound-1")
    with pytest.raises(EventRejected, match=r"addressed to n_a, n_c, not to this node n_b") as info:
        for_b.verify(env)
    assert info.value.reason == "wrong_node"
    for_a = Verifier(SigningKeys(current=b64(key)), store, clock, node_id=lambda: "n_a")
    for_a.verify(env)  # the nonce was not spent by the refusal
    # no binding (the Go control plane), or nothing to bind to: accepted as before
    for_b.verify(signed(key, payload_raw='{"id":"n_x"}', nonce="free-1"))
    for_b.verify(signed(key, payload_raw='[{"target_node_ids":["n_a"]}]', nonce="free-2"))
    with pytest.raises(EventRejected, match="not a list of node ids"):
        for_b.verify(signed(key, payload_raw='{"target_node_ids":"n_b"}', nonce="bad-1"))


def test_the_binding_is_inside_the_signature(clock, key):
    """Rewriting the target list to name another node breaks the signature: it cannot be moved."""
    text = sign_event(key, "peer_added", "evt_9", {"id": "n_x", "target_node_ids": ["n_a"]},
                      issued_at="2025-01-15T10:30:00Z", nonce="moved-1")
    moved = parse_envelope(text.replace('"target_node_ids":["n_a"]', '"target_node_ids":["n_b"]'))
    with pytest.raises(EventRejected, match="signature verification failed"):
        Verifier(SigningKeys(current=b64(key)), NonceStore(clock), clock, node_id=lambda: "n_b").verify(moved)
