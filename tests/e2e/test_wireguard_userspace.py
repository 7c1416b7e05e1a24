"""Real wireguard-go in a network namespace, driven over UAPI: set/get, remove, errno, process death and restart."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from mesh_helpers import keypair

from plexd.devplane.lab import Lab
from plexd.machine.wireguard import DeviceUpdate, PeerUpdate, UapiError, WireGuardError
from plexd.machine.wireguard.uapi import _COUNTER_LINES, hex_to_b64
from plexd.machine.wireguard.userspace import UserspaceBackend


@pytest.fixture
def lab():
    lab = Lab().up(1)
    try:
        yield lab
    finally:
        lab.down()
        assert lab.leaks() == []


@pytest.fixture
async def wg(lab):
    node = lab.nodes[0]
    backend = UserspaceBackend("wg0", socket_dir=node.sock_dir, launch_prefix=node.wrap([]))
    try:
        yield backend
    finally:
        await backend.close()


async def test_set_get_and_remove(lab, wg) -> None:
    assert await wg.observe() is None and not wg.process_gone()
    assert await wg.ensure_device() is True
    assert await wg.ensure_device() is False  # already there: adopt, do not start a second one
    priv, _ = keypair()
    _, p1 = keypair()
    _, p2 = keypair()
    psk, _ = keypair()
    await wg.apply(DeviceUpdate(private_key=priv, listen_port=51999, peers=(
        PeerUpdate(public_key=p1, endpoint="10.9.9.9:51820", allowed_ips=frozenset({"10.100.0.2/32", "10.7.0.0/16"}),
                   psk=psk, persistent_keepalive=25),
        PeerUpdate(public_key=p2, allowed_ips=frozenset({"10.100.0.3/32"})),
    )))
    dev = await wg.observe()
    assert dev is not None and dev.listen_port == 51999
    assert dev.peers[p1].endpoint == "10.9.9.9:51820" and dev.peers[p1].psk == psk
    assert dev.peers[p1].allowed_ips == frozenset({"10.100.0.2/32", "10.7.0.0/16"})
    assert dev.peers[p1].persistent_keepalive == 25 and dev.peers[p2].psk == ""
    # the real `wg` tool reads the same device
    dump = lab.exec(lab.nodes[0], ["wg", "show", "wg0", "dump"]).stdout.splitlines()
    assert dump[0].split("\t")[2] == "51999"
    assert {line.split("\t")[0] for line in dump[1:]} == {p1, p2}

    # replace allowed IPs, remove a peer, and update_only never creates a peer
    _, p3 = keypair()
    await wg.apply(DeviceUpdate(peers=(
        PeerUpdate(public_key=p2, remove=True),
        PeerUpdate(public_key=p1, update_only=True, allowed_ips=frozenset({"10.100.0.2/32"})),
        PeerUpdate(public_key=p3, update_only=True, endpoint="10.9.9.8:1"),
    )))
    dev = await wg.observe()
    assert set(dev.peers) == {p1} and dev.peers[p1].allowed_ips == frozenset({"10.100.0.2/32"})


async def test_telemetry_reads_the_real_reply_in_one_pass_and_as_observe_reads_it(wg) -> None:
    """Telemetry's counter rows come from one regex pass over wireguard-go's `get=1` reply, which relies on the line
    order this wireguard-go writes (a reply in another order takes the slower block reader): checked on the real
    one, a peer with an endpoint and a preshared key beside one with neither."""
    await wg.ensure_device()
    priv, _ = keypair()
    _, p1 = keypair()
    _, p2 = keypair()
    psk, _ = keypair()
    await wg.apply(DeviceUpdate(private_key=priv, peers=(
        PeerUpdate(public_key=p1, endpoint="10.9.9.9:51820", allowed_ips=frozenset({"10.100.0.2/32"}), psk=psk,
                   persistent_keepalive=25),
        PeerUpdate(public_key=p2, allowed_ips=frozenset({"10.100.0.3/32", "10.7.0.0/16"})),
    )))
    reply = await wg.uapi._exchange("get=1\n\n")
    assert len(_COUNTER_LINES.findall(reply)) == 2  # the one-pass path, not the fallback
    rows = {hex_to_b64(key): (int(sec) + int(nsec) / 1e9, int(rx), int(tx))
            for key, sec, nsec, tx, rx in await wg.counter_rows()}
    device = await wg.observe()
    # p1's keepalive sends to an address that never answers: its tx may grow between the two reads
    assert set(rows) == set(device.peers) == {p1, p2} and rows[p2] == (0.0, 0, 0)
    assert rows[p1][:2] == (device.peers[p1].last_handshake, device.peers[p1].rx) == (0.0, 0)


async def test_errno_reply_names_the_peer_and_the_device_keeps_working(wg) -> None:
    await wg.ensure_device()
    _, bad = keypair()
    with pytest.raises(UapiError) as info:
        await wg.apply(DeviceUpdate(peers=(PeerUpdate(public_key=bad, endpoint="not-an-ip:51820"),)))
    assert info.value.errno != 0
    assert f"peer {bad[:8]}" in str(info.value) and "endpoint=not-an-ip:51820" in str(info.value)
    assert await wg.uapi.set_raw(["public_key=" + "11" * 32, "allowed_ip=bogus"]) != 0
    _, good = keypair()
    await wg.apply(DeviceUpdate(peers=(PeerUpdate(public_key=good, allowed_ips=frozenset({"10.1.0.1/32"})),)))
    assert good in (await wg.observe()).peers
    assert wg.pid is not None and not wg.process_gone()


async def test_process_death_is_noticed_and_restart_gives_a_fresh_device(lab, wg) -> None:
    await wg.ensure_device()
    _, p1 = keypair()
    await wg.apply(DeviceUpdate(peers=(PeerUpdate(public_key=p1, allowed_ips=frozenset({"10.1.0.1/32"})),)))
    first_pid = wg.pid
    os.kill(first_pid, signal.SIGKILL)
    for _ in range(100):
        if wg.process_gone():
            break
        await asyncio.sleep(0.02)
    assert wg.process_gone()
    assert await wg.observe() is None
    assert await wg.ensure_device() is True
    assert wg.pid != first_pid and wg.restarts == 1 and not wg.process_gone()
    dev = await wg.observe()
    assert dev is not None and dev.peers == {}  # the new process starts empty: converge re-applies everything
    lab.exec(lab.nodes[0], ["ip", "link", "show", "wg0"])


async def test_missing_binary_and_bad_interface_name_are_clear_errors(lab) -> None:
    node = lab.nodes[0]
    missing = UserspaceBackend("wg0", implementation="no-such-wireguard-go", socket_dir=node.sock_dir,
                               launch_prefix=node.wrap([]))
    with pytest.raises(WireGuardError, match=r"'no-such-wireguard-go' was not found.*install wireguard-go"):
        await missing.ensure_device()
    with pytest.raises(WireGuardError, match="1-15 characters"):
        await UserspaceBackend("a-very-long-interface-name", socket_dir=node.sock_dir).ensure_device()
