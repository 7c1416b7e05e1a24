"""The userspace relay (plexd/bridge) in a namespace lab: real wireguard-go pairs, each end behind its own router
doing random-port masquerade (`masquerade random,fully-random`, docs/test-environment.md §10), so no direct path
exists and the ports the control plane lists are never the ones the relay sees. The relay runs as its own process on the
public side (`python -m plexd.bridge.standalone`); the ends are set up with `wg set` (no plexd daemon), and their
public keys are in the sessions (the relay checks wireguard-go's handshakes' mac1 with them). Checked with ping,
`wg show` and the relay's own counters."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
from mesh_helpers import BACKENDS
from relay_lab import (
    RelayProcess,
    fastpath_elements,
    flush_conntrack,
    kernel_forwarded,
    nat_pair,
    ping,
    point_at,
    relay_forwards,
    relay_tables,
    session_doc,
    wait,
)

from plexd.devplane.lab import Lab

pytestmark = pytest.mark.root


@pytest.fixture
def lab():
    lab = Lab().up()
    try:
        yield lab
    finally:
        lab.down()
        assert lab.leaks() == []


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_a_pair_behind_two_random_port_nats_pings_through_the_relay_and_survives_a_port_remap(lab) -> None:
    relay = RelayProcess(lab, lab.add_node())
    a, b = nat_pair(lab, 1)
    assert relay.command({"sessions": [session_doc("rel_1", a, b)]}) == {"ok": True, "refused": []}
    point_at(lab, b, a, relay.address)
    point_at(lab, a, b, relay.address)

    wait(lambda: ping(lab, a, b.mesh_ip, 1).returncode == 0, 20, "a ping from a to b through the relay")
    res = ping(lab, b, a.mesh_ip, 5)
    assert res.returncode == 0, res.stdout
    # Full-MTU packets (1420: datagrams of 1452 bytes, not a multiple of 16) pass too.
    res = lab.exec(a.node, ["ping", "-c", "3", "-i", "0.2", "-W", "2", "-M", "do", "-s", "1392", b.mesh_ip],
                   check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    s = relay.session("rel_1")
    assert s["stable"] and s["packets_a_to_b"] >= 5 and s["packets_b_to_a"] >= 5, s
    # The relay learned the ports the NATs really chose, not the 51820 the control plane listed.
    assert s["peer_a_address"].startswith(f"{a.router.public}:") and port_of(s["peer_a_address"]) != 51820, s
    assert s["peer_b_address"].startswith(f"{b.router.public}:") and port_of(s["peer_b_address"]) != 51820, s
    # ... and the ends see only the relay (no direct path was used).
    assert lab.exec(a.node, ["wg", "show", "wg0", "endpoints"]).stdout.split() == [b.public_key, relay.address]

    # a's router forgets its mappings: the next packet leaves from another random port, with the same indices.
    handshake_before = lab.exec(a.node, ["wg", "show", "wg0", "latest-handshakes"]).stdout
    old = s["peer_a_address"]
    flush_conntrack(a.router)
    wait(lambda: relay.session("rel_1")["peer_a_address"] != old, 15, f"the relay to follow a's new port (was {old})")
    res = ping(lab, b, a.mesh_ip, 5)
    assert res.returncode == 0, res.stdout
    after = relay.session("rel_1")
    assert after["address_changes"] > s["address_changes"], after
    assert after["peer_a_address"].startswith(f"{a.router.public}:"), after
    # Same WireGuard session across the remap: no new handshake was needed to keep the flow.
    assert lab.exec(a.node, ["wg", "show", "wg0", "latest-handshakes"]).stdout == handshake_before


def test_three_pairs_at_once_through_one_relay_and_strays_are_counted(lab) -> None:
    relay = RelayProcess(lab, lab.add_node())
    pairs = [nat_pair(lab, k) for k in (1, 2, 3)]
    docs = [session_doc(f"rel_{k}", a, b) for k, (a, b) in enumerate(pairs, 1)]
    assert relay.command({"sessions": docs}) == {"ok": True, "refused": []}
    for a, b in pairs:
        point_at(lab, b, a, relay.address)
        point_at(lab, a, b, relay.address)
    for a, b in pairs:
        wait(lambda a=a, b=b: ping(lab, a, b.mesh_ip, 1).returncode == 0, 20, f"{a.mesh_ip} -> {b.mesh_ip}")
        res = ping(lab, b, a.mesh_ip, 3)
        assert res.returncode == 0, res.stdout
    sessions = {s["session_id"]: s for s in relay.status()["sessions"]}
    assert all(s["stable"] and s["packets_a_to_b"] > 0 and s["packets_b_to_a"] > 0 for s in sessions.values())
    assert len({s["peer_a_address"] for s in sessions.values()}) == 3

    # Strays from a public host: junk, a transport packet with an index no handshake made, an initiation
    # from an address no session lists. Dropped and counted; the pairs go on.
    before = relay.status()["dropped"]
    stranger = lab.add_node()
    send_strays(relay, stranger.netns, b"junk", stray_transport(), stray_initiation())
    want = {"malformed": before["malformed"] + 1, "unknown_index": before["unknown_index"] + 1,
            "unknown_source": before["unknown_source"] + 1}
    wait(lambda: {k: relay.status()["dropped"][k] for k in want} == want, 10, f"the strays counted as {want}")
    a, b = pairs[0]
    assert ping(lab, a, b.mesh_ip, 2).returncode == 0

    # Someone at a's public IP (the router itself here: another port), without the pair's keys: its initiations
    # fail their mac1, are dropped and counted, and move nothing.
    before, held = relay.status()["dropped"], relay.session("rel_1")
    send_strays(relay, a.router.netns, *[stray_initiation(n) for n in range(20)])
    want = {"bad_mac1": before["bad_mac1"] + 20}
    wait(lambda: {k: relay.status()["dropped"][k] for k in want} == want, 10, f"the strays counted as {want}")
    assert relay.session("rel_1")["peer_a_address"] == held["peer_a_address"]
    assert ping(lab, b, a.mesh_ip, 2).returncode == 0
    assert relay.proc.poll() is None


def send_strays(relay: RelayProcess, netns: str, *packets: bytes) -> None:
    host, port = relay.address.rsplit(":", 1)
    code = (f"import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"for p in {list(packets)!r}: s.sendto(p, ({host!r}, {port}))\n")
    subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code], check=True, timeout=30)


def stray_transport() -> bytes:
    return bytes([4, 0, 0, 0]) + struct.pack("<I", 0xDEADBEEF) + b"\0" * 24


def stray_initiation(sender: int = 7) -> bytes:
    return bytes([1, 0, 0, 0]) + struct.pack("<I", sender) + b"\0" * 140



@pytest.mark.parametrize("backend", BACKENDS)
def test_the_kernel_fast_path_forwards_a_stable_pair_and_follows_a_port_remap(lab, backend) -> None:
    """The relay's nftables fast path, between two ends behind random-port NATs: on this host's kernel with
    wireguard-go ends, and in the kernel tier on Debian's stock kernel with kernel WireGuard ends."""
    relay = RelayProcess(lab, lab.add_node())
    relay_forwards(relay)
    a, b = nat_pair(lab, 1, backend=backend)
    assert relay.command({"sessions": [session_doc("rel_1", a, b)]}) == {"ok": True, "refused": []}
    point_at(lab, b, a, relay.address)
    point_at(lab, a, b, relay.address)
    wait(lambda: ping(lab, a, b.mesh_ip, 1).returncode == 0, 20, "a ping through the userspace relay")
    wait(lambda: relay.session("rel_1")["stable"], 10, "the flow to be stable")

    assert relay.command({"fastpath": relay.node.address}) == {"ok": True}
    wait(lambda: relay.status()["fastpath"]["elements"] == 2, 10, "both directions in the kernel maps")
    s = relay.session("rel_1")
    assert f"{s['peer_a_address'].replace(':', ' . ')} : {port_of(s['peer_b_address'])}" in fastpath_elements(
        lab, relay)
    userspace_before = s["packets_a_to_b"] + s["packets_b_to_a"]
    kernel_before = kernel_forwarded(lab, relay)
    res = lab.exec(a.node, ["ping", "-c", "20", "-i", "0.05", "-W", "2", b.mesh_ip], check=False)
    assert res.returncode == 0, res.stdout
    s = relay.session("rel_1")
    assert kernel_forwarded(lab, relay) - kernel_before >= 40  # 20 requests and 20 replies, in the kernel
    assert s["packets_a_to_b"] + s["packets_b_to_a"] - userspace_before < 10, s  # handshakes at most

    # Drift: the maps flushed by hand, then the whole table deleted; the reconcile restores them and says so.
    for name in ("fwd_addr", "fwd_port"):
        lab.exec(relay.node, ["nft", "flush", "map", "inet", "plexd_relay", name])
    fixed = relay.command({"converge": True})
    assert fixed["changes"] == ["relay_fastpath_restored: relay fast path inet plexd_relay: 2 element(s) missing, "
                                "0 not the relay's; synced"] and not fixed["errors"], fixed
    assert f"{s['peer_a_address'].replace(':', ' . ')} : {port_of(s['peer_b_address'])}" in fastpath_elements(
        lab, relay)
    lab.exec(relay.node, ["nft", "delete", "table", "inet", "plexd_relay"])
    fixed = relay.command({"converge": True})
    assert fixed["changes"] == ["relay_fastpath_restored: relay fast path inet plexd_relay: table missing; "
                                "recreated"] and not fixed["errors"], fixed
    assert relay.command({"converge": True})["changes"] == []  # and then nothing to do
    kernel_before = kernel_forwarded(lab, relay)
    assert lab.exec(a.node, ["ping", "-c", "5", "-i", "0.05", "-W", "2", b.mesh_ip], check=False).returncode == 0
    assert kernel_forwarded(lab, relay) - kernel_before >= 10  # in the kernel again

    # a's NAT remaps: its packets miss the map, the userspace relay follows them, the next sync moves the element.
    old = s["peer_a_address"]
    flush_conntrack(a.router)
    wait(lambda: relay.session("rel_1")["peer_a_address"] != old, 15, f"the relay to follow a's new port (was {old})")
    new = relay.session("rel_1")["peer_a_address"]
    wait(lambda: new.replace(":", " . ") in fastpath_elements(lab, relay), 10, f"{new} in the kernel maps")
    kernel_before = kernel_forwarded(lab, relay)
    res = lab.exec(b.node, ["ping", "-c", "10", "-i", "0.05", "-W", "2", a.mesh_ip], check=False)
    assert res.returncode == 0, res.stdout
    assert kernel_forwarded(lab, relay) - kernel_before >= 20

    # Off again: the table goes, the userspace relay carries the pair.
    assert relay.command({"fastpath": ""}) == {"ok": True}
    assert "plexd_relay" not in relay_tables(relay)
    assert ping(lab, a, b.mesh_ip, 3).returncode == 0
