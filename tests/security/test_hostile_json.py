"""Attack: a 100,000-deep JSON nest where plexd parses outside input. Python's decoder recurses once per level, so
an unbounded json.loads raises RecursionError. Two doors are tried with real parts:

- the local action socket (the real route handlers of `plexd actions run --local` on a real Unix socket, the
  real dispatcher behind them), from root and from an unprivileged caller (uid 65534), whose refusal audit parses
  the body to name the requested action;
- a control plane answering 4xx/5xx with such a body (a real HTTP server; the real client reads the error).

Each must give a clear refusal, and the server keeps serving afterwards."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from plexd.actions.action_routes import ACTIONS_PATH, RUN_PATH, add_action_routes
from plexd.actions.audit import LocalAudit
from plexd.actions.builtins import NodeView
from plexd.actions.dispatcher import ActionDispatcher
from plexd.actions.hooks import HookSet
from plexd.actions.journal import ActionJournal
from plexd.actions.outbox import Outbox
from plexd.config.settings import ActionsConfig
from plexd.controlplane.client import ControlPlaneClient
from plexd.controlplane.client_errors import ControlPlaneError
from plexd.nodeapi.local_api import LocalAPI, require_admin
from plexd.trust.integrity import scan_hooks

DEEP = 100_000
DEEP_ARRAY = b"[" * DEEP + b"]" * DEEP
DEEP_ACTION = b'{"action":' + DEEP_ARRAY + b'}'  # the field the refusal audit reads, 100,001 deep


async def _none(*a):
    return None


async def _status():
    return {"health": {"status": "healthy"}}


@pytest.fixture
async def action_socket():
    # not under pytest's tmp_path, whose parents are 0700: the unprivileged caller must reach the socket
    base = Path(tempfile.mkdtemp(prefix="pxjson"))
    os.chmod(base, 0o755)
    (base / "hooks").mkdir(mode=0o755)
    journal = ActionJournal(base / "actions.db")

    async def publish(scan):
        pass

    async def send(m):
        pass

    hookset = HookSet(str(base / "hooks"), journal, scan_hooks(base / "hooks"), publish)
    view = NodeView(lambda: "n_1", lambda: "10.100.0.1", _status, dict, _none, _none, dict, _none, _none,
                    lambda n: [])
    dispatcher = ActionDispatcher(ActionsConfig(), journal, Outbox(journal, send), hookset, view, lambda: "n_1",
                                  LocalAudit(base / "audit.log"))
    api = LocalAPI(str(base / "run" / "api.sock"), group="px-no-such-group")
    add_action_routes(api, dispatcher, require_admin("px-no-such-group"))
    await api.start()
    os.chmod(api.socket_path, 0o666)  # the unprivileged caller is refused on its credentials, not the file mode
    api.audit_log = base / "audit.log"
    try:
        yield api
    finally:
        await api.stop()
        journal.close()
        shutil.rmtree(base)


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self._path)


def post(path: str, route: str, body: bytes) -> tuple[int, str]:
    conn = _UnixHTTP(path)
    try:
        conn.request("POST", route, body=body, headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        return res.status, res.read().decode("utf-8", "replace")
    finally:
        conn.close()


def still_serving(path: str) -> None:
    conn = _UnixHTTP(path)
    try:
        conn.request("GET", ACTIONS_PATH)
        res = conn.getresponse()
        body = res.read()
        assert res.status == 200 and "builtin_actions" in json.loads(body), (res.status, body[:300])
    finally:
        conn.close()


@pytest.mark.parametrize("body", [DEEP_ARRAY, DEEP_ACTION], ids=["array", "action_field"])
async def test_deep_action_request_from_root_is_a_clear_400(action_socket, body):
    status, text = await asyncio.to_thread(post, action_socket.socket_path, RUN_PATH, body)
    assert status == 400 and "nested deeper than 64 levels" in text, (status, text[:300])
    await asyncio.to_thread(still_serving, action_socket.socket_path)


@pytest.mark.root
@pytest.mark.parametrize("body", [DEEP_ARRAY, DEEP_ACTION], ids=["array", "action_field"])
async def test_deep_action_request_from_an_unprivileged_caller_is_refused_and_audited(action_socket, run_as_nobody,
                                                                                      body):
    """The refusal of a non-root caller names the action it asked for in the audit log, so the body is parsed
    in the authorisation check, before any handler: the door issue 35 found open (RecursionError there)."""

    def client() -> int:
        status, text = post(action_socket.socket_path, RUN_PATH, body)
        print(status, text[:300])
        return 0

    rc, out = await asyncio.to_thread(run_as_nobody, client)
    assert rc == 0 and out.startswith("403 ") and "forbidden: local actions need root" in out, out
    records = [json.loads(line) for line in action_socket.audit_log.read_text().splitlines()]
    assert records and records[-1]["event"] == "refused" and records[-1]["action"] == "", records[-3:]
    await asyncio.to_thread(still_serving, action_socket.socket_path)


class _DeepErrors(BaseHTTPRequestHandler):
    """Every request is answered with the status in the path (/503/...) and a 100,000-deep JSON body."""

    def do_GET(self) -> None:
        self.send_response(int(self.path.strip("/").split("/")[0] or 500))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(DEEP_ARRAY)))
        self.end_headers()
        self.wfile.write(DEEP_ARRAY)

    do_POST = do_GET

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def deep_error_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DeepErrors)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.mark.parametrize("status", [400, 401, 404, 429, 500, 503])
async def test_deep_error_body_from_the_control_plane_is_a_clear_error(deep_error_server, status):
    """The client keeps the first 4 KiB of an error body and looks for its `error` field: 4,096 brackets are
    already four times Python's recursion limit. The result is the project's own error with the body's text as
    its message, and the same client goes on making requests."""
    async with ControlPlaneClient(f"{deep_error_server}/{status}") as client:
        for _ in range(2):
            with pytest.raises(ControlPlaneError) as caught:
                await client.ping()
            assert caught.value.status == status, caught.value
            assert caught.value.message.startswith("[[[["), caught.value.message[:80]
