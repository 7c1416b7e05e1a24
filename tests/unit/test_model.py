"""Wire types: lenient where Go is lenient, precise errors where a value has the wrong type."""

import pytest

from plexd.base.errors import WireFormatError
from plexd.state.model import Peer, RegisterResponse, State


def test_state_accepts_nulls_and_unknown_keys():
    state = State.from_wire({"peers": None, "policies": None, "data": None, "secret_refs": None, "future": 1})
    assert state.peers == () and state.policies == () and state.signing_keys is None


def test_state_round_trip():
    wire = {
        "peers": [{"id": "n1", "public_key": "k", "mesh_ip": "10.100.0.2", "endpoint": "1.2.3.4:51820",
                   "allowed_ips": ["10.100.0.2/32"], "psk": ""}],
        "policies": [{"id": "p", "rules": [{"src": "*", "dst": "*", "port": 0, "protocol": "", "action": "allow"}]}],
        "data": [{"key": "k", "content_type": "text/plain", "payload": "x", "version": 2,
                  "updated_at": "2025-01-15T10:30:00Z"}],
        "secret_refs": [{"key": "s", "version": 1}],
        "signing_keys": {"current": "c"},
        "metadata": {"env": "prod"},
    }
    assert State.from_wire(wire).to_wire() == wire


def test_keys_match_case_insensitively():
    assert Peer.from_wire({"ID": "n1", "Public_Key": "k", "mesh_ip": "m"}).public_key == "k"


@pytest.mark.parametrize(
    ("wire", "path"),
    [({"peers": [{"id": 1}]}, "peers[0].id"), ({"peers": {}}, "peers"),
     ({"peers": [{"allowed_ips": [1]}]}, "peers[0].allowed_ips[0]"),
     ({"metadata": {"a": True}}, "metadata.a"), ({"data": [{"version": 1.5}]}, "data[0].version")],
)
def test_wrong_types_name_the_field(wire, path):
    with pytest.raises(WireFormatError) as info:
        State.from_wire(wire)
    assert info.value.path == path


def test_a_policy_rule_of_the_wrong_shape_is_kept_aside_not_fatal():
    # One bad rule must not cost the whole state document (the engine skips it, naming policy and rule).
    state = State.from_wire({"policies": [{"id": "p", "rules": [{"port": "443"}, {"src": "*", "dst": "*"}]},
                                          "not a policy"]})
    bad, good = state.policies[0].rules
    assert "policies[0].rules[0].port" in bad.problem and bad.to_wire() == {"port": "443"}
    assert good.problem == "" and good.src == "*"
    assert "policies[1]" in state.policies[1].problem and state.policies[1].to_wire() == "not a policy"


def test_register_response_requires_identity_fields():
    with pytest.raises(WireFormatError, match="node_secret_key"):
        RegisterResponse.from_wire({"node_id": "n", "mesh_ip": "m", "signing_public_key": "s"})


@pytest.mark.parametrize("mesh_ip", ["10.100.1.5/16", "10.100.1", "node-a", "10.100.1.5 "])
def test_a_mesh_ip_that_is_not_an_address_is_refused_at_registration(mesh_ip):
    # Saved, it made every converge fail with an internal error that never named the control plane's value.
    with pytest.raises(WireFormatError, match=r"mesh_ip: .* is not an IP address"):
        RegisterResponse.from_wire({"node_id": "n", "mesh_ip": mesh_ip, "signing_public_key": "s",
                                    "node_secret_key": "secret"})


@pytest.mark.parametrize("secret", ["s3cr3t\nX", "s3cr3t\x00", "s3cr3t\u00e9", " s3cr3t", "s3cr3t\t"])
def test_a_node_secret_no_bearer_can_carry_is_refused_without_quoting_it(secret):
    # Saved, it would fail every request for good (and h11's error quoted the whole header, secret and all).
    with pytest.raises(WireFormatError, match="node_secret_key: has characters a bearer cannot carry") as caught:
        RegisterResponse.from_wire({"node_id": "n", "mesh_ip": "10.100.0.2", "signing_public_key": "s",
                                    "node_secret_key": secret})
    assert "s3cr3t" not in str(caught.value)
