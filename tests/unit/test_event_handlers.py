"""Event handlers edit the real DesiredState and request a converge; bad payloads are refused with the field."""

from __future__ import annotations

import base64
import logging
import os

import nacl.signing
import pytest
from nacl.public import PrivateKey

from plexd.base.clock import FakeClock
from plexd.base.errors import WireFormatError
from plexd.controlplane.envelope import parse_envelope, sign_event
from plexd.controlplane.event_signing import InvalidSigningKeys, NonceStore, Verifier
from plexd.services.event_handlers import EventHandlers
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore
from plexd.state.model import Peer, SigningKeys, State


def wgkey() -> str:
    return base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()


SIGNER = nacl.signing.SigningKey.generate()


def env(event_type, payload=None, payload_raw=None, event_id="evt_1"):
    return parse_envelope(sign_event(SIGNER, event_type, event_id, payload, payload_raw=payload_raw))


class Harness:
    def __init__(self, tmp_path):
        self.store = DesiredStore(DesiredState.initial(
            interface="plexd0", listen_port=51820, mtu=1420,
            private_key=base64.b64encode(bytes(PrivateKey.generate())).decode(), mesh_ip="10.100.0.1"))
        self.converges = []
        self.reconciles = []
        clock = FakeClock()
        self.verifier = Verifier(SigningKeys(current=base64.b64encode(bytes(SIGNER.verify_key)).decode()),
                                 NonceStore(clock), clock)
        self.rotations = []
        self.refreshes = []
        self.stale = []  # why the next reconcile must pull (an event whose change did not reach the model)
        self.handlers = EventHandlers(self.store, self.converges.append, self.reconciles.append, self.verifier,
                                      tmp_path, rotate_keys=self.rotations.append,
                                      refresh_state=self.refreshes.append, stale=self.stale.append)

    @property
    def desired(self):
        return self.store.value


@pytest.fixture
def h(tmp_path):
    return Harness(tmp_path)


async def test_peer_lifecycle(h):
    key = wgkey()
    await h.handlers.dispatch(env("peer_added", {"id": "n_a", "public_key": key, "mesh_ip": "10.100.0.2",
                                                 "endpoint": "192.0.2.1:51820", "allowed_ips": ["10.100.0.2/32"]}))
    assert h.desired.peers["n_a"].public_key == key
    await h.handlers.dispatch(env("peer_endpoint_changed", {"id": "n_a", "endpoint": "192.0.2.9:51820"}))
    assert h.desired.peers["n_a"].endpoint == "192.0.2.9:51820"
    new = wgkey()
    await h.handlers.dispatch(env("peer_key_rotated", {"id": "n_a", "public_key": new, "mesh_ip": "10.100.0.2",
                                                       "allowed_ips": ["10.100.0.2/32"]}))
    assert h.desired.peers["n_a"].public_key == new
    await h.handlers.dispatch(env("peer_removed", {"peer_id": "n_a"}))
    assert "n_a" not in h.desired.peers
    assert len(h.converges) == 4 and h.converges[0].startswith("peer_added evt_1")


async def test_policy_updated_refreshes_the_state_and_rotate_keys_starts_a_key_rotation(h):
    await h.handlers.dispatch(env("policy_updated"))
    await h.handlers.dispatch(env("rotate_keys", {}))
    assert h.refreshes == ["policy_updated"] and h.reconciles == []  # pulled and applied as events, not in full
    assert len(h.rotations) == 1 and h.rotations[0].startswith("event evt_")
    assert h.converges == []


async def test_signing_key_rotated_updates_verifier_desired_and_disk(h, tmp_path):
    new = nacl.signing.SigningKey.generate()
    new_b64 = base64.b64encode(bytes(new.verify_key)).decode()
    old_b64 = h.verifier.keys.current
    await h.handlers.dispatch(env("signing_key_rotated", {"current": new_b64, "previous": old_b64,
                                                          "transition_expires": "2999-01-01T00:00:00Z"}))
    assert h.verifier.keys.current == new_b64
    assert h.desired.signing_keys.current == new_b64
    assert (tmp_path / "signing_public_key").read_text() == new_b64


async def test_short_signing_key_refused_and_old_one_kept(h, tmp_path):
    old = h.verifier.keys.current
    with pytest.raises(InvalidSigningKeys):
        await h.handlers.dispatch(env("signing_key_rotated", {"current": base64.b64encode(os.urandom(16)).decode()}))
    assert h.verifier.keys.current == old
    assert not (tmp_path / "signing_public_key").exists()


