"""Reading what one may not: the secret index through `GET /v1/state` by a caller outside the secrets group.
Callers are real processes under other uids with real groups, so SO_PEERCRED / SO_PEERGROUPS are the real ones."""

from __future__ import annotations

import asyncio
import json

import pytest
from node_api_helpers import (
    TCP_TOKEN,
    node_api_fixture,  # noqa: F401 - provides the node_api fixture
    unix_call,
)
from process_helpers import run_as

pytestmark = pytest.mark.root
OTHER_UID = 64_202
SECRET_KEYS = [{"key": "tls-key", "version": 1}, {"key": "db-password", "version": 4}]


async def test_the_state_summary_hides_secret_keys_from_callers_outside_the_secrets_group(node_api, system_groups):
    (sock_group, sock_gid), (secrets_group, secrets_gid) = system_groups(2)
    served = await node_api(socket_group=sock_group, secrets_group=secrets_group, tcp=True)

    def summary():
        print(json.dumps(unix_call(served.api.socket_path, "GET", "/v1/state")))

    # in the socket's group only: it reads the summary, with no secret key in it (and the list is refused)
    rc, out = await asyncio.to_thread(run_as, summary, OTHER_UID, OTHER_UID, (sock_gid,))
    assert rc == 0, out
    status, doc = json.loads(out)
    assert status == 200 and doc["metadata"] == {"env": "prod"} and doc["data_keys"], doc
    assert doc["secret_keys"] == [], doc
    assert "tls-key" not in out and "db-password" not in out

    # the secrets group (supplementary, then primary) and root see them
    rc, out = await asyncio.to_thread(run_as, summary, OTHER_UID, OTHER_UID, (sock_gid, secrets_gid))
    assert rc == 0 and json.loads(out)[1]["secret_keys"] == SECRET_KEYS, out
    rc, out = await asyncio.to_thread(run_as, summary, OTHER_UID, secrets_gid, (sock_gid,))
    assert rc == 0 and json.loads(out)[1]["secret_keys"] == SECRET_KEYS, out
    assert (await asyncio.to_thread(served.call, "GET", "/v1/state"))[1]["secret_keys"] == SECRET_KEYS

    # on TCP the token grants secrets (§8.1), so it grants their names too
    import httpx

    host, port = served.api.tcp_address
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"http://{host}:{port}/v1/state", headers={"Authorization": f"Bearer {TCP_TOKEN}"})
    assert r.status_code == 200 and r.json()["secret_keys"] == SECRET_KEYS
