"""Signing keys come only from signed sources, and a signed event is only good for the node it was sent to
(real devplane, real `plexd up` in namespaces):

- a signing key slipped into an unsigned state pull is not installed: an event signed with it is refused and the
  node's key file is unchanged;
- an event the control plane signed for node A, captured and replayed into node B's stream, is refused by B
  (the devplane binds the nodes it addresses inside the signed payload) and changes nothing on B, while A takes
  the very same bytes;
- a legitimate signing_key_rotated event (the devplane rotating its key, announced under the old one) still rotates
  the node's keys: the key file follows and events signed with the new key are applied;
- a plain-HTTP control plane runs only with api.allow_insecure, and then a warning naming it is logged at the start
  (the refusal without the key: tests/unit/test_config.py::test_an_insecure_control_plane_needs_allow_insecure).
"""

from __future__ import annotations

import base64
import json
import sqlite3

import pytest
from lab_daemon import Daemon, wait_until, wg_peers
from nacl.signing import SigningKey

from plexd.controlplane.envelope import sign_event
from plexd.controlplane.event_signing import SIGNING_KEY_FILE


def peer_payload(n: int) -> dict:
    return {"id": f"n_planted{n}", "public_key": base64.b64encode(bytes([n]) * 32).decode(),
            "mesh_ip": f"10.100.202.{n}", "allowed_ips": [f"10.100.202.{n}/32"], "endpoint": "", "psk": ""}


def frame(event_id: str, event_type: str, data: str) -> str:
    return f"id: {event_id}\nevent: {event_type}\ndata: {data}\n\n"


def settled(d: Daemon, daemons: list[Daemon]) -> None:
    """Connected, and both state pulls of a start done: the start's own and the one the connection triggers. Run
    after a test's planted peer, either would remove it (the control plane never listed it); a full run saw the
    second do exactly that."""
    wait_until(lambda: "event stream connected" in d.logged() and "reconcile (start)" in d.logged(), 30,
               f"{d.node.name}'s event stream and the start's reconcile", daemons)
    wait_until(lambda: "event stream (re)connected" in ((d.status()["reconcile"]["last"] or {}).get("reasons") or []),
               20, f"the reconcile {d.node.name}'s connection triggers", daemons)


def test_a_signing_key_slipped_into_a_state_pull_is_never_trusted(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a = Daemon(lab, lab.nodes[0], dp, tmp_path, reconcile="2s")
    daemons.append(a)
    wait_until(lambda: "event stream connected" in a.logged(), 30, "the event stream", daemons)
    key_file = a.dir / "data" / "signing_public_key"
    trusted = dp.admin.status()["signing_keys"]["current"]
    attacker = SigningKey.generate()
    slipped = base64.b64encode(bytes(attacker.verify_key)).decode()
    dp.admin.set_faults(state_body=json.dumps({"peers": [], "policies": dp.admin.policies(),
                                               "signing_keys": {"current": slipped}}))
    # a state changed without an event: a connected node pulls it when asked (or within reconcile.pull_interval)
    dp.admin.request_heartbeat_flags(a.node_id(), reconcile=True)
    wait_until(lambda: "which this node does not trust" in a.logged(), 20, "the slipped key noticed", daemons)
    dp.admin.clear_faults()

    forged = sign_event(attacker, "peer_added", "evt_forged1", peer_payload(1))
    dp.admin.publish_event(a.node_id(), "raw", raw_frame=frame("evt_forged1", "peer_added", forged))
    wait_until(lambda: "signature verification failed" in a.logged(), 15, "the forged event refused", daemons)
    assert base64.b64encode(bytes([1]) * 32).decode() not in wg_peers(lab, a.node)
    assert (key_file.read_text().strip() if key_file.exists() else trusted) == trusted
    assert a.proc.poll() is None and "Traceback" not in a.logged()


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_an_event_for_one_node_replayed_to_another_is_refused(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a = Daemon(lab, lab.nodes[0], dp, tmp_path, reconcile="1h")
    b = Daemon(lab, lab.nodes[1], dp, tmp_path, reconcile="1h")
    daemons += [a, b]
    for d in (a, b):
        settled(d, daemons)
    # a genuine event for a alone, signed by the control plane, taken from the devplane's own event log: the
    # exact bytes a's stream carried (a captures them too, and applies them)
    event_id = dp.admin.publish_event(a.node_id(), "peer_added", payload=peer_payload(7))
    planted = peer_payload(7)["public_key"]
    wait_until(lambda: planted in wg_peers(lab, a.node), 15, "a to apply its own event", daemons)
    with sqlite3.connect(dp.db_path) as db:
        (data,) = db.execute("SELECT data FROM events WHERE event_type = 'peer_added' ORDER BY seq DESC LIMIT 1"
                             ).fetchone()
    assert json.loads(data)["event_id"] == event_id and a.node_id() in data  # bound to a, inside the signature

    dp.admin.publish_event(b.node_id(), "raw", raw_frame=frame(event_id, "peer_added", data.replace("\n", "")))
    wait_until(lambda: f"not to this node {b.node_id()}" in b.logged(), 15, "b to refuse a's event", daemons)
    assert planted not in wg_peers(lab, b.node)
    assert b.proc.poll() is None and "Traceback" not in b.logged()


def test_a_signed_rotation_still_rotates_the_keys_and_the_insecure_start_is_named(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a = Daemon(lab, lab.nodes[0], dp, tmp_path, reconcile="1h")
    daemons.append(a)
    # connected, and the start's state pull done: it would replace the peer the event below adds
    settled(a, daemons)
    # the lab config's http:// devplane runs only because it says api.allow_insecure, and never silently
    assert "INSECURE control plane connection (api.allow_insecure): plain http://" in a.logged()

    key_file = a.dir / "data" / SIGNING_KEY_FILE
    keys = dp.admin.rotate_signing_key("1h")
    wait_until(lambda: key_file.exists() and key_file.read_text().strip() == keys["current"], 15,
               "the rotated key persisted", daemons)
    event_id = dp.admin.publish_event(a.node_id(), "peer_added", payload=peer_payload(9))  # signed with the new key
    wait_until(lambda: peer_payload(9)["public_key"] in wg_peers(lab, a.node), 15, f"{event_id} applied", daemons)
    assert "signature verification failed" not in a.logged() and "Traceback" not in a.logged()
