"""Who sends the first handshake (`plexd.mesh.first_contact`): the lower key at once, the other a beat later.

The real wireguard-go side of it is in tests/e2e/test_converge.py; here the bookkeeping, with a recorder for
the device transactions."""

from __future__ import annotations

import asyncio

from plexd.machine.wireguard import DeviceUpdate, PeerConfig, WireGuardError
from plexd.mesh.first_contact import FirstContact, leads
from plexd.mesh.mesh_plan import PeerAdded, PeerKeepaliveChanged, PeerRemoved
from plexd.state.desired import DesiredState

LOW, MID, HIGH = "A" * 43 + "=", "M" * 43 + "=", "z" * 43 + "="


def test_exactly_one_side_of_a_pair_leads() -> None:
    assert leads(LOW, HIGH) and not leads(HIGH, LOW)
    assert leads("", LOW)  # no private key yet: nothing to wait for
    # our own key, as the converger reads it: "" for no key or an unusable one
    own = lambda private: DesiredState.initial(interface="wg0", listen_port=51820, mtu=1420,  # noqa: E731
                                               private_key=private, mesh_ip="10.100.0.1").public_key
    assert own("not base64!") == "" and own("QUJD") == ""  # not a 32-byte key
    assert len(own("QA" * 21 + "A=")) == 44


async def test_held_kicks_go_out_later_in_one_transaction_and_forgotten_ones_do_not() -> None:
    sent: list[DeviceUpdate] = []

    async def send(update: DeviceUpdate) -> None:
        sent.append(update)

    fc = FirstContact(send, delay=0.05)
    assert fc.hold(MID, {HIGH: 25}) == frozenset()  # we lead: nothing held, nothing scheduled
    assert fc.hold(MID, {LOW: 25, "B" * 43 + "=": 10}) == {LOW, "B" * 43 + "="}
    # a held peer's keepalive reads 0 until its kick: not drift; another value is
    assert fc.hides(PeerKeepaliveChanged("n_low", LOW, 25, 0), fc.pending())
    assert not fc.hides(PeerKeepaliveChanged("n_low", LOW, 30, 0), fc.pending())
    assert not fc.hides(PeerKeepaliveChanged("n_high", HIGH, 25, 0), fc.pending())
    fc.applied([PeerRemoved("n_b", "B" * 43 + "=")])  # removed meanwhile: no kick for it
    # the hold's own change (a peer known before its endpoint: its keepalive 0 -> 25 in the same transaction) is
    # applied with the keepalive left off, and the hold stays for the kick
    fc.applied([PeerKeepaliveChanged("n_low", LOW, 25, 0)])
    assert LOW in fc.held
    await asyncio.sleep(0.2)
    (update,) = sent
    assert [(p.public_key, p.update_only, p.persistent_keepalive) for p in update.peers] == [
        (LOW, True, 0), (LOW, True, 25)]  # off, then on: WireGuard sends at once
    assert fc.held == {} and not fc.hides(PeerKeepaliveChanged("n_low", LOW, 25, 0), fc.pending())


async def test_a_failed_kick_is_logged_and_cancel_drops_what_is_held(caplog) -> None:
    async def send(update: DeviceUpdate) -> None:
        raise WireGuardError("the device is gone")

    fc = FirstContact(send, delay=0.01)
    fc.hold(MID, {LOW: 25})
    await asyncio.sleep(0.1)
    assert "could not turn on the keepalive of 1 peer(s)" in caplog.text and "the device is gone" in caplog.text
    fc.hold(MID, {LOW: 25})
    fc.applied([PeerKeepaliveChanged("n_low", LOW, 30, 0)])  # set to another value since: that is not held
    assert fc.held == {}
    fc.hold(MID, {LOW: 25})
    fc.cancel()
    assert fc.held == {}


async def test_the_hold_outlives_the_changes_that_come_with_it_and_a_second_hold_keeps_its_time() -> None:
    sent: list[DeviceUpdate] = []

    async def send(update: DeviceUpdate) -> None:
        sent.append(update)

    fc = FirstContact(send, delay=0.2)
    fc.hold(MID, {LOW: 25})
    # the mesh's keepalive changed with the endpoint (30 -> 25 on the device): still the held value, still held
    fc.applied([PeerKeepaliveChanged("n_low", LOW, 25, 30)])
    # the key moved to another peer id in one transaction (removed and added back): the new peer's hold stays
    fc.applied([PeerRemoved("n_old", LOW), PeerAdded("n_low", LOW, PeerConfig(public_key=LOW))])
    assert LOW in fc.held
    # an endpoint changing again before the kick does not push the kick back
    due = fc.held[LOW][1]
    await asyncio.sleep(0.1)
    fc.hold(MID, {LOW: 25})
    assert fc.held[LOW][1] == due
    await asyncio.sleep(0.25)
    assert [(p.public_key, p.persistent_keepalive) for p in sent[0].peers] == [(LOW, 0), (LOW, 25)]


async def test_a_kick_pending_when_the_device_was_read_hides_its_keepalive_even_once_applied() -> None:
    """The kernel tier's drift test reported `peer n_2: persistent keepalive 0 != 25` for a peer nobody touched: a
    full converge read the device (keepalive still off) while the kick, already taken off the hold, waited for the
    device lock, and the kick was applied before the converge planned. What counts is what was pending at the read:
    the domain takes `pending()` just before it reads the device."""
    gate = asyncio.Event()
    sent: list[DeviceUpdate] = []

    async def send(update: DeviceUpdate) -> None:
        await gate.wait()  # the device lock, held by a converge
        sent.append(update)

    fc = FirstContact(send, delay=0.01)
    fc.hold(MID, {LOW: 25})
    await asyncio.sleep(0.05)
    assert LOW not in fc.held and not sent  # due, on its way
    at_read = fc.pending()  # a converge reads the device now: keepalive 0
    assert fc.hides(PeerKeepaliveChanged("n_low", LOW, 25, 0), at_read)
    assert not fc.hides(PeerKeepaliveChanged("n_low", LOW, 30, 0), at_read)
    gate.set()
    await asyncio.sleep(0.01)
    assert sent and fc.pending() == {}
    # the kick went out between the read and the plan: the 0 that read saw is still the hold's, not drift
    assert fc.hides(PeerKeepaliveChanged("n_low", LOW, 25, 0), at_read)
    # a read after the kick that finds 0 again is drift
    assert not fc.hides(PeerKeepaliveChanged("n_low", LOW, 25, 0), fc.pending())
