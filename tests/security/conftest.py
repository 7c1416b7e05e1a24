"""What the attacks in tests/security aim at: the daemon's local API as `plexd up` builds it (plexd.node.local_api
with the node API routes of plexd.nodeapi), on a real Unix socket and a real TCP listener, with a real report
store on disk. Each test is an attack that must fail."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from node_api_helpers import TCP_TOKEN, Served, model

from plexd.node.local_api import LocalAPI
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.routes import NodeApi, add_node_api_routes


@pytest.fixture
async def node_api(system_groups):
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
