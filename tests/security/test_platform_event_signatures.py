"""The platform dialect's signed events (docs/platform-dialect.md): an envelope names its key by `key_id`, carries no
nonce, and only asks for a state pull, but for the key events. Forgeries, events for a key this node does not hold
or no longer trusts, malformed envelopes and replays of an id are refused one by one, logged, and the stream goes
on; the window's refusals are held for this node's clock as in the spec dialect.

Real parts: Ed25519-signed envelopes (`platform_envelope.sign_event`), the real stream's per-frame path
(`EventStream.handle_frame`) in the platform dialect, the real EventHandlers (a pull, a key rotation, recorded at
their callbacks), the SQLite ledger and the key files in a data_dir, reopened for a restart."""

from __future__ import annotations

import base64
import json
import logging
from datetime import UTC, datetime, timedelta

import nacl.signing
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nacl.public import PrivateKey

from plexd.base.clock import FakeClock
from plexd.base.errors import WireFormatError
from plexd.base.gojson import format_time
from plexd.controlplane.event_dialects import ASKING_FOR_A_PULL, PULL, platform_events
from plexd.controlplane.event_signing import EventRejected, NonceStore, Verifier, load_signing_key
from plexd.controlplane.event_stream import EventStream
from plexd.controlplane.ledger import EventLedger
from plexd.controlplane.platform_envelope import parse_envelope, sign_event
from plexd.controlplane.platform_signing import KEY_ID_FILE
from plexd.controlplane.sse import SSEEvent
from plexd.services.event_handlers import EventHandlers
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore
from plexd.state.model import SigningKeys

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
OLD, NEW, STRANGER = (nacl.signing.SigningKey.generate() for _ in range(3))
OLD_ID, NEW_ID = "did:web:cp.test#key-2026-04", "did:web:cp.test#key-2026-11"


def public(key: nacl.signing.SigningKey) -> str:
    return base64.b64encode(bytes(key.verify_key)).decode()


def frame(seq: int, event_type: str = "node_state_updated", payload=None, *, key=OLD, key_id=OLD_ID,
          issued: datetime = NOW, event_id: str | None = None, scope: str = "node:n_1") -> SSEEvent:
    data = sign_event(key, event_id or f"evt-{seq}", event_type, {"revision": seq} if payload is None else payload,
                      key_id=key_id, scope=scope, issued_at=format_time(issued))
    return SSEEvent(data=data, id=str(seq), event=event_type)


def rotation(seq: int, key=NEW, key_id=NEW_ID, previous_id=OLD_ID, expires: datetime | None = NOW + timedelta(hours=1),
             signer=OLD) -> SSEEvent:
    """`signing_key_rotated` to `key`, signed (as the platform does) by the key it replaces."""
    payload = {"key_id": key_id, "public_key": public(key), "previous_key_id": previous_id,
               "transition_expires": format_time(expires) if expires else ""}
    return frame(seq, "signing_key_rotated", payload, key=signer)


class Node:
    """The event path of one platform node over `data_dir`: the stream, its keys, the handlers' callbacks."""

    def __init__(self, data_dir, clock: FakeClock) -> None:
        self.data_dir = data_dir
        self.refreshes: list[str] = []
        self.rotations: list[str] = []
        self.ledger = EventLedger(data_dir / "events.db")
        key = load_signing_key(data_dir) or public(OLD)  # as the daemon builds it: the file wins
        self.verifier = Verifier(SigningKeys(current=key), NonceStore(clock, self.ledger), clock)
        store = DesiredStore(DesiredState.initial(
            interface="plexd0", listen_port=51820, mtu=1420,
            private_key=base64.b64encode(bytes(PrivateKey.generate())).decode(), mesh_ip="10.100.0.1"))
        handlers = EventHandlers(store, lambda why: None, lambda why: None, self.verifier, data_dir,
                                 rotate_keys=self.rotations.append, refresh_state=self.refreshes.append)
        self.stream = EventStream("http://cp.invalid", "n_1", lambda: "t", self.ledger, self.verifier,
                                  handlers.dispatch, clock=clock, dialect="platform",
                                  platform=platform_events(self.verifier, data_dir, lambda: (public(OLD), OLD_ID),
                                                           lambda: "n_1"))

    async def deliver(self, f: SSEEvent) -> bool:
        """True when the event was accepted."""
        before = self.stream.accepted
        await self.stream.handle_frame(f)
        return self.stream.accepted > before

    def rejected(self, reason: str) -> int:
        return self.stream.rejected_by_reason[reason]


