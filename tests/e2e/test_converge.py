"""The converge engine against real wireguard-go in namespaces: drift made by hand is corrected and named.

Each case changes the live machine behind plexd's back (with `wg set`, `ip addr del`, `kill -9`), runs the next
converge, and checks both the result's corrections and the device as the real `wg show wg0 dump` sees it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
from mesh_helpers import BACKENDS, keypair, mesh_node, ping
from waiting import wait_for

from plexd.converge.engine import Mode
from plexd.devplane.lab import Lab
from plexd.machine.links import DEFAULT_TABLE
from plexd.machine.wireguard import DeviceUpdate, PeerUpdate, WireGuardError, genl, kernel_module_loaded, userspace
from plexd.mesh.first_contact import FOLLOW_DELAY
from plexd.state.model import Peer


@pytest.fixture
async def pair(request):
    """Two lab nodes with their convergers; the WireGuard backend is `request.param` (userspace by default;
    "kernel" is the kernel tier's, run in the VM booting Debian's stock kernel)."""
    kind = getattr(request, "param", "userspace")
    assert kind != "kernel" or kernel_module_loaded(), "the kernel tier runs where the wireguard module is loaded"
    lab = Lab().up(2)
    a = b = None
    try:
        a, b = mesh_node(lab, 1, kind), mesh_node(lab, 2, kind)
        yield lab, a, b
    finally:
        for n in (a, b):
            if n is not None:
                if n.kind == "kernel":
                    await n.backend.delete_device()
                else:
                    await n.backend.close()
        lab.down()
        assert lab.leaks() == []



def corrections(result) -> list[tuple[str, str]]:
    return [(c.type, c.detail) for c in result.corrections()]


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
async def test_drift_is_corrected_and_named(pair) -> None:
    lab, a, b = pair
    # n_3 is a peer that never answers (no handshake): its endpoint is not protected by the roaming window
    _, ghost_key = keypair()
    ghost = Peer(id="n_ghost", public_key=ghost_key, mesh_ip="10.100.0.77", endpoint="10.231.255.77:51820",
                 allowed_ips=("10.100.0.77/32",))
    da = a.desired([b]).with_peer(ghost)
    db = b.desired([a])
    assert (await b.converger.converge(db)).ok  # responder first (docs/test-environment.md §2)
    first = await a.converger.converge(da)
    assert first.ok and ("interface_created", "interface wg0: missing, created") in corrections(first)
    assert {"peer n_2: missing from the device", "peer n_ghost: missing from the device"} <= {
        c.detail for c in first.changes}
    assert ping(lab, a, b.mesh_ip)
    assert (await a.converger.converge(da)).changes == ()  # nothing to do: nothing reported

    # 1. a peer removed by hand
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", b.public_key, "remove"])
    r = await a.converger.converge(da)
    assert corrections(r) == [("peer_added", "peer n_2: missing from the device")]
    assert b.public_key in {row[0] for row in a.wg_dump(lab)[1:]}

    # 2. a changed endpoint (the ghost never handshakes, so the endpoint is corrected)
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", ghost_key, "endpoint", "10.231.255.78:4444"])
    r = await a.converger.converge(da)
    assert corrections(r) == [("peer_updated", "peer n_ghost: endpoint 10.231.255.78:4444 != 10.231.255.77:51820")]
    assert {row[0]: row[2] for row in a.wg_dump(lab)[1:]}[ghost_key] == "10.231.255.77:51820"
    # ... but a peer that handshook within 180 s roamed: its endpoint is left alone
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", b.public_key, "endpoint", f"{b.lab_node.address}:51820"])
    assert ping(lab, a, b.mesh_ip)
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", b.public_key, "endpoint", "10.231.255.79:51820"])
    assert (await a.converger.converge(da)).changes == ()

    # 3. an extra peer added by hand
    _, stranger = keypair()
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", stranger, "allowed-ips", "10.100.0.99/32"])
    r = await a.converger.converge(da)
    assert corrections(r) == [("peer_removed", f"peer {stranger[:8]}…: on the device but not desired")]
    assert stranger not in {row[0] for row in a.wg_dump(lab)[1:]}

    # 4. the address deleted
    lab.exec(a.lab_node, ["ip", "addr", "del", f"{a.mesh_ip}/32", "dev", "wg0"])
    r = await a.converger.converge(da)
    # (the kernel drops a link's IPv4 routes with its last IPv4 address, so those come back too)
    assert corrections(r) == [("address_added", f"interface wg0: address {a.mesh_ip}/32 missing"),
                              ("route_added", f"interface wg0: route {b.mesh_ip}/32 missing"),
                              ("route_added", "interface wg0: route 10.100.0.77/32 missing")]
    assert f"inet {a.mesh_ip}/32" in lab.exec(a.lab_node, ["ip", "addr", "show", "wg0"]).stdout

    if a.kind == "kernel":
        return  # a kernel device has no process to kill; the rest is the same test for both backends

    # 5. the userspace process killed: restarted and fully re-configured
    old_pid = a.backend.pid
    os.kill(old_pid, signal.SIGKILL)
    await wait_for(a.backend.process_gone, 10, "wireguard-go's death noticed")
    r = await a.converger.converge(da)
    types = [t for t, _ in corrections(r)]
    assert types[0] == "userspace_restarted" and types.count("peer_added") == 2
    assert {"address_added", "route_added", "link_up", "private_key_updated"} <= set(types)
    assert "route_rule_added" not in types  # the rule outlived the interface: nothing to put back, nor report
    assert a.backend.pid not in (None, old_pid)
    assert {row[0] for row in a.wg_dump(lab)[1:]} == {b.public_key, ghost_key}
    assert ping(lab, a, b.mesh_ip)
    assert (await a.converger.converge(da)).changes == ()


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
async def test_device_and_link_drift_is_corrected_and_named(pair) -> None:
    """The rest of the drift a hand (or another tool) can make, each corrected by the next full converge and named
    in its report: a peer's allowed IPs and keepalive, the private key, the listen port, the MTU, the link down,
    and the interface deleted (for wireguard-go, the process then exits: restarted)."""
    lab, a, b = pair
    da = a.desired([b])
    assert (await b.converger.converge(b.desired([a]))).ok
    assert (await a.converger.converge(da)).ok
    assert await asyncio.to_thread(ping, lab, a, b.mesh_ip)
    await asyncio.sleep(FOLLOW_DELAY + 0.5)  # a follower's held kick has gone out
    assert (await a.converger.converge(da)).changes == ()
    other_key = Path(lab.workdir) / "other.key"
    other_key.write_text(keypair()[0] + "\n")

    def device() -> tuple[list[str], dict[str, list[str]]]:
        dump = a.wg_dump(lab)
        return dump[0], {row[0]: row for row in dump[1:]}

    hand_made = [
        (["wg", "set", "wg0", "peer", b.public_key, "allowed-ips", "10.100.0.2/32,10.100.9.0/24"],
         [("peer_updated", "peer n_2: allowed IPs 10.100.0.2/32,10.100.9.0/24 != 10.100.0.2/32")]),
        (["wg", "set", "wg0", "peer", b.public_key, "persistent-keepalive", "7"],
         [("peer_updated", "peer n_2: persistent keepalive 7 != 25")]),
        (["wg", "set", "wg0", "private-key", str(other_key)],
         [("private_key_updated", "interface wg0: private key was not the node's")]),
        (["wg", "set", "wg0", "listen-port", "4444"],
         [("listen_port_updated", "interface wg0: listen port 4444 != 51820")]),
        (["ip", "link", "set", "wg0", "mtu", "1280"], [("mtu_updated", "interface wg0: mtu 1280 != 1420")]),
        # a link taken down loses its routes with it: they come back too
        (["ip", "link", "set", "wg0", "down"],
         [("link_up", "interface wg0: link was down"), ("route_added", "interface wg0: route 10.100.0.2/32 missing")]),
    ]
    for command, expected in hand_made:
        lab.exec(a.lab_node, command)
        r = await a.converger.converge(da)
        assert r.ok and sorted(corrections(r)) == sorted(expected), command
        interface, peers = device()
        assert interface[1:3] == [a.public_key, "51820"] and peers[b.public_key][3:8:4] == ["10.100.0.2/32", "25"]
        assert '"mtu":1420' in lab.exec(a.lab_node, ["ip", "-j", "link", "show", "wg0"]).stdout.replace(" ", "")
        assert await asyncio.to_thread(ping, lab, a, b.mesh_ip), command
        assert (await a.converger.converge(da)).changes == (), command

    # the interface deleted: the kernel device is created again; wireguard-go, whose TUN went, exits and is restarted
    lab.exec(a.lab_node, ["ip", "link", "del", "wg0"])
    if a.kind == "userspace":
        await wait_for(a.backend.process_gone, 10, "wireguard-go to exit with its interface")
    r = await a.converger.converge(da)
    types = [t for t, _ in corrections(r)]
    assert r.ok and types[0] == ("interface_created" if a.kind == "kernel" else "userspace_restarted"), types
    assert {"peer_added", "private_key_updated", "address_added", "link_up", "route_added"} <= set(types), types
    interface, peers = device()
    assert interface[1:3] == [a.public_key, "51820"] and set(peers) == {b.public_key}
    assert await asyncio.to_thread(ping, lab, a, b.mesh_ip)
    await asyncio.sleep(FOLLOW_DELAY + 0.5)
    assert (await a.converger.converge(da)).changes == ()


async def test_invalid_peers_skipped_rest_configured_and_dry_run(pair) -> None:
    lab, a, b = pair
    bad = Peer(id="n_bad", public_key="AAAA", mesh_ip="10.100.0.9", allowed_ips=("10.100.0.9/32",))
    da = a.desired([b]).with_peer(bad)
    plan = await a.converger.converge(da, Mode.DRY_RUN)
    assert plan.mode is Mode.DRY_RUN and plan.changes and await a.backend.observe() is None  # nothing applied
    r = await a.converger.converge(da)
    assert r.ok and r.skipped_peers == (("n_bad", "public key 'AAAA' is not base64 of 32 bytes"),)
    assert [row[0] for row in a.wg_dump(lab)[1:]] == [b.public_key]
    # concurrent converges are serialised: the second finds nothing left to do
    r1, r2 = await asyncio.gather(a.converger.converge(da), a.converger.converge(da))
    assert r1.ok and r2.ok and r1.changes == r2.changes == ()


async def test_interface_taken_by_another_link_is_a_clear_error(pair) -> None:
    lab, a, b = pair
    lab.exec(a.lab_node, ["ip", "link", "add", "wg0", "type", "bridge"])
    r = await a.converger.converge(a.desired([b]))
    assert not r.ok and r.changes == ()
    assert r.errors == ("interface wg0 already exists and is a bridge link, not WireGuard: delete it or set "
                        "mesh.interface to another name",)
    assert a.backend.pid is None


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
async def test_events_apply_a_delta_without_reading_the_device_and_the_reconcile_still_finds_drift(pair) -> None:
    """`apply_delta` (the event path) applies only what changed, with no device or link read; drift made by hand
    is not its business and is found by the next full converge."""
    lab, a, b = pair
    da = a.desired([b])
    assert (await b.converger.converge(b.desired([a]))).ok
    assert (await a.converger.converge(da)).ok
    reads = []
    for adapter in (a.backend, a.domain.links):
        real = adapter.observe

        async def counted(real=real):
            reads.append(real)
            return await real()
        adapter.observe = counted

    # two new peers in one delta: one UAPI set, routes merged with b's (10.100.0.2/32 + .3/32 → .2/31)
    _, k3 = keypair()
    _, k4 = keypair()
    grown = da.with_peer(Peer(id="n_3", public_key=k3, mesh_ip="10.100.0.3")).with_peer(
        Peer(id="n_4", public_key=k4, mesh_ip="10.100.0.4", endpoint="10.231.255.4:51820"))
    r = await a.converger.apply_delta(grown)
    assert r.ok and reads == []
    assert {c.detail for c in r.changes} >= {"peer n_3: missing from the device", "peer n_4: missing from the device"}
    live = {row[0]: row for row in a.wg_dump(lab)[1:]}
    assert {k3, k4, b.public_key} == set(live) and live[k4][2] == "10.231.255.4:51820"
    routes = lab.exec(a.lab_node, ["ip", "-j", "route", "show", "dev", "wg0", "table", str(DEFAULT_TABLE)]).stdout
    assert '"10.100.0.2/31"' in routes and '"10.100.0.4"' in routes
    assert ping(lab, a, b.mesh_ip)  # b's traffic kept its route through the merge

    # removal splits the merged route again; b still answers
    shrunk = grown.without_peer("n_3")
    r = await a.converger.apply_delta(shrunk)
    assert r.ok and reads == [] and r.changes[0].correction_type == "peer_removed"
    assert k3 not in {row[0] for row in a.wg_dump(lab)[1:]}
    assert ping(lab, a, b.mesh_ip)

    # drift by hand is invisible to the delta but found and named by the full converge, which reads the device
    lab.exec(a.lab_node, ["wg", "set", "wg0", "peer", k4, "remove"])
    r = await a.converger.apply_delta(shrunk)
    assert r.changes == () and reads == []
    r = await a.converger.converge(shrunk)
    assert corrections(r) == [("peer_added", "peer n_4: missing from the device")] and reads
    assert (await a.converger.converge(shrunk)).changes == ()  # routes in delta form are not drift

    # the device gone (wireguard-go killed, the kernel's deleted): the delta fails and falls back to a full converge
    # that brings it back
    if a.kind == "kernel":
        lab.exec(a.lab_node, ["ip", "link", "del", "wg0"])
    else:
        os.kill(a.backend.pid, signal.SIGKILL)
        await wait_for(a.backend.process_gone, 10, "wireguard-go's death noticed")
    _, k5 = keypair()
    r = await a.converger.apply_delta(shrunk.with_peer(Peer(id="n_5", public_key=k5, mesh_ip="10.100.0.5")))
    created = "interface_created" if a.kind == "kernel" else "userspace_restarted"
    assert r.ok and created in {c.correction_type for c in r.changes}
    assert k5 in {row[0] for row in a.wg_dump(lab)[1:]}


def wg_lines(caplog, node) -> list[tuple[float, str]]:
    """What `node`'s wireguard-go logged (verbose), in order: (when plexd read it, line)."""
    return [(r.created, r.getMessage()) for r in caplog.records
            if r.name == "plexd.machine.wireguard.userspace" and getattr(r, "pid", None) == node.backend.pid]