async def test_node_state_and_secrets(h):
    await h.handlers.dispatch(env("node_state_updated", {"metadata": {"env": "prod"}, "data": [
        {"key": "db", "content_type": "application/json", "payload": {"h": 1}, "version": 3}]}))
    assert h.desired.metadata == {"env": "prod"} and h.desired.data[0].version == 3
    await h.handlers.dispatch(env("node_secrets_updated", {"secret_refs": [{"key": "tls", "version": 2}]}))
    assert h.desired.secret_refs[0].key == "tls"


@pytest.mark.parametrize(("event_type", "payload", "field"), [
    ("peer_added", [1, 2], "payload"),
    ("peer_added", {"id": "n_a", "public_key": 5}, "payload.public_key"),
    ("peer_added", {"public_key": "x"}, "payload.id"),
    ("peer_added", {"id": "n_a"}, "payload.public_key"),
    ("peer_removed", {}, "payload.peer_id"),
    ("peer_endpoint_changed", {"id": "n_a"}, "payload.endpoint"),
    # a malformed endpoint: applied, the peer failed validation and left the model (its route and tunnel gone)
    ("peer_endpoint_changed", {"id": "n_a", "endpoint": "198.51.100.9"}, "payload.endpoint"),
    ("peer_endpoint_changed", {"id": "n_a", "endpoint": ":0"}, "payload.endpoint"),
    ("peer_endpoint_changed", {"id": "n_a", "endpoint": "[::1]:x"}, "payload.endpoint"),
    ("node_state_updated", {"metadata": {"a": True}}, "payload.metadata"),
    ("node_secrets_updated", {"secret_refs": {"k": 1}}, "payload.secret_refs"),
    ("signing_key_rotated", "key", "payload"),
])
async def test_wrong_payload_shape_names_the_field(h, event_type, payload, field):
    before = h.desired
    with pytest.raises(WireFormatError) as info:
        await h.handlers.dispatch(env(event_type, payload))
    assert info.value.path == field
    assert h.desired is before


async def test_unsupported_and_unknown_types(h, caplog):
    caplog.set_level(logging.DEBUG, "plexd.services.event_handlers")
    await h.handlers.dispatch(env("action_request", {"execution_id": "x"}, event_id="evt_a"))
    await h.handlers.dispatch(env("from_the_future", {}, event_id="evt_u"))
    assert "event evt_a (action_request) ignored: not supported" in caplog.text
    assert any(r.levelno == logging.DEBUG and "evt_u" in r.getMessage() for r in caplog.records)
    # whatever they said is in the state: the next reconcile pulls it
    assert h.stale == ["event action_request ignored", "event of unknown type 'from_the_future'"]
    seen = []
    async def handler(e):
        seen.append(e.event_id)

    h.handlers.register("action_request", handler)
    await h.handlers.dispatch(env("action_request", {}, event_id="evt_b"))
    assert seen == ["evt_b"]


async def test_session_events_are_deltas_on_the_sessions_block(h):
    block = [{"session_id": "ses_a", "jti": "ses_a", "kind": "ssh", "target": {"ssh": {"user": "deploy"}},
              "expires_at": "2999-01-01T00:00:00Z"}]
    h.store.edit(lambda d: d.with_state(State.from_wire({"sessions": block})), "pull", ())
    await h.handlers.dispatch(env("session_setup", {"session_id": "ses_b"}))
    assert h.refreshes == ["session_setup"]  # a new session comes with the state it is listed in
    await h.handlers.dispatch(env("ssh_session_setup", {"session_id": "ses_old", "target_host": "127.0.0.1",
                                                        "target_port": 22, "expires_at": "2999-01-01T00:00:00Z"}))
    assert set(h.desired.sessions.by_id) == {"ses_a", "ses_old"}  # the older shape: a TCP forward to sshd
    assert h.desired.sessions.by_id["ses_old"].kind == "tcp"
    await h.handlers.dispatch(env("session_revoked", {"session_id": "ses_a"}))
    assert set(h.desired.sessions.by_id) == {"ses_old"}  # at once: the pull only confirms it
    assert [c.split()[0] for c in h.converges] == ["ssh_session_setup", "session_revoked"]
    # A pull whose block is null or absent leaves the sessions as they are; [] ends them all.
    h.store.edit(lambda d: d.with_state(State.from_wire({"sessions": None})), "pull", ())
    assert set(h.desired.sessions.by_id) == {"ses_old"}
    h.store.edit(lambda d: d.with_state(State.from_wire({"sessions": []})), "pull", ())
    assert h.desired.sessions.by_id == {}


async def test_bad_session_events_name_the_field_and_change_nothing(h):
    before = h.desired
    with pytest.raises(WireFormatError, match=r"payload\.session_id"):
        await h.handlers.dispatch(env("session_revoked", {"session_id": 7}))
    with pytest.raises(WireFormatError, match="target"):
        await h.handlers.dispatch(env("ssh_session_setup", {"session_id": "ses_x", "target_host": "a b",
                                                            "expires_at": "2999-01-01T00:00:00Z"}))
    assert h.desired is before and h.converges == []


