"""The daemon's local socket with real Unix sockets: HTTP/1.1 through h11, SO_PEERCRED per request, the socket's
mode, stale-socket removal, Go's plain-text 404/405, bounded bodies, and an unprivileged caller refused (a real
process running as uid 65534)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile

import pytest

from plexd.base.errors import PlexdError
from plexd.node import control_client
from plexd.nodeapi.local_api import ROOT_RESERVE, LocalAPI, Request, Response, require_admin


@pytest.fixture
async def api():
    # not under pytest's tmp_path, whose parents are 0700: the unprivileged test must be able to reach the socket
    base = tempfile.mkdtemp(prefix="pxapi")
    os.chmod(base, 0o755)
    server = LocalAPI(os.path.join(base, "run", "api.sock"), group="px-no-such-group")
    seen: list[Request] = []

    async def hello(req: Request) -> Response:
        seen.append(req)
        return Response(200, {"uid": req.cred.uid if req.cred else None, "body": req.json()})

    server.add("GET", "/v1/daemon/hello", hello, require_admin("px-no-such-group"))
    server.add("POST", "/v1/daemon/hello", hello, require_admin("px-no-such-group"))
    server.add("GET", "/v1/open/", hello)
    await server.start()
    server.seen = seen
    yield server
    await server.stop()
    shutil.rmtree(base)


def call(api, method, path, body=None):
    return control_client.call(api.socket_path, method, path, body)


async def test_requests_carry_the_callers_credentials_and_json(api):
    doc = await asyncio.to_thread(call, api, "POST", "/v1/daemon/hello", {"x": [1, 2]})
    assert doc == {"uid": os.getuid(), "body": {"x": [1, 2]}}
    assert api.seen[-1].cred.pid == os.getpid()
    # keep-alive: two requests on one connection (raw HTTP/1.1)
    reader, writer = await asyncio.open_unix_connection(api.socket_path)
    req = b"GET /v1/open/a HTTP/1.1\r\nHost: x\r\n\r\n"
    writer.write(req + req)
    await writer.drain()
    data = b""
    while data.count(b"HTTP/1.1 200") < 2:
        data += await asyncio.wait_for(reader.read(65536), 5)
    writer.close()


async def test_socket_is_never_world_accessible_and_is_removed_at_stop(api, caplog):
    mode = stat.S_IMODE(os.stat(api.socket_path).st_mode)
    assert mode == 0o600  # the group does not exist: owner only, with a warning
    assert any("group px-no-such-group does not exist" in r.getMessage() for r in caplog.get_records("setup"))
    await api.stop()
    assert not os.path.exists(api.socket_path)


async def test_unknown_path_and_wrong_method_answer_like_go(api):
    with pytest.raises(PlexdError, match=r"404 page not found.*HTTP 404"):
        await asyncio.to_thread(call, api, "GET", "/v1/nothing")
    with pytest.raises(PlexdError, match=r"Method Not Allowed.*HTTP 405"):
        await asyncio.to_thread(call, api, "DELETE", "/v1/daemon/hello")


async def test_bad_bodies_are_refused_by_name(api):
    reader, writer = await asyncio.open_unix_connection(api.socket_path)
    writer.write(b"POST /v1/daemon/hello HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{x}")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), 5)
    assert b"400" in answer.split(b"\r\n")[0] and b"invalid JSON" in answer
    writer.close()
    reader, writer = await asyncio.open_unix_connection(api.socket_path)
    writer.write(b"POST /v1/daemon/hello HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n" + b"[" * 1_100_000)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), 5)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    assert b'"invalid JSON body: larger than 1 MiB' in answer, answer
    writer.close()
    reader, writer = await asyncio.open_unix_connection(api.socket_path)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), 5)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    writer.close()


async def test_a_stale_socket_is_replaced_and_a_live_one_refused(tmp_path):
    path = tmp_path / "api.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # left behind by a crashed daemon: nobody listens
    first = LocalAPI(str(path), group="px-no-such-group")
    await first.start()
    second = LocalAPI(str(path), group="px-no-such-group")
    with pytest.raises(PlexdError, match="another plexd is already serving"):
        await second.start()
    await first.stop()
    path.write_text("not a socket")
    with pytest.raises(PlexdError, match="exists and is not a socket"):
        await LocalAPI(str(path)).start()


def test_no_daemon_is_told_apart_from_a_refusal(tmp_path):
    with pytest.raises(control_client.DaemonNotRunning):
        control_client.call(str(tmp_path / "missing.sock"), "GET", "/v1/daemon/status")


@pytest.mark.root
async def test_an_unprivileged_caller_is_refused_on_its_credentials(api, run_as_nobody):
    """A real process running as uid 65534 (nobody). The socket is opened to it on purpose (0666) so that the
    refusal comes from the SO_PEERCRED check, not from the file mode."""
    os.chmod(api.socket_path, 0o666)

    def client() -> int:
        try:
            control_client.call(api.socket_path, "GET", "/v1/daemon/hello")
        except PlexdError as exc:
            print(exc)
            return 1
        return 0

    rc, out = await asyncio.to_thread(run_as_nobody, client)
    assert rc == 1 and "forbidden: needs root or membership of group px-no-such-group (HTTP 403)" in out, out
    assert api.seen == []
    # the open route lets the same caller in, and it sees its own uid
    rc, out = await asyncio.to_thread(run_as_nobody, lambda: print(control_client.call(api.socket_path, "GET",
                                                                                          "/v1/open/x")))
    assert rc == 0 and "'uid': 65534" in out, out


async def ok_api(tmp_path, **limits) -> LocalAPI:
    """A started API with one open route, GET /v1/x → {"ok": true}."""
    api = LocalAPI(str(tmp_path / "api.sock"), group="px-no-such-group", **limits)

    async def ok(req: Request) -> Response:
        return Response(200, {"ok": True})

    api.add("GET", "/v1/x", ok)
    await api.start()
    return api


async def test_a_slow_client_is_cut_off_and_others_are_served(tmp_path):
    """Slowloris: a request that never finishes is answered 408 and closed after the request timeout; meanwhile
    other clients are answered."""
    api = await ok_api(tmp_path, request_timeout=0.5)
    try:
        reader, writer = await asyncio.open_unix_connection(api.socket_path)
        writer.write(b"GET /v1/x HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        await writer.drain()
        assert await asyncio.to_thread(control_client.call, api.socket_path, "GET", "/v1/x") == {"ok": True}
        answer = await asyncio.wait_for(reader.read(), 5)  # answered and closed by the server, not by us
        assert answer.startswith(b"HTTP/1.1 408") and b'{"error":"request not completed within 0.5s"}' in answer
        writer.close()
    finally:
        await api.stop()


async def test_connections_beyond_the_cap_are_refused_and_the_api_recovers(tmp_path):
    api = await ok_api(tmp_path, max_connections=3)
    try:
        # root's own reserve too (every caller here is root): 3 + ROOT_RESERVE connections fill the door
        held = [await asyncio.open_unix_connection(api.socket_path) for _ in range(3 + ROOT_RESERVE)]
        await asyncio.sleep(0.1)
        with pytest.raises(PlexdError, match=r"too many connections to the local API.*HTTP 503"):
            await asyncio.to_thread(control_client.call, api.socket_path, "GET", "/v1/x")
        for _, w in held:
            w.close()
        await asyncio.sleep(0.1)
        assert await asyncio.to_thread(control_client.call, api.socket_path, "GET", "/v1/x") == {"ok": True}
    finally:
        await api.stop()


async def test_stopping_with_connections_open_logs_no_asyncio_error(tmp_path, caplog):
    # stop() cancels the connections still open (here: one that sent nothing yet, as `plexd deregister` polling
    # for the socket to go away does); asyncio logged each as "Exception in callback ... CancelledError".
    import logging

    api = await ok_api(tmp_path)
    _, writer = await asyncio.open_unix_connection(api.socket_path)
    await asyncio.sleep(0.1)
    with caplog.at_level(logging.ERROR):
        await api.stop()
        await asyncio.sleep(0.1)  # the done-callbacks run
    writer.close()
    assert not [r for r in caplog.records if "Exception in callback" in r.getMessage()], caplog.text