async def test_two_nodes_that_meet_at_once_handshake_once_led_by_the_lower_key(pair, caplog, monkeypatch) -> None:
    """Both nodes configure each other at the same moment, as one control-plane event makes them (a new peer with
    its endpoint, or the endpoint of a peer already known, in turn). Only the node with the lower public key
    initiates; the other answers, and kicks its own keepalive a beat later
    (`plexd.mesh.first_contact`). If both initiated, both would drop the answer to their own initiation
    ("Received invalid response message") and the tunnel would wait for WireGuard's 5 s retry."""
    lab, a, b = pair
    # The order is read from when plexd read each line: each node's output follower must look often (an idle
    # daemon's looks up to 2 s apart would order two nodes' lines by chance, FOLLOW_DELAY is 1 s).
    monkeypatch.setattr(userspace, "OUTPUT_POLL", 0.01)
    monkeypatch.setattr(userspace, "OUTPUT_POLL_QUIET", 0.01)
    for n in (a, b):
        n.backend.env["LOG_LEVEL"] = "verbose"
        assert (await n.converger.converge(n.desired([]))).ok  # both devices up, as for nodes already meshed
    leader, follower = sorted((a, b), key=lambda n: n.public_key)
    caplog.set_level(logging.INFO, logger="plexd.machine.wireguard.userspace")
    for meeting in range(6):  # each meeting is a race without the rule; six make a miss unlikely
        if meeting % 2:
            # The events' path: each knows the other first without an endpoint (its keepalive off on the device),
            # then both endpoints come at once: keepalive 0 -> 25 with the endpoint must not kick the follower.
            for n, other in ((a, b), (b, a)):
                assert (await n.converger.converge(n.desired([]).with_peer(replace(other.as_peer(),
                                                                                   endpoint="")))).ok
        caplog.clear()
        results = await asyncio.gather(a.converger.converge(a.desired([b])), b.converger.converge(b.desired([a])))
        assert all(r.ok for r in results)
        # the follower's keepalive is held back, and a converge now does not call that drift
        assert (await follower.converger.converge(follower.desired([leader]))).changes == ()
        # (pings in a thread: the event loop must stay free to send the held kick)
        assert await asyncio.to_thread(ping, lab, leader, follower.mesh_ip)
        await asyncio.sleep(FOLLOW_DELAY + 0.5)  # the follower's held kick has gone out
        # wait until the leader's initiation has been read, then a few more looks each, so every line up to now is in
        await wait_for(lambda: any("Sending handshake initiation" in m for _, m in wg_lines(caplog, leader)), 10,
                       "the leader's handshake initiation in its wireguard-go output")
        await asyncio.sleep(0.2)
        logs = {n.public_key: wg_lines(caplog, n) for n in (leader, follower)}
        assert not any("invalid response" in m for lines in logs.values() for _, m in lines), (meeting, logs)
        # The follower initiates only after the leader (when the leader's initiation reached it before it knew
        # the leader, it was dropped as "invalid initiation", and the follower's held kick made the session).
        first = {key: next((t for t, m in lines if "Sending handshake initiation" in m), None)
                 for key, lines in logs.items()}
        assert first[leader.public_key] is not None, (meeting, logs)
        assert first[follower.public_key] is None or first[follower.public_key] > first[leader.public_key], logs
        dump = {row[0]: row for row in follower.wg_dump(lab)[1:]}
        assert dump[leader.public_key][7] == "25"  # the held keepalive is on now
        for n, other in ((a, b), (b, a)):  # part, so that the next meeting starts without a session
            assert (await n.converger.converge(n.desired([]))).ok
            assert other.public_key not in {row[0] for row in n.wg_dump(lab)[1:]}


