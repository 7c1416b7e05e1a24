"""WireGuard key rotation in the lab (plexd.node.key_rotation): real daemons, the real devplane, real wireguard-go.

1. `plexd rotate-keys` under a continuous ping: at most one packet lost, both devices on the new key, the old key
   nowhere (devices, devplane, data_dir); then, after the devplane rotated its signing key, one asked for by the
   heartbeat flag (the peer takes it from an event signed with the new signing key); a refusal keeps the old key.
2. kill -9 in the middle (the devplane took the new key and has not answered): the restarted node finishes the
   rotation first thing and is a working member again.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from lab_daemon import (
    assert_rotated,
    own_key,
    ping_count,
    ping_during,
    pinging_pair,
    register_ghost,
    stored_key,
    wait_until,
    wg_peers,
)


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_a_rotation_under_ping_loses_at_most_one_packet_and_leaves_the_old_key_nowhere(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h")
    old = dp.admin.node(a.node_id())["public_key"]
    assert own_key(lab, a) == old

    doc, missing, sent = ping_during(lab, a.node, b.mesh_ip(), 40,
                                     lambda: json.loads(a.cli("rotate-keys", "--json").stdout))
    print(f"rotation under ping: {missing} of {sent} lost")
    assert sent == 40 and missing <= 1
    assert doc["previous_public_key"] == old and doc["updated_peers"] == 1
    new = assert_rotated(lab, dp, a, b, old, daemons)
    assert doc["public_key"] == new
    assert a.status()["key_rotation"]["rotations"] == 1
    text = a.logged()
    assert "rotated the WireGuard key" in text and old not in text and new not in text  # fingerprints only

    # The devplane rotates its signing key; then the heartbeat's rotate_keys flag starts a rotation, whose
    # peer_key_rotated reaches b signed with the new signing key only.
    signing = dp.admin.rotate_signing_key("1h")
    wait_until(lambda: (b.dir / "data" / "signing_public_key").read_text() == signing["current"], 15,
               "b to take the new signing key", daemons)
    dp.admin.request_heartbeat_flags(a.node_id(), rotate_keys=True)
    wait_until(lambda: dp.admin.node(a.node_id())["public_key"] != new, 15, "the flagged rotation", daemons)
    newer = assert_rotated(lab, dp, a, b, new, daemons)
    assert ping_count(lab, a.node, b.mesh_ip(), 3, 0.2) == 3

    # Refused by the control plane: the node keeps its key, on the device and on disk, and says why.
    dp.admin.set_faults(rotate_status=403)
    refused = a.cli("rotate-keys", check=False)
    assert refused.returncode != 0 and "403" in refused.stderr, refused.stderr
    dp.admin.clear_faults()
    assert own_key(lab, a) == newer == stored_key(a) == dp.admin.node(a.node_id())["public_key"]
    assert not (a.dir / "data" / "private_key.next").exists()
    assert ping_count(lab, a.node, b.mesh_ip(), 3, 0.2) == 3


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_killed_in_the_middle_of_a_rotation_the_node_finishes_it_at_the_next_start(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h")
    old = dp.admin.node(a.node_id())["public_key"]
    dp.admin.set_faults(rotate_answer_after=60)  # the devplane takes the key and answers a minute later
    dp.admin.request_heartbeat_flags(a.node_id(), rotate_keys=True)
    wait_until(lambda: dp.admin.node(a.node_id())["public_key"] != old, 15, "the devplane to take the key", daemons)
    assert (a.dir / "data" / "private_key.next").exists() and stored_key(a) == old  # not committed

    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(10)
    a.log.close()
    dp.admin.clear_faults()
    a._start()
    wait_until(lambda: stored_key(a) != old and not (a.dir / "data" / "private_key.next").exists(), 20,
               "the restarted node to finish the rotation", daemons)
    assert "a rotation the last run did not finish" in a.logged()
    assert_rotated(lab, dp, a, b, old, daemons)
    wait_until(lambda: ping_count(lab, a.node, b.mesh_ip(), 1, 0.2) == 1, 15, "a ping after the restart", daemons)


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_a_rotation_succeeds_while_another_part_of_the_converge_keeps_failing(lab_dp):
    """The rotation asked whether the whole converge was clean; an error that stays while the node runs (here a
    peer whose endpoint name never resolves) made every rotation fail, and a resumed one flip the device between
    its keys. It asks the device now."""
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h")
    ghost, _ = register_ghost(dp, "px-unresolvable")
    dp.admin.set_node_endpoint(ghost["node_id"], "no-such-host.invalid:51820")
    wait_until(lambda: "no-such-host.invalid" in a.logged(), 20, "a's converge to fail on the ghost's name", daemons)
    old = dp.admin.node(a.node_id())["public_key"]
    doc = json.loads(a.cli("rotate-keys", "--json").stdout)
    new = dp.admin.node(a.node_id())["public_key"]
    assert doc["previous_public_key"] == old and doc["public_key"] == new != old
    # b also lists the ghost: a's key swapped there, the old one gone
    wait_until(lambda: new in wg_peers(lab, b.node) and old not in wg_peers(lab, b.node), 15, "b to swap a's key",
               daemons)
    assert own_key(lab, a) == new == stored_key(a) and not (a.dir / "data" / "private_key.next").exists()
    assert ping_count(lab, a.node, b.mesh_ip(), 3, 0.2) == 3