async def test_invalid_peer_is_kept_out_by_the_model(h):
    await h.handlers.dispatch(env("peer_added", {"id": "n_bad", "public_key": "short", "mesh_ip": "10.100.0.3"}))
    assert "n_bad" not in h.desired.peers
    assert dict(h.desired.rejected)["n_bad"]


def test_a_state_pull_never_changes_the_signing_keys(h, tmp_path, caplog):
    """The state body is unsigned: a key in it is logged (once) and ignored; keys change only through a signed
    signing_key_rotated event or a registration (tests/security/test_signing_key_sources.py attacks it)."""
    from plexd.node.mesh import MeshHandle, PulledState, StatePull
    from plexd.state.model import State

    async def fetch() -> State:
        raise AssertionError("the test applies its own pulls")

    applier = StatePull(MeshHandle(None, h.desired), fetch, h.verifier).apply  # type: ignore[arg-type]

    def apply(state):
        return applier(PulledState(state, since=0))

    old = h.verifier.keys.current
    slipped = base64.b64encode(bytes(nacl.signing.SigningKey.generate().verify_key)).decode()
    assert apply(State(signing_keys=SigningKeys(current=slipped))) == []
    assert apply(State(signing_keys=SigningKeys(current=slipped))) == []
    assert h.verifier.keys.current == old and not (tmp_path / "signing_public_key").exists()
    assert caplog.text.count("which this node does not trust") == 1  # once per key, not once per pull
    assert apply(State(signing_keys=SigningKeys(current=old))) == []  # the trusted key: nothing to say
    assert caplog.text.count("which this node does not trust") == 1


async def test_relay_events_are_deltas_on_the_relay_sessions_and_a_bridge_change_pulls(h):
    entry = {"session_id": "rel_1", "peer_a_id": "n_a", "peer_a_endpoint": "192.0.2.1:51820", "peer_b_id": "n_b",
             "peer_b_endpoint": "192.0.2.2:51820", "expires_at": "2999-01-01T00:00:00Z"}
    await h.handlers.dispatch(env("relay_session_assigned", entry))
    first = h.desired.relay
    assert list(first.sessions) == ["rel_1"]
    await h.handlers.dispatch(env("relay_session_assigned", {**entry, "session_id": "rel_2"}))
    assert list(h.desired.relay.sessions) == ["rel_1", "rel_2"] and list(first.sessions) == ["rel_1"]  # a copy
    await h.handlers.dispatch(env("relay_session_revoked", {"session_id": "rel_1"}))
    assert list(h.desired.relay.sessions) == ["rel_2"]
    before = h.desired
    with pytest.raises(WireFormatError, match="peer_b_endpoint"):
        await h.handlers.dispatch(env("relay_session_assigned", {**entry, "peer_b_endpoint": "nowhere"}))
    assert h.desired is before
    await h.handlers.dispatch(env("bridge_config_updated", {}))
    assert h.refreshes == ["bridge_config_updated"]  # only a pull, as in Go: the block is the truth


async def test_an_event_that_cannot_take_effect_makes_the_next_reconcile_pull(h):
    """An endpoint for a peer the model lacks (refused earlier, or its peer_added missed) changes nothing here: the
    state may have the peer, so the next cycle pulls instead of trusting the stream."""
    await h.handlers.dispatch(env("peer_endpoint_changed", {"id": "n_ghost", "endpoint": "192.0.2.9:51820"}))
    assert "n_ghost" not in h.desired.peers
    assert h.stale == ["peer_endpoint_changed for n_ghost, a peer the model does not have"]


async def test_a_peer_event_keeps_the_relay_fallback_the_state_gave(h):
    """`fallback_endpoint` is the state's to say, per receiving node; peer events do not carry it. A key rotation
    must not drop a relayed pair's fallback until the next pull."""
    key = wgkey()
    peer = {"id": "n_a", "public_key": key, "mesh_ip": "10.100.0.2", "endpoint": "192.0.2.1:51820",
            "allowed_ips": ["10.100.0.2/32"]}
    h.store.replace(h.desired.with_peer(Peer.from_wire({**peer, "fallback_endpoint": "192.0.2.50:51821"}, "p")))
    await h.handlers.dispatch(env("peer_key_rotated", {**peer, "public_key": wgkey()}))
    assert h.desired.peers["n_a"].fallback_endpoint == "192.0.2.50:51821"
    await h.handlers.dispatch(env("peer_added", {**peer, "fallback_endpoint": ""}, event_id="evt_2"))
    assert h.desired.peers["n_a"].fallback_endpoint == ""  # an event that does speak of it is taken at its word
