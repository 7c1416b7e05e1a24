"""The desired model: peer validation, immutable updates, and the JSON mirror without the private key."""

from __future__ import annotations

import base64

from nacl.public import PrivateKey

from plexd.state.desired import DesiredState, public_key_of
from plexd.state.model import Peer, SigningKeys, State

PRIV = base64.b64encode(bytes([7]) * 32).decode()
OWN = public_key_of(PRIV)
K = [base64.b64encode(bytes(PrivateKey(bytes([i]) * 32).public_key)).decode() for i in range(1, 5)]


def base() -> DesiredState:
    return DesiredState.initial(interface="wg0", listen_port=51820, mtu=1420, private_key=PRIV, mesh_ip="10.100.0.1")


def peer(i: int, **kw) -> Peer:
    args = {"id": f"n_{i}", "public_key": K[i], "mesh_ip": f"10.100.0.{i + 2}", "endpoint": f"10.0.0.{i}:51820",
            "allowed_ips": (f"10.100.0.{i + 2}/32",)}
    args.update(kw)
    return Peer(**args)


def test_invalid_peers_are_rejected_with_a_reason_and_the_rest_kept() -> None:
    d = base().with_state(State(peers=(
        peer(0),
        peer(1, public_key="not-a-key"),
        peer(2, allowed_ips=("10.1.2.300/32",)),
        peer(3, endpoint="10.0.0.1"),
        Peer(id="n_self", public_key=OWN, mesh_ip="10.100.0.9"),
        Peer(id="n_dup", public_key=K[0], mesh_ip="10.100.0.10"),
    )))
    assert list(d.peers) == ["n_0"]
    reasons = dict(d.rejected)
    assert "not base64 of 32 bytes" in reasons["n_1"]
    assert "'10.1.2.300/32' is not a CIDR" in reasons["n_2"]
    assert "is not host:port" in reasons["n_3"]
    assert reasons["n_self"] == "public key is this node's own key"
    assert reasons["n_dup"] == "public key is already used by peer n_0"


def test_with_and_without_peer_are_immutable_updates() -> None:
    d0 = base()
    d1 = d0.with_peer(peer(0))
    assert d0.peers == {} and d1.peers["n_0"] == peer(0)
    d2 = d1.with_peer(peer(0, public_key="bad"))  # an invalid update takes the peer out and says why
    assert "n_0" not in d2.peers and d2.rejected[0][0] == "n_0"
    d3 = d2.with_peer(peer(0))
    assert d3.peers["n_0"] == peer(0) and d3.rejected == ()
    d4 = d3.with_peer_endpoint("n_0", "[fd00::5]:1")
    assert d4.peers["n_0"].endpoint == "[fd00::5]:1" and d3.peers["n_0"].endpoint == "10.0.0.0:51820"
    assert d4.with_peer_endpoint("n_missing", "1.2.3.4:5") is d4
    assert "n_0" not in d4.without_peer("n_0").peers


def test_json_mirror_round_trips_without_the_private_key() -> None:
    d = base().with_state(State(peers=(peer(0), peer(1)), signing_keys=SigningKeys(current="abc"),
                                metadata={"env": "prod"}))
    doc = d.to_json()
    assert PRIV not in repr(doc) and PRIV not in repr(d)
    back = DesiredState.from_json(doc, private_key=PRIV)
    assert back == d
    assert DesiredState.from_json(doc).private_key == ""


def test_the_mirror_keeps_the_bridge_blocks_but_not_the_relays_leases() -> None:
    # A bridge restarted while the control plane is unreachable must bring its access interface, tunnels and
    # ingress back from the mirror (before, they came up empty and the made interfaces were removed).
    key = base64.b64encode(bytes(range(32))).decode()
    psk = base64.b64encode(bytes(range(32, 64))).decode()
    bridge = {"user_access": {"enabled": True, "peers": [{"public_key": key, "allowed_ips": ["10.100.250.5/32"],
                                                          "psk": psk}]},
              "site_to_site": {"enabled": True, "tunnels": [{"tunnel_id": "s2s_0", "remote_public_key": key,
                                                             "remote_endpoint": "192.0.2.1:51823",
                                                             "local_subnets": ["172.20.0.0/16"],
                                                             "remote_subnets": ["172.30.0.0/16"]}]},
              "relay": {"sessions": [{"session_id": "rel_1", "peer_a_id": "n_a", "peer_a_endpoint": "192.0.2.7:1",
                                      "peer_b_id": "n_b", "peer_b_endpoint": "192.0.2.8:2",
                                      "expires_at": "2099-01-01T00:00:00Z"}]}}
    live = base().with_state(State.from_wire({"peers": [], "bridge": bridge}))
    assert live.user_access.peers and live.site_to_site.tunnels and len(live.relay.sessions) == 1
    restored = DesiredState.from_json(live.to_json(), private_key=PRIV)
    assert restored.user_access == live.user_access and restored.site_to_site == live.site_to_site
    assert restored.relay is not None and len(restored.relay.sessions) == 0  # leases come from the control plane
    assert restored.user_access.peers[0].psk == psk
    assert psk not in repr(restored)  # the psk stays out of reprs (the mirror itself is the 0600 ledger)
    withdrawn = live.with_state(State.from_wire({"peers": [], "bridge": None}))  # "none desired"
    again = DesiredState.from_json(withdrawn.to_json(), private_key=PRIV)
    assert again.user_access == withdrawn.user_access and not again.user_access.enabled
    assert not again.site_to_site.tunnels


def test_wireguard_value_types_never_print_keys():
    from plexd.machine.wireguard import DeviceConfig, DeviceUpdate, PeerConfig, PeerUpdate

    secret = "SECRETSECRETSECRETSECRETSECRETSECRETSECRET="
    texts = [repr(DeviceConfig(private_key=secret)), repr(DeviceUpdate(private_key=secret)),
             repr(PeerConfig(public_key="pub", psk=secret)), repr(PeerUpdate(public_key="pub", psk=secret))]
    assert all(secret not in t for t in texts)


def test_free_text_in_an_address_never_reaches_the_uapi_request() -> None:
    """Python's ipaddress takes any text after '%' (an IPv6 scope), newlines included: a peer carrying one would
    inject lines into the UAPI `set` request. Such peers are skipped; a plain interface-name scope still works."""
    inject = "fe80::1%x\nremove=true"
    d = base().with_peers([
        peer(0, endpoint=f"[{inject}]:51820"),
        peer(1, allowed_ips=(f"{inject}/128",)),
        Peer(id="n_m", public_key=K[2], mesh_ip=inject),
        peer(3, endpoint="example.com\n:51820"),
    ])
    assert d.peers == {} and [pid for pid, _ in d.rejected] == ["n_0", "n_1", "n_3", "n_m"]
    assert "is not an IPv6 address" in dict(d.rejected)["n_0"]
    assert "is not a CIDR" in dict(d.rejected)["n_1"]
    ok = base().with_peers([peer(0, endpoint="[fe80::1%eth0]:51820")])
    assert list(ok.peers) == ["n_0"]
