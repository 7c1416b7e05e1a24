"""The platform dialect's pure translations: the snapshot into the one model, the heartbeat and capabilities
bodies, the token's project, and the visibility flag surviving the mirror."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plexd.base.errors import WireFormatError
from plexd.controlplane import platform_calls
from plexd.controlplane.platform_snapshot import UNPOPULATED_POLICY_ID, state_from_snapshot
from plexd.state import policy
from plexd.state.desired import DesiredState
from plexd.state.model import Peer

KEY = base64.b64encode(bytes(range(32))).decode()


def snapshot(**blocks):
    doc = {"peers": [], "reachability": None, "policy": None, "bridge": None, "state": None, "reports": None,
           "executions": [], "sessions": None}
    doc.update(blocks)
    return doc


def rule(**fields):
    return {"action": "allow", "protocol": "tcp", "source_cidr": "10.99.0.0/24", "destination_cidr": "10.99.0.5/32",
            **fields}


def test_peers_route_their_mesh_ip_and_are_reached_at_the_fallback_endpoint():
    state = state_from_snapshot(snapshot(peers=[
        {"node_id": "n1", "mesh_ip": "10.99.0.2", "public_key": KEY, "fallback_endpoint": "203.0.113.1:51820"},
        {"node_id": "n2", "mesh_ip": "fd00::2", "public_key": KEY}]))
    assert state.peers == (Peer("n1", KEY, "10.99.0.2", "203.0.113.1:51820", ("10.99.0.2/32",)),
                           Peer("n2", KEY, "fd00::2", "", ("fd00::2/128",)))
    assert state.peers_by_policy is False  # the snapshot lists exactly the visible peers


def test_a_null_policy_allows_everything_and_a_policy_is_its_rules():
    [none] = state_from_snapshot(snapshot()).policies
    assert none.id == UNPOPULATED_POLICY_ID and [r.to_wire() for r in none.rules] == [
        {"src": "*", "dst": "*", "port": 0, "protocol": "", "action": "allow"}]
    [pol] = state_from_snapshot(snapshot(policy={"revision_id": "r7", "fingerprint": "f", "rules": [
        rule(protocol="any", destination_cidr="0.0.0.0/0"),
        rule(ports={"from": 443, "to": 443}),
        rule(protocol="udp", ports={"from": 1000, "to": 1002}, action="deny"),
        rule(ports={"from": 1, "to": 65535}),
    ]})).policies
    assert pol.id == "r7"
    assert [(r.src, r.dst, r.port, r.protocol, r.action) for r in pol.rules] == [
        ("10.99.0.0/24", "*", 0, "", "allow"),
        ("10.99.0.0/24", "10.99.0.5/32", 443, "tcp", "allow"),
        *[("10.99.0.0/24", "10.99.0.5/32", p, "udp", "deny") for p in (1000, 1001, 1002)],
        ("10.99.0.0/24", "10.99.0.5/32", 0, "tcp", "allow")]


@pytest.mark.parametrize("bad,reason", [
    (rule(action="log"), "'log' is not enforced here"),
    (rule(protocol="sctp"), "'sctp' is not tcp, udp, icmp or any"),
    (rule(source_cidr="mesh"), "source_cidr: 'mesh' is not a CIDR"),
    (rule(ports={"from": 1, "to": 4000}), "a range of 4000 ports is not enforced here"),
    (rule(ports={"from": 9, "to": 8}), "0 <= from <= to <= 65535"),
])
def test_a_rule_that_cannot_be_enforced_is_skipped_by_name_and_the_rest_applies(bad, reason):
    [pol] = state_from_snapshot(snapshot(policy={"revision_id": "r", "rules": [bad, rule()]})).policies
    compiled = policy.compile_policies((pol,), "self", ("10.99.0.5",), ("10.99.0.0/16",))
    [skipped] = compiled.skipped
    assert reason in skipped.reason and skipped.index == 0
    assert len(compiled.rules) == 1


def test_node_state_metadata_and_opaque_data():
    state = state_from_snapshot(snapshot(state={"metadata": [{"key": "env", "value": "prod"}],
                                                "data": [{"key": "app/config", "value": "{\"a\": 1}"}],
                                                "reports": [{"key": "status.mesh", "value": "{}"}]}))
    assert state.metadata == {"env": "prod"}
    [entry] = state.data
    assert (entry.key, entry.payload) == ("app/config", "{\"a\": 1}")


@pytest.mark.parametrize("doc,field", [([], "state"), (snapshot(peers={}), "peers"),
                                       (snapshot(peers=[{"node_id": 5}]), "peers[0].node_id")])
def test_a_snapshot_of_the_wrong_shape_names_the_field(doc, field):
    with pytest.raises(WireFormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        state_from_snapshot(doc)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["peers", "policy", "state", "rules", "ports", "from", "to", "node_id",
                                         "mesh_ip", "metadata", "data", "key", "value", "sessions", "bridge"]),
                        inner, max_size=4), max_leaves=20))
def test_any_document_is_a_state_or_a_named_error(doc):
    try:
        state_from_snapshot(doc)
    except WireFormatError:
        pass


def test_the_visibility_flag_survives_the_mirror():
    desired = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key=KEY,
                                   mesh_ip="10.99.0.5").with_state(state_from_snapshot(snapshot()))
    assert desired.peers_by_policy is False
    assert DesiredState.from_json(desired.to_json(), private_key=KEY).peers_by_policy is False


def test_the_token_names_its_project():
    project = uuid.UUID("0190a8b8-a0c0-7a0a-8a0a-a0a0a0a0a0a0")
    segment = base64.b32encode(project.bytes).decode().rstrip("=").lower()
    assert platform_calls.project_from_token(f"psb_prod_{segment}_node_{'a' * 26}") == str(project)
    for other in ("plx_enroll_abc", f"psb_prod_{segment}_user_{'a' * 26}", "psb_prod_!!_node_x", ""):
        assert platform_calls.project_from_token(other) == ""


def test_heartbeat_and_capabilities_bodies_are_the_flat_shapes():
    hexsum = "ab" * 32
    body = platform_calls.heartbeat_body({"binary_checksum": hexsum, "nat": {"public_endpoint": "1.2.3.4:5",
                                                                            "type": "none"}},
                                         datetime(2026, 7, 19, 19, 32, 35, tzinfo=UTC))
    assert body == {"client_now": "2026-07-19T19:32:35Z", "binary_checksum": base64.b64encode(bytes.fromhex(hexsum))
                    .decode(), "binary_version": body["binary_version"],
                    "nat_summary": {"endpoint": "1.2.3.4:5", "nat_type": "full_cone"}}
    assert platform_calls.heartbeat_body({"binary_checksum": hexsum}, datetime.now(UTC))["nat_summary"] == {}
    caps = platform_calls.capabilities_body({"binary": {"version": "1.0", "checksum": hexsum},
                                             "hooks": [{"name": "ok", "checksum": hexsum},
                                                       {"name": "bad", "checksum": "not a digest"}]})
    assert set(caps) == {"binary_version", "binary_checksum", "declared_hooks"}
    assert caps["declared_hooks"] == [{"name": "ok", "checksum": caps["binary_checksum"]}]


def test_a_platform_identity_whose_bearer_cannot_be_built_is_unusable_not_a_crash(tmp_path):
    import json as _json

    from plexd.identity.identity_store import Identity, IdentityStore

    store = IdentityStore(tmp_path)
    nsk = base64.b64encode(bytes(32)).decode()
    store.save(Identity("not-a-uuid", "10.99.0.5", KEY, nsk, bytes(range(32)), dialect="platform",
                        signing_key_id="k", domain_mesh_cidr="10.99.0.0/16"))
    loaded = store.load()
    assert loaded.identity is None and "is not a UUID" in loaded.problem and nsk not in loaded.problem
    doc = _json.loads((tmp_path / "identity.json").read_text())
    doc["node_id"] = str(uuid.uuid4())
    (tmp_path / "identity.json").write_text(_json.dumps(doc))
    assert store.load().identity.bearer.startswith("nsk_plexd_")