async def test_a_follower_whose_leader_cannot_reach_it_still_starts_the_tunnel(pair) -> None:
    """The leader has no endpoint for the follower (behind a NAT, say): the follower's held kick goes out alone
    and makes the session, with no traffic to trigger it."""
    lab, a, b = pair
    leader, follower = sorted((a, b), key=lambda n: n.public_key)
    silent = replace(follower.as_peer(), endpoint="")
    assert (await leader.converger.converge(leader.desired([]).with_peer(silent))).ok
    assert (await follower.converger.converge(follower.desired([leader]))).ok
    for _ in range(100):
        dump = {row[0]: row for row in follower.wg_dump(lab)[1:]}
        if dump[leader.public_key][4] != "0":
            break
        await asyncio.sleep(0.1)
    assert dump[leader.public_key][4] != "0", "the follower never handshook"
    assert dump[leader.public_key][7] == "25"
    # the leader learnt the follower's endpoint from its initiation
    assert await asyncio.to_thread(ping, lab, leader, follower.mesh_ip)


async def test_a_new_private_key_sends_its_handshake_initiation_at_once_and_the_peer_then_leads(
        pair, caplog, monkeypatch) -> None:
    """A key rotation's order (`plexd.node.key_rotation`): this device takes the new key, then the peer learns
    it and initiates. The converge that swaps the key kicks every peer, so our initiation under the new key goes
    out then, with no traffic, before the peer knows the key (it drops it), and WireGuard sends no other to it
    for 5 s. Our first data packet would otherwise start one whenever it came, and if that was after the peer
    had learnt the key, the two initiations crossed and both were dropped (the rotation lab lost 4 s of pings)."""
    lab, a, b = pair
    monkeypatch.setattr(userspace, "OUTPUT_POLL", 0.01)
    monkeypatch.setattr(userspace, "OUTPUT_POLL_QUIET", 0.01)
    a.backend.env["LOG_LEVEL"] = "verbose"
    caplog.set_level(logging.INFO, logger="plexd.machine.wireguard.userspace")
    for n, other in ((a, b), (b, a)):
        assert (await n.converger.converge(n.desired([other]))).ok
    assert await asyncio.to_thread(ping, lab, a, b.mesh_ip)
    await asyncio.sleep(0.2)
    caplog.clear()

    a.private_key, a.public_key = keypair()
    r = await a.converger.converge(a.desired([b]))
    assert r.ok and "private_key_updated" in {c.correction_type for c in r.changes}
    await wait_for(lambda: any("Sending handshake initiation" in m for _, m in wg_lines(caplog, a)), 5,
                   "a's handshake initiation under its new key, with no traffic to start one")
    await asyncio.sleep(0.2)  # b has dropped it: a key it does not know
    assert not any("Received handshake response" in m for _, m in wg_lines(caplog, a))

    # b learns the key: the peer re-added under it initiates at once, a answers, and traffic flows
    assert (await b.converger.converge(b.desired([a]))).ok
    assert await asyncio.to_thread(ping, lab, a, b.mesh_ip)
    # plexd reads wireguard-go's lines a moment after they are written: wait for a's answer to b's initiation
    await wait_for(lambda: any("Received handshake initiation" in m for _, m in wg_lines(caplog, a)), 10,
                   "a to log b's handshake initiation under the new key")
    lines = [m for _, m in wg_lines(caplog, a)]
    assert not any("invalid response" in m for m in lines), lines