@pytest.fixture
def clock():
    return FakeClock(NOW)


@pytest.fixture
def node(tmp_path, clock):
    return Node(tmp_path, clock)


@pytest.mark.parametrize("event_type", sorted(ASKING_FOR_A_PULL))
async def test_every_known_event_asks_for_one_state_pull(node, event_type):
    assert await node.deliver(frame(1, event_type))
    assert node.refreshes == [PULL] and node.rotations == []
    assert node.stream.last_event_id == "1"  # the frame's sequence, not the envelope's id


async def test_rotate_keys_reaches_the_key_rotation(node):
    assert await node.deliver(frame(1, "rotate_keys", {"node_id": "n_1"}))
    assert len(node.rotations) == 1 and "evt-1" in node.rotations[0] and node.refreshes == []


async def test_an_unknown_type_is_dropped_without_a_word_above_debug(node, caplog):
    caplog.set_level(logging.DEBUG)
    assert await node.deliver(frame(1, "workload.quota_changed"))
    assert node.refreshes == [] and node.rotations == [] and node.stream.rejected == 0
    assert [r.levelno for r in caplog.records if "workload.quota_changed" in r.getMessage()] == [logging.DEBUG]


@pytest.mark.parametrize(("forged", "reason"), [
    (frame(1, key=STRANGER), "bad_signature"),
    (frame(1, key_id="did:web:cp.test#key-unknown"), "unknown_key_id"),
    (frame(1, key=STRANGER, key_id="did:web:cp.test#key-unknown"), "unknown_key_id"),
    (frame(1, key_id=""), "missing_key_id"),
    (frame(1, key=NEW, key_id=NEW_ID), "unknown_key_id"),  # a key this node was never told of
], ids=["another key", "unknown key_id", "stranger naming an unknown key", "no key_id", "key not yet rotated in"])
async def test_forgeries_and_unknown_keys_are_refused_and_the_stream_goes_on(node, forged, reason, caplog):
    assert not await node.deliver(forged)
    assert node.rejected(reason) == 1 and node.refreshes == []
    assert f"event evt-1 (node_state_updated) rejected [{reason}]" in caplog.text
    assert await node.deliver(frame(2))  # the next genuine event
    assert node.refreshes == [PULL] and node.stream.last_event_id == "2"


async def test_an_event_scoped_to_another_node_is_refused_though_genuinely_signed(node, caplog):
    # The spec dialect refuses another node's target; a platform envelope names its node in its scope
    assert not await node.deliver(frame(1, scope="node:n_2"))
    assert node.rejected("wrong_scope") == 1 and node.refreshes == []
    assert "scoped to 'node:n_2', not to this node" in caplog.text
    for seq, scope in ((2, "node:n_1"), (3, ""), (4, "project:p_1")):  # its own, none, the project's: the stream's
        assert await node.deliver(frame(seq, scope=scope)), scope
    assert node.refreshes == [PULL] * 3


def test_a_scope_names_this_node_in_any_spelling_of_its_uuid(node, tmp_path):
    own = "0190f3a2-7c4b-7d1e-9a2b-3c4d5e6f7a8b"
    events = platform_events(node.verifier, tmp_path, lambda: (public(OLD), OLD_ID), lambda: own)
    for scope in (f"node:{own}", f"node:{own.upper()}", "node:{" + own + "}", "node:" + own.replace("-", "")):
        events.verify(parse_envelope(frame(1, scope=scope).data))  # raises when refused
    with pytest.raises(EventRejected, match="not to this node"):
        events.verify(parse_envelope(frame(1, scope="node:0190f3a2-7c4b-7d1e-9a2b-3c4d5e6f7a8c").data))


def _tampered(f: SSEEvent, old: str, new: str) -> SSEEvent:
    assert old in f.data
    return SSEEvent(data=f.data.replace(old, new), id=f.id)


@pytest.mark.parametrize(("edit", "reason"), [
    (("node_state_updated", "rotate_keys"), "bad_signature"),  # the type is signed
    (('"scope":"node:n_1"', '"scope":"node:n_2"'), "bad_signature"),  # so is the scope
    (('"revision":1', '"revision":2'), "bad_signature"),  # and the payload
    (('"signature":"', '"signature":"!'), "bad_signature_encoding"),
], ids=["type", "scope", "payload", "signature encoding"])
async def test_every_signed_field_is_covered(node, edit, reason):
    assert not await node.deliver(_tampered(frame(1), *edit))
    assert node.rejected(reason) == 1 and node.refreshes == [] and node.rotations == []


