"""Attacks on the local Prometheus endpoint (plexd.node.metrics): a scrape without the bearer token, a token file
anybody can read, and a flood of connections that never send a request (slowloris) against its connection cap.

The endpoint is the real one on a real TCP socket. The node it would read is a stand-in (`render` returns one
fixed line) because everything under test is decided before the node is read: the daemon's full scrape path is
tests/e2e/test_metrics_lab.py."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from plexd.base.errors import PlexdError
from plexd.node.metrics import MetricsEndpoint

TOKEN = "s3cret-metrics-token"


class Endpoint(MetricsEndpoint):
    def __init__(self, **kw) -> None:
        super().__init__("127.0.0.1:0", SimpleNamespace(on_timed=lambda observer: None), **kw)
        self.rendered = 0

    async def render(self) -> bytes:
        self.rendered += 1
        self.scrapes += 1
        return b"plexd_stand_in 1\n"


async def wait_for(condition, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def start():
    tasks: list[asyncio.Task] = []

    async def run(endpoint: Endpoint) -> Endpoint:
        task = asyncio.create_task(endpoint.serve())
        tasks.append(task)
        await wait_for(lambda: endpoint.port != 0 or task.done(), 5, "the endpoint to listen")
        if task.done():
            task.result()  # raises what serve() raised
        return endpoint

    yield run
    for task in tasks:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def token_file(tmp_path, mode: int = 0o600, text: str = TOKEN + "\n") -> str:
    path = tmp_path / "metrics.token"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


async def scrape(port: int, headers: str = "") -> tuple[str, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return head, body


async def test_a_scrape_without_the_right_token_is_refused_before_the_node_is_read(tmp_path, start):
    ep = await start(Endpoint(token_file=token_file(tmp_path)))
    for headers in ("", "Authorization: Bearer wrong\r\n", f"Authorization: Basic {TOKEN}\r\n",
                    f"Authorization: Bearer {TOKEN}x\r\n", f"X-Authorization: Bearer {TOKEN}\r\n"):
        head, body = await scrape(ep.port, headers)
        assert head.startswith("HTTP/1.1 401") and 'WWW-Authenticate: Bearer realm="plexd metrics"' in head, \
            (headers, head)
        assert "plexd_stand_in" not in body and "bearer token is required" in body, body
    assert ep.rendered == 0 and ep.refused_auth == 5
    head, body = await scrape(ep.port, f"authorization: bearer {TOKEN}\r\n")
    assert head.startswith("HTTP/1.1 200") and body == "plexd_stand_in 1\n", (head, body)


@pytest.mark.parametrize("mode, problem", [(0o644, "readable or writable by everyone"), (0o600, "is empty")])
async def test_a_token_anybody_can_read_or_an_empty_one_stops_the_endpoint(tmp_path, start, mode, problem):
    path = token_file(tmp_path, mode, "\n" if problem == "is empty" else TOKEN)
    with pytest.raises(PlexdError, match=f"metrics.token_file: {path} .*{problem}"):
        await start(Endpoint(token_file=path))


async def test_without_a_token_file_it_serves_loopback_scrapes(start):
    ep = await start(Endpoint())
    head, body = await scrape(ep.port)
    assert head.startswith("HTTP/1.1 200") and body == "plexd_stand_in 1\n", head


async def test_200_silent_connections_hold_only_the_cap_and_a_scrape_gets_through_after(tmp_path, start):
    ep = await start(Endpoint(token_file=token_file(tmp_path), max_connections=4))
    silent = [await asyncio.open_connection("127.0.0.1", ep.port) for _ in range(4)]
    await wait_for(lambda: ep.active == 4, 5, f"4 connections held (active={ep.active})")
    flood = [await asyncio.open_connection("127.0.0.1", ep.port) for _ in range(196)]
    answers = await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in flood))
    assert all(a.startswith(b"HTTP/1.1 503") and b"too many connections" in a for a in answers), \
        {a[:40] for a in answers}
    assert ep.active == 4 and ep.refused_busy == 196
    # Still full: a scrape is refused, not queued. The 503 is written without reading the request, so the kernel
    # may answer the unread request bytes with a reset instead: either way nothing is served.
    rendered = ep.rendered
    try:
        head, _ = await scrape(ep.port, f"Authorization: Bearer {TOKEN}\r\n")
        assert head.startswith("HTTP/1.1 503"), head
    except ConnectionResetError:
        pass
    assert ep.rendered == rendered and ep.refused_busy == 197
    for _, w in silent + flood:
        w.close()
    await wait_for(lambda: ep.active == 0, 10, f"the silent connections to be released (active={ep.active})")
    head, body = await scrape(ep.port, f"Authorization: Bearer {TOKEN}\r\n")
    assert head.startswith("HTTP/1.1 200") and body == "plexd_stand_in 1\n", head