@pytest.mark.kernel
@pytest.mark.parametrize("pair", ["kernel"], indirect=True)
async def test_a_kernel_set_larger_than_one_netlink_write_lands_whole_and_a_refusal_names_the_device(pair) -> None:
    """The kernel backend sends its SET_DEVICE messages in as few writes as the socket's send buffer takes (212,992
    bytes by default): 3,000 peers need two writes, and all of them reach the device. A message the kernel refuses
    (a listen port another device holds) is a WireGuardError naming the interface and the kernel's reason, and
    leaves the device's port as it was."""
    lab, a, _ = pair
    assert (await a.converger.converge(a.desired([]))).ok
    peers = tuple(PeerUpdate(public_key=keypair()[1], endpoint=f"10.200.{i // 250}.{i % 250 + 1}:51820",
                             allowed_ips=frozenset({f"10.{64 + i // 65536}.{i // 256 % 256}.{i % 256}/32"}),
                             persistent_keepalive=25) for i in range(3000))
    assert sum(map(len, genl.set_requests("wg0", DeviceUpdate(peers=peers)))) > 212_992
    await a.backend.apply(DeviceUpdate(peers=peers))
    listed = lab.exec(a.lab_node, ["wg", "show", "wg0", "peers"]).stdout.split()
    assert sorted(listed) == sorted(p.public_key for p in peers)

    lab.exec(a.lab_node, ["ip", "link", "add", "wg1", "type", "wireguard"])
    lab.exec(a.lab_node, ["wg", "set", "wg1", "listen-port", "4444"])
    lab.exec(a.lab_node, ["ip", "link", "set", "wg1", "up"])  # a kernel device binds its port while it is up
    with pytest.raises(WireGuardError, match=r"WireGuard refused a set on wg0: Address already in use"):
        await a.backend.apply(DeviceUpdate(listen_port=4444, peers=(PeerUpdate(public_key=keypair()[1]),)))
    assert lab.exec(a.lab_node, ["wg", "show", "wg0", "listen-port"]).stdout.strip() == "51820"
