"""Helpers for the node API attacks in tests/security: the daemon's local API as `plexd up` builds it
(plexd.nodeapi.local_api with the node API routes of plexd.nodeapi), on a real Unix socket and a real TCP listener,
with a real report store on disk, and plain clients for it. A test module imports the `node_api` fixture."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import tempfile

import pytest

from plexd.nodeapi.local_api import LocalAPI
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.routes import NodeApi, add_node_api_routes
from plexd.state.desired import DesiredState
from plexd.state.model import DataEntry, SecretRef

TCP_TOKEN = "tcp-token-5f1c0e9a"


class Served:
    """A started node API: its socket, TCP address, report store and base directory."""

    def __init__(self, api: LocalAPI, base: str, reports: ReportStore) -> None:
        self.api, self.base, self.reports = api, base, reports

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        return unix_call(self.api.socket_path, method, path, body, headers)


def unix_call(sock_path: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
              timeout: float = 30):
    conn = http.client.HTTPConnection("localhost", timeout=timeout)
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock_path)
    conn.sock = s
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data) if data else None
    except ValueError:
        return resp.status, data.decode()


def model() -> DesiredState:
    state = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="",
                                 mesh_ip="10.100.0.9")
    state = state.with_node_state({"env": "prod"}, [DataEntry("db", "application/json", {"host": "db"}, 1,
                                                              "2025-01-15T10:30:00Z")])
    return state.with_secret_refs([SecretRef("tls-key", 1), SecretRef("db-password", 4)])


@pytest.fixture(name="node_api")
async def node_api_fixture(system_groups):
    """`start(**local_api_options, reports=dict(caps))` → a started `Served`; everything is stopped and removed
    afterwards."""
    started: list[Served] = []

    async def start(*, tcp: bool = False, reports: dict | None = None, secrets_group: str = "plexd-secrets",
                    socket_group: str | None = None, **options) -> Served:
        base = tempfile.mkdtemp(prefix="pxsec")
        os.chmod(base, 0o755)  # reachable by the other uids of a test
        store = ReportStore(os.path.join(base, "data"), **(reports or {}))
        group = socket_group or system_groups(1)[0][0]
        api = LocalAPI(os.path.join(base, "api.sock"), group=group, **options)
        add_node_api_routes(api, NodeApi(model, store, _no_secret_fetch, node_secret=lambda: "x" * 32,
                                         secrets_group=secrets_group))
        await api.start()
        if tcp:
            await api.listen_tcp("127.0.0.1", 0, TCP_TOKEN)
        served = Served(api, base, store)
        started.append(served)
        return served

    yield start
    for served in started:
        await served.api.stop()
        shutil.rmtree(served.base, ignore_errors=True)


async def _no_secret_fetch(key: str):
    raise AssertionError("no test here reads a secret value")