async def test_the_checks_run_in_the_contracts_order(node):
    no_signature = parse_envelope(frame(1).data)
    data = frame(1, issued=NOW - timedelta(minutes=6), key=STRANGER).data
    stale_forgery = SSEEvent(data=data, id="1")
    assert not await node.deliver(SSEEvent(data=frame(1).data.replace(no_signature.signature, ""), id="1"))
    assert not await node.deliver(stale_forgery)
    assert not await node.deliver(SSEEvent(data=frame(2).data.replace(format_time(NOW), ""), id="2"))
    assert (node.rejected("missing_signature"), node.rejected("stale"), node.rejected("missing_issued_at")) == (1, 1, 1)
    assert len(node.stream.clock_hold) == 0  # the stale forgery is refused by the window, and is not held


@pytest.mark.parametrize("data", ["{not json", '{"type":"node_state_updated"}', '{"id":"e","type":"Bad Type"}',
                                  '{"id":"e","type":"x","issued_at":"yesterday"}', "[]", '{"id":7,"type":"x"}'],
                         ids=["not JSON", "no id", "bad type", "bad issued_at", "not an object", "numeric id"])
async def test_a_malformed_envelope_is_skipped_and_its_frame_id_still_moves_the_cursor(node, data):
    assert not await node.deliver(SSEEvent(data=data, id="5"))
    assert node.rejected("malformed") == 1
    assert node.stream.last_event_id == "5"  # a poison frame is never replayed to us in a loop
    assert await node.deliver(frame(6))


async def test_a_spec_envelope_is_malformed_here(node):
    from plexd.controlplane.envelope import sign_event as sign_spec

    spec = sign_spec(OLD, "policy_updated", "evt-1", None, issued_at=format_time(NOW))
    assert not await node.deliver(SSEEvent(data=spec, id="1"))
    assert node.rejected("malformed") == 1 and node.refreshes == []


async def test_a_duplicate_id_is_dropped_and_no_nonce_is_kept(node, clock):
    assert await node.deliver(frame(1))
    assert not await node.deliver(frame(2, event_id="evt-1"))  # the same envelope id under another frame
    assert node.refreshes == [PULL] and node.stream.rejected == 0
    node.ledger.commit(clock.now().timestamp())
    assert node.ledger.stored() == ("2", set())  # the cursor moved; no nonce store in this dialect


@pytest.mark.parametrize("step", [3600.0, -3600.0], ids=["clock ahead", "clock behind"])
async def test_stale_and_future_events_are_held_until_the_clock_agrees(node, clock, step):
    clock.step_wall(step)
    assert not await node.deliver(frame(1))
    assert not await node.deliver(frame(2))
    assert not await node.deliver(frame(2, event_id="evt-1"))  # refused again, but one id is held once
    assert node.rejected("stale" if step > 0 else "future") == 3
    assert node.stream.status()["events_held_for_clock"] == 2 and node.refreshes == []
    clock.step_wall(-step + 20)
    await node.stream.retry_held()
    assert node.refreshes == [PULL, PULL] and len(node.stream.clock_hold) == 0


async def test_exactly_five_minutes_either_way_is_still_accepted(node):
    assert await node.deliver(frame(1, issued=NOW - timedelta(minutes=5)))
    assert await node.deliver(frame(2, issued=NOW + timedelta(minutes=5)))
    assert not await node.deliver(frame(3, issued=NOW - timedelta(minutes=5, seconds=1)))


async def test_a_rotated_key_is_installed_persisted_and_kept_across_a_restart(node, tmp_path, clock):
    assert await node.deliver(rotation(1))
    assert node.verifier.keys.current == public(NEW) and load_signing_key(tmp_path) == public(NEW)
    assert (tmp_path / KEY_ID_FILE).stat().st_mode & 0o777 == 0o600
    assert await node.deliver(frame(2, key=NEW, key_id=NEW_ID))
    assert await node.deliver(frame(3))  # signed with the previous key, inside its transition
    assert not await node.deliver(frame(4, key=OLD, key_id=NEW_ID))
    assert node.rejected("bad_signature") == 1
    node.ledger.close(clock.now().timestamp())

    restarted = Node(tmp_path, clock)  # a new daemon on the same data_dir; the registration named the old key
    assert restarted.verifier.keys.current == public(NEW)
    assert await restarted.deliver(frame(5, key=NEW, key_id=NEW_ID))
    assert not await restarted.deliver(frame(6))  # the previous key is not kept across a restart (as in spec)
    assert restarted.rejected("unknown_key_id") == 1


