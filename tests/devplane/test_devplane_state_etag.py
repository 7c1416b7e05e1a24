"""An unchanged state costs next to nothing (issue 32): the devplane answers `GET /state` with an ETag and a 304
when the node asks again with it, and plexd's client reuses the state it parsed before — for a 304, and also for
a control plane without ETags (the Go one) whose answer has the same bytes. A changed state is fetched and parsed
again. Real devplane, real HTTP."""

from __future__ import annotations

import httpx
from devplane_helpers import register

from plexd.controlplane.client import ControlPlaneClient


def test_the_state_carries_an_etag_and_an_unchanged_one_is_a_304(dp):
    node = register(dp)
    first = node.get("state")
    etag = first.headers["ETag"]
    assert first.status_code == 200 and etag.startswith('"')
    again = httpx.get(node.path("state"), headers={**node.headers, "If-None-Match": etag}, timeout=10)
    assert again.status_code == 304 and again.content == b""
    dp.admin.set_metadata(node.id, {"role": "db"})
    changed = httpx.get(node.path("state"), headers={**node.headers, "If-None-Match": etag}, timeout=10)
    assert changed.status_code == 200 and changed.headers["ETag"] != etag and changed.json()["metadata"] == {
        "role": "db"}


async def test_the_client_parses_an_unchanged_state_once(dp):
    node = register(dp)
    async with ControlPlaneClient(dp.url, token=node.secret) as client:
        seen: list[tuple[int, str]] = []

        send = client._http.send

        async def record(method, url, *, headers=None, **kw):  # what went out and what came back, per request
            response = await send(method, url, headers=headers, **kw)
            seen.append((response.status_code, (headers or {}).get("If-None-Match", "")))
            return response

        client._http.send = record
        first = await client.fetch_state(node.id)
        second = await client.fetch_state(node.id)
        assert second is first  # the same parsed value, not parsed again
        assert [s for s, _ in seen] == [200, 304] and seen[1][1]
        dp.admin.set_metadata(node.id, {"role": "web"})
        third = await client.fetch_state(node.id)
        assert third is not first and third.metadata == {"role": "web"}

        # a control plane without ETags: the same bytes are not parsed twice either
        body = '{"peers": [], "policies": []}'
        dp.admin.set_faults(state_body=body)
        try:
            fourth = await client.fetch_state(node.id)
            fifth = await client.fetch_state(node.id)
        finally:
            dp.admin.clear_faults()
        assert fifth is fourth and fourth.peers == () and seen[-1] == (200, "")
