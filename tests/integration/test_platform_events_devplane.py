"""The platform dialect's event stream against the REAL reference control plane (`plexd-devplane serve --dialect
platform`): the node registers with the platform's body, and the real EventStream, verifier and EventHandlers take
what the devplane signs: a state change asks for one pull, a signing-key rotation is installed and the next event
verifies with the new key, `rotate_keys` reaches the key rotation, and an unprovisioned bus is pull-only until the
bus is back. Interop of the canonical bytes and the key ids is what this proves; the edge cases are in
tests/security/test_platform_events.py and tests/unit/test_platform_event_stream.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import uuid

import httpx
import pytest
from nacl.public import PrivateKey
from waiting import wait_for

from plexd.base.backoff import Backoff
from plexd.base.clock import Clock
from plexd.controlplane.event_dialects import PULL, platform_events
from plexd.controlplane.event_signing import NonceStore, Verifier, load_signing_key
from plexd.controlplane.event_stream import EventStream
from plexd.controlplane.ledger import EventLedger
from plexd.controlplane.platform_envelope import bearer
from plexd.devplane.harness import Devplane
from plexd.services.event_handlers import EventHandlers
from plexd.state.desired import DesiredState
from plexd.state.desired_store import DesiredStore
from plexd.state.model import SigningKeys


@pytest.fixture(scope="module")
def devplane(tmp_path_factory):
    with Devplane(tmp_path_factory.mktemp("devplane"), keepalive="1s", dialect="platform") as plane:
        yield plane


def register(devplane) -> dict:
    info = devplane.admin.create_token_info()
    body = {"project_id": info["project_id"], "resource_handle": f"edge-{uuid.uuid4().hex[:8]}",
            "bootstrap_token": info["token"], "nonce": str(uuid.uuid4()),
            "public_key": base64.b64encode(os.urandom(32)).decode()}
    resp = httpx.post(f"{devplane.url}/v1/register", json=body, timeout=10)
    assert resp.status_code == 201, resp.text
    return resp.json()


class PlatformNode:
    """The real stream, verifier and handlers of one platform node, as `plexd up` wires them, on a real clock."""

    def __init__(self, devplane, registered: dict, data_dir) -> None:
        clock = Clock()
        self.id = registered["node_id"]
        self.ledger = EventLedger(data_dir / "events.db")
        self.verifier = Verifier(SigningKeys(current=registered["signing_public_key"]),
                                 NonceStore(clock, self.ledger), clock)
        self.refreshes: list[str] = []
        self.rotations: list[str] = []
        store = DesiredStore(DesiredState.initial(
            interface="plexd0", listen_port=51820, mtu=1420,
            private_key=base64.b64encode(bytes(PrivateKey.generate())).decode(), mesh_ip=registered["mesh_ip"]))
        handlers = EventHandlers(store, lambda why: None, lambda why: None, self.verifier, data_dir,
                                 rotate_keys=self.rotations.append, refresh_state=self.refreshes.append)
        self.connects = 0
        token = bearer(self.id, registered["nsk"])
        self.stream = EventStream(
            devplane.url, self.id, lambda: token, self.ledger, self.verifier, handlers.dispatch, clock=clock,
            on_connected=self._connected, backoff=Backoff(base=0.1, cap=1.0), storm_backoff=Backoff(base=0.1, cap=1.0),
            dialect="platform", reprobe_interval=0.5,
            platform=platform_events(self.verifier, data_dir,
                                     lambda: (registered["signing_public_key"], registered["signing_key_id"])))

    def _connected(self) -> None:
        self.connects += 1

    @contextlib.asynccontextmanager
    async def running(self):
        task = asyncio.create_task(self.stream.run())
        try:
            yield self
        finally:
            task.cancel()
            await asyncio.wait({task})
            self.ledger.close(Clock().now().timestamp())


async def test_state_changes_ask_for_a_pull_and_a_rotated_key_verifies_the_next_event(devplane, tmp_path):
    registered = register(devplane)
    node = PlatformNode(devplane, registered, tmp_path)
    async with node.running():
        await wait_for(node.stream.connected.is_set)
        await asyncio.to_thread(devplane.admin.set_metadata, node.id, {"env": "prod"})
        await wait_for(lambda: node.refreshes == [PULL])
        assert node.stream.last_event_id.isdigit() and node.stream.rejected == 0

        await asyncio.to_thread(devplane.admin.rotate_signing_key, "1h")
        await wait_for(lambda: node.verifier.keys.current != registered["signing_public_key"])
        assert load_signing_key(tmp_path) == node.verifier.keys.current
        assert node.verifier.keys.previous == registered["signing_public_key"]  # named, inside its transition
        await asyncio.to_thread(devplane.admin.set_metadata, node.id, {"env": "staging"})
        await wait_for(lambda: node.refreshes == [PULL, PULL])

        await asyncio.to_thread(devplane.admin.request_key_rotation, node.id)
        await wait_for(lambda: len(node.rotations) == 1)
        assert node.stream.rejected == 0, node.stream.rejected_by_reason


async def test_an_unprovisioned_bus_is_pull_only_until_it_is_back(devplane, tmp_path):
    node = PlatformNode(devplane, register(devplane), tmp_path)
    try:
        async with node.running():
            await wait_for(node.stream.connected.is_set)
            await asyncio.to_thread(devplane.admin.set_faults, events_not_provisioned=True)
            await wait_for(lambda: node.stream.pull_only)
            assert node.stream.status()["delivery_mode"] == "pull_only" and node.connects == 1
            attempts = node.stream.attempts
            await asyncio.sleep(1.2)  # re-probed every 0.5 s here (10 minutes by default), no more
            assert 1 <= node.stream.attempts - attempts <= 3
            await asyncio.to_thread(devplane.admin.clear_faults)
            await wait_for(node.stream.connected.is_set)
            assert node.stream.status()["delivery_mode"] == "streaming" and node.connects == 2
    finally:
        devplane.admin.clear_faults()