async def test_the_previous_key_is_refused_after_its_transition(node, clock):
    assert await node.deliver(rotation(1, expires=NOW + timedelta(minutes=2)))
    assert await node.deliver(frame(2))
    clock.advance(121)
    assert not await node.deliver(frame(3, issued=clock.now()))
    assert node.rejected("key_expired") == 1
    assert await node.deliver(frame(4, key=NEW, key_id=NEW_ID, issued=clock.now()))


@pytest.mark.parametrize(("previous_id", "expires"), [
    ("", NOW + timedelta(hours=1)),
    ("did:web:cp.test#key-1999", NOW + timedelta(hours=1)),
    (OLD_ID, None),
    (OLD_ID, datetime(1, 1, 1, tzinfo=UTC)),
], ids=["no previous_key_id", "a key id not held", "no transition_expires", "zero transition_expires"])
async def test_the_previous_key_is_kept_only_when_named_and_bounded(node, previous_id, expires):
    assert await node.deliver(rotation(1, previous_id=previous_id, expires=expires))
    assert node.verifier.keys.current == public(NEW) and node.verifier.keys.previous == ""
    assert not await node.deliver(frame(2))
    assert node.rejected("unknown_key_id") == 1


@pytest.mark.parametrize(("payload_edit", "reason"), [
    ({"key_id": ""}, "bad_payload"),
    ({"public_key": base64.b64encode(b"k" * 31).decode()}, "bad_payload"),
    ({"public_key": "not base64"}, "bad_payload"),
    ({"key_id": 7}, "bad_payload"),
    ({"transition_expires": "soon"}, "bad_payload"),
], ids=["empty key_id", "31-byte key", "not base64", "numeric key_id", "bad transition_expires"])
async def test_an_unusable_rotation_is_refused_and_changes_nothing(node, tmp_path, payload_edit, reason):
    payload = {"key_id": NEW_ID, "public_key": public(NEW), "previous_key_id": OLD_ID,
               "transition_expires": format_time(NOW + timedelta(hours=1)), **payload_edit}
    assert not await node.deliver(frame(1, "signing_key_rotated", payload))
    assert node.rejected(reason) == 1
    assert node.verifier.keys.current == public(OLD) and load_signing_key(tmp_path) is None
    assert not (tmp_path / KEY_ID_FILE).exists()
    assert await node.deliver(frame(2))


async def test_a_rotation_signed_by_a_stranger_installs_nothing(node, tmp_path):
    assert not await node.deliver(rotation(1, key=STRANGER, signer=STRANGER))
    assert node.rejected("bad_signature") == 1 and node.verifier.keys.current == public(OLD)
    assert load_signing_key(tmp_path) is None and not (tmp_path / KEY_ID_FILE).exists()


async def test_a_broken_key_id_file_falls_back_to_the_registration(tmp_path, clock, caplog):
    (tmp_path / KEY_ID_FILE).write_text("[[[")
    node = Node(tmp_path, clock)
    assert await node.deliver(frame(1))
    assert f"ignoring {tmp_path / KEY_ID_FILE}" in caplog.text


# -- the parser, fuzzed ----------------------------------------------------------------------------------------

_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), _text),
                       lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
                       max_leaves=12)
_fields = st.sampled_from(["id", "type", "scope", "key_id", "issued_at", "payload", "signature", "ID", "Type"])
_envelopes = st.dictionaries(_fields, st.one_of(_values, st.sampled_from(
    ["evt-1", "node_state_updated", "2026-11-25T12:00:00Z", "did:web:x#k", "", "a.b_c"])), max_size=8)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200), _envelopes.map(json.dumps),
                 st.sampled_from(["[" * 5000, '{"id":' * 3000, '{"id":"\\ud800","type":"x"}', "{}" * 3])))
def test_the_envelope_parser_is_total_and_bounded(text):
    try:
        env = parse_envelope(text)
    except WireFormatError:
        return
    assert env.id and env.type and len(env.key_id) <= 4096 and len(env.signature) <= 4096
    if env.issued_at:  # an envelope without one is refused before its signature is looked at
        env.canonical_bytes()
