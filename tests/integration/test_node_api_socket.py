"""The §8 node API on a real Unix socket (and the TCP listener), served from a real report store on disk, with
secrets fetched live from a real devplane. Callers are real processes: root, and forked children running under
other uids whose groups are real groups (groupadd), so the SO_PEERCRED / SO_PEERGROUPS checks are the real ones.

The daemon around it (events, the cache files, report sync) is tests/e2e/test_node_api_lab.py."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.public import PrivateKey
from process_helpers import run_as

from plexd.base.ratelimit import RateLimiter
from plexd.controlplane.client import ControlPlaneClient
from plexd.devplane.harness import Devplane
from plexd.nodeapi.keys import MAX_KEY_BYTES
from plexd.nodeapi.local_api import LocalAPI
from plexd.nodeapi.reports import ReportStore
from plexd.nodeapi.routes import NodeApi, add_node_api_routes
from plexd.state.desired import DesiredState
from plexd.state.model import DataEntry, SecretRef

pytestmark = pytest.mark.root
OTHER_UID = 64_201


@pytest.fixture(scope="module")
def devplane_node(tmp_path_factory):
    """A devplane and one node registered on it: (devplane, node id, node secret)."""
    with Devplane(tmp_path_factory.mktemp("dp")) as dp:
        token = dp.admin.create_token()
        pub = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
        r = httpx.post(f"{dp.url}/v1/register", json={"token": token, "public_key": pub, "hostname": "api-test"},
                       headers={"Authorization": f"Bearer {token}"}, timeout=10)
        r.raise_for_status()
        yield dp, r.json()["node_id"], r.json()["node_secret_key"]


class Served:
    """A started node API: the socket, its base dir, the report store and the model it serves."""

    def __init__(self, api: LocalAPI, base: str, reports: ReportStore, changed: list[str]) -> None:
        self.api, self.base, self.reports, self.changed = api, base, reports, changed

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             ) -> tuple[int, object]:
        return raw_call(self.api.socket_path, method, path, body, headers)


def raw_call(sock_path: str, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None) -> tuple[int, object]:
    conn = http.client.HTTPConnection("localhost", timeout=10)
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    conn.sock = s
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(data) if data else None
    except ValueError:
        return resp.status, data.decode()


@pytest.fixture
async def served(devplane_node, system_groups):
    dp, node_id, secret = devplane_node
    (sock_group, sock_gid), (secrets_group, secrets_gid) = system_groups(2)
    base = tempfile.mkdtemp(prefix="pxnodeapi")
    os.chmod(base, 0o755)  # reachable by the other uids (pytest's tmp_path parents are 0700)
    changed: list[str] = []
    reports = ReportStore(os.path.join(base, "data"), on_change=changed.append)
    model = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="", mesh_ip="10.100.0.9")
    model = model.with_node_state({"env": "prod", "zone": "a"}, [
        DataEntry("db", "application/json", {"host": "db.internal"}, 3, "2025-01-15T10:30:00Z")])
    model = model.with_secret_refs([SecretRef("tls-key", 1)])
    client = ControlPlaneClient(dp.url, token=secret)
    api = LocalAPI(os.path.join(base, "api.sock"), group=sock_group, request_timeout=1.0)
    add_node_api_routes(api, NodeApi(lambda: model, reports, lambda key: client.fetch_secret(node_id, key),
                                     node_secret=lambda: secret, secrets_group=secrets_group))
    await api.start()
    s = Served(api, base, reports, changed)
    s.dp, s.node_id, s.sock_gid, s.secrets_gid = dp, node_id, sock_gid, secrets_gid
    yield s
    await api.stop()
    await client.aclose()
    shutil.rmtree(base)


def in_thread(fn, *args):
    return asyncio.to_thread(fn, *args)


# -- reading what the control plane knows ---------------------------------------------------------------------

async def test_summary_metadata_and_data_as_the_go_agent_serves_them(served):
    status, doc = await in_thread(served.call, "GET", "/v1/state")
    assert status == 200
    assert doc == {"metadata": {"env": "prod", "zone": "a"},
                   "data_keys": [{"key": "db", "version": 3, "content_type": "application/json"}],
                   "secret_keys": [{"key": "tls-key", "version": 1}], "report_keys": []}
    assert await in_thread(served.call, "GET", "/v1/state/metadata/zone") == (200, {"key": "zone", "value": "a"})
    assert await in_thread(served.call, "GET", "/v1/state/metadata/nope") == (404, {"error": "not found"})
    status, entry = await in_thread(served.call, "GET", "/v1/state/data/db")
    assert status == 200 and entry["payload"] == {"host": "db.internal"} and entry["version"] == 3
    # Go's plain-text 404 and 405
    assert await in_thread(served.call, "GET", "/v1/state/nothing") == (404, "404 page not found\n")
    assert await in_thread(served.call, "POST", "/v1/state/metadata") == (405, "Method Not Allowed\n")


async def test_secrets_are_fetched_live_decrypted_and_gated_by_group(served):
    served.dp.admin.set_secret(served.node_id, "tls-key", "s3cr3t-plaintext-v1")
    assert await in_thread(served.call, "GET", "/v1/state/secrets/tls-key") == (
        200, {"key": "tls-key", "value": "s3cr3t-plaintext-v1", "version": 1})
    served.dp.admin.set_secret(served.node_id, "tls-key", "rotated-v2")  # never cached: the next read is live
    assert (await in_thread(served.call, "GET", "/v1/state/secrets/tls-key"))[1]["value"] == "rotated-v2"
    assert await in_thread(served.call, "GET", "/v1/state/secrets/missing") == (404, {"error": "not found"})

    def read(path):
        def go():
            print(json.dumps(raw_call(served.api.socket_path, "GET", path)))
        return go

    forbidden = [403, {"error": "forbidden: insufficient privileges for secret access"}]
    # in the socket's group only: the socket lets it in, the secret routes do not (the list included)
    for path in ("/v1/state/secrets/tls-key", "/v1/state/secrets"):
        rc, out = await in_thread(run_as, read(path), OTHER_UID, OTHER_UID, (served.sock_gid,))
        assert rc == 0 and json.loads(out) == forbidden, out
    # plexd-secrets as a supplementary group, then as the primary group
    rc, out = await in_thread(run_as, read("/v1/state/secrets/tls-key"), OTHER_UID, OTHER_UID,
                              (served.sock_gid, served.secrets_gid))
    assert rc == 0 and json.loads(out) == [200, {"key": "tls-key", "value": "rotated-v2", "version": 2}], out
    rc, out = await in_thread(run_as, read("/v1/state/secrets"), OTHER_UID, served.secrets_gid, (served.sock_gid,))
    assert rc == 0 and json.loads(out) == [200, [{"key": "tls-key", "version": 1}]], out
    # but everyone in the socket's group reads the rest
    rc, out = await in_thread(run_as, read("/v1/state/metadata"), OTHER_UID, OTHER_UID, (served.sock_gid,))
    assert rc == 0 and json.loads(out) == [200, {"env": "prod", "zone": "a"}], out


async def test_a_secret_is_503_while_the_control_plane_is_away(served):
    served.dp.admin.set_faults(all_status=503)
    try:
        assert await in_thread(served.call, "GET", "/v1/state/secrets/tls-key") == (
            503, {"error": "control plane unavailable"})
    finally:
        served.dp.admin.clear_faults()


# -- report entries ---------------------------------------------------------------------------------------------

def put(served, key, body, if_match=None):
    headers = {"Content-Type": "application/json"}
    if if_match is not None:
        headers["If-Match"] = if_match
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return served.call("PUT", f"/v1/state/report/{key}", raw, headers)


async def test_if_match_rules_and_node_assigned_versions(served):
    body = {"content_type": "application/json", "payload": {"status": "healthy"}}
    status, entry = await in_thread(put, served, "app", body, "0")  # 0: only if new
    assert status == 200 and entry["version"] == 1 and entry["payload"] == {"status": "healthy"}
    assert await in_thread(put, served, "app", body, "0") == (409, {
        "error": "version conflict: If-Match 0, the entry is at version 1"})
    status, entry = await in_thread(put, served, "app", {**body, "version": 99}, "1")  # the client cannot set it
    assert status == 200 and entry["version"] == 2
    assert (await in_thread(put, served, "app", body, "1"))[0] == 409
    assert (await in_thread(put, served, "app", body))[1]["version"] == 3  # absent: unconditional
    assert (await in_thread(put, served, "new", body, "5"))[0] == 409  # not there: only 0 is accepted
    assert await in_thread(served.call, "GET", "/v1/state/report") == (200, [{"key": "app", "version": 3}])
    # kept on disk as the Go agent keeps it, 0600, found again by a fresh store
    path = os.path.join(served.base, "data", "state", "report", "app.json")
    assert os.stat(path).st_mode & 0o777 == 0o600 and json.loads(Path(path).read_text())["version"] == 3
    again = ReportStore(os.path.join(served.base, "data"))
    assert again.load() == 1 and again.get("app").payload == {"status": "healthy"}
    assert await in_thread(served.call, "DELETE", "/v1/state/report/app") == (204, None)
    assert await in_thread(served.call, "DELETE", "/v1/state/report/app") == (404, {"error": "not found"})
    assert not os.path.exists(path)
    assert served.changed == ["app"] * 8  # every change queued for the control plane: before its write, and after


@pytest.mark.parametrize(("key", "problem"), [
    ("a%2Fb", "key contains a path separator"), ("a%5Cb", "key contains a path separator"),
    ("..", "is a path component"), ("%2E%2E", "is a path component"), ("a%00b", "control character"),
    ("x" * 300, f"the limit is {MAX_KEY_BYTES}"), ("%ff", "not valid UTF-8"), ("", "key is empty"),
])
async def test_bad_report_keys_are_refused_by_name(served, key, problem):
    status, doc = await in_thread(put, served, key, {"content_type": "text/plain", "payload": "x"})
    assert status == 400 and doc["error"].startswith("invalid report key") and problem in doc["error"], doc
    assert not os.path.exists(os.path.join(served.base, "data", "state", "report")) or \
        os.listdir(os.path.join(served.base, "data", "state", "report")) == []


async def test_a_key_with_a_slash_in_the_path_is_400_not_a_file_elsewhere(served):
    status, doc = await in_thread(put, served, "../../etc/x", {"content_type": "text/plain", "payload": "x"})
    assert status == 400 and "path separator" in doc["error"]


@pytest.mark.parametrize(("body", "headers", "expected"), [
    (b"{not json", {}, "invalid JSON body"),
    (b"[1, 2]", {}, "invalid JSON body: must be a JSON object"),
    (b'{"payload": {}}', {}, "content_type is required"),
    (b'{"content_type": "", "payload": {}}', {}, "content_type is required"),
    (b'{"content_type": "application/json"}', {}, "payload must be valid JSON"),
    (b'{"content_type": "t", "payload": 1}', {"If-Match": '"3"'}, "If-Match must be an integer"),
    (b'{"content_type": "t", "payload": 1}', {"If-Match": "3.0"}, "If-Match must be an integer"),
])
async def test_bad_report_bodies_get_the_documented_400(served, body, headers, expected):
    status, doc = await in_thread(served.call, "PUT", "/v1/state/report/k", body, headers)
    assert status == 400 and doc["error"].startswith(expected), doc
    assert served.reports.get("k") is None


async def test_a_body_over_1_mib_is_refused_and_others_are_served(served):
    big = json.dumps({"content_type": "text/plain", "payload": "x" * (1 << 20)}).encode()
    status, doc = await in_thread(served.call, "PUT", "/v1/state/report/big", big)
    assert status == 400 and doc == {"error": "invalid JSON body: larger than 1 MiB (1048576 bytes)"}
    assert (await in_thread(served.call, "GET", "/v1/state"))[0] == 200


async def test_slowloris_is_timed_out_while_others_are_served(served):
    reader, writer = await asyncio.open_unix_connection(served.api.socket_path)
    writer.write(b"PUT /v1/state/report/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    await writer.drain()
    for _ in range(3):
        assert (await in_thread(served.call, "GET", "/v1/state/metadata"))[0] == 200
    answer = await asyncio.wait_for(reader.read(), 5)
    assert answer.startswith(b"HTTP/1.1 408") and b'"request not completed within 1s"' in answer, answer
    writer.close()
    assert served.reports.get("slow") is None


async def test_clients_that_never_read_their_answers_are_dropped_and_root_keeps_a_door(served):
    """A group member asked for a big entry on every connection slot and never read: each connection was held for
    good (the write waited on the client), and every later caller, root included, got 503."""
    served.api.max_connections = 4
    big = json.dumps({"content_type": "text/plain", "payload": "x" * 900_000}).encode()
    assert (await in_thread(served.call, "PUT", "/v1/state/report/big", big))[0] == 200
    path, hold_for = served.api.socket_path, 4.0

    def hog():  # another uid in the socket's group: four connections, a request on each, nothing read
        import time
        socks = []
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(b"GET /v1/state/report/big HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
        print("holding", flush=True)
        time.sleep(hold_for)
    hogging = asyncio.ensure_future(in_thread(run_as, hog, OTHER_UID, OTHER_UID, (served.sock_gid,)))
    try:
        deadline = asyncio.get_running_loop().time() + 5
        while len(served.api._connections) < 4 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert len(served.api._connections) == 4
        # root is answered while the slots are full
        assert (await in_thread(served.call, "GET", "/v1/state/metadata"))[0] == 200

        def other_uid_call():
            print(raw_call(path, "GET", "/v1/state/metadata")[0])
        # after request_timeout (1 s here) the hogs are dropped, still connected and unread, and another uid is
        # served again
        await asyncio.sleep(2.0)
        assert not hogging.done()
        rc, out = await in_thread(run_as, other_uid_call, OTHER_UID, OTHER_UID, (served.sock_gid,))
        assert rc == 0 and out.strip() == "200", out
    finally:
        rc, out = await hogging
    assert rc == 0 and "holding" in out


async def test_a_reader_that_pauses_gets_its_whole_answer_while_slots_are_to_spare(served):
    # A pager that stops reading for longer than request_timeout (1 s here) is no hog while nobody waits for its
    # slot: its answer must not be cut short.
    big = json.dumps({"content_type": "text/plain", "payload": "y" * 900_000}).encode()
    assert (await in_thread(served.call, "PUT", "/v1/state/report/big", big))[0] == 200

    def slow_reader():
        import time
        s = socket.socket(socket.AF_UNIX)
        s.connect(served.api.socket_path)
        s.sendall(b"GET /v1/state/report/big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        time.sleep(2.5)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        return data
    data = await in_thread(slow_reader)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["payload"] == "y" * 900_000


async def test_head_is_answered_with_gets_headers_and_no_body(served):
    def head(path):
        conn = http.client.HTTPConnection("localhost", timeout=10)
        s = socket.socket(socket.AF_UNIX)
        s.connect(served.api.socket_path)
        conn.sock = s
        conn.request("HEAD", path)
        resp = conn.getresponse()
        out = resp.status, resp.getheader("content-length"), resp.read()
        conn.request("GET", path)  # the same connection goes on: the HEAD's answer was framed right
        again = conn.getresponse()
        out += (again.status, len(again.read()))
        conn.close()
        return out
    status, length, body, then, got = await in_thread(head, "/v1/state/metadata")
    assert status == 200 and body == b"" and then == 200 and int(length) == got > 0
    assert (await in_thread(head, "/v1/nowhere"))[:3] == (404, "19", b"")


async def test_a_report_with_a_lone_surrogate_is_a_400_naming_it(served):
    for body in (b'{"content_type": "text/plain", "payload": "x\\ud800y"}',
                 b'{"content_type": "text/\\udfff", "payload": 1}'):
        status, doc = await in_thread(served.call, "PUT", "/v1/state/report/k1", body)
        assert status == 400 and "lone surrogate" in doc["error"], doc
    assert served.reports.get("k1") is None


@settings(max_examples=60, deadline=None)
@given(header=st.text(max_size=30))
def test_if_match_header_hypothesis(header):
    """Any If-Match value: a bare integer is a version, anything else is the documented 400 (never a 500)."""
    from plexd.nodeapi.local_api import LocalAPIError, Request
    from plexd.nodeapi.routes import _if_match

    req = Request("PUT", "/v1/state/report/k", {}, {"if-match": header}, b"", None)
    stripped = header.strip()
    if stripped.isascii() and stripped.isdigit() and len(stripped) <= 18:
        assert _if_match(req) == int(stripped)
    else:
        with pytest.raises(LocalAPIError) as err:
            _if_match(req)
        assert err.value.status == 400 and err.value.message.startswith("If-Match must be an integer")


# -- fair use and the TCP listener -------------------------------------------------------------------------------

async def test_rate_limit_is_per_uid(served):
    served.api.rate_limit = RateLimiter(rate=0.2, burst=3)
    codes = [(await in_thread(served.call, "GET", "/v1/state/metadata"))[0] for _ in range(5)]
    assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
    status, doc = await in_thread(served.call, "GET", "/v1/state/metadata")
    assert status == 429 and doc["error"].startswith("rate limit exceeded: at most 0.2 requests per second")

    def other():
        print(raw_call(served.api.socket_path, "GET", "/v1/state/metadata")[0])
    rc, out = await in_thread(run_as, other, OTHER_UID, OTHER_UID, (served.sock_gid,))
    assert rc == 0 and out.strip() == "200", out  # another uid has its own bucket


async def test_tcp_listener_needs_the_bearer_token(served):
    await served.api.listen_tcp("127.0.0.1", 0, "tok-123")
    host, port = served.api.tcp_address
    url = f"http://{host}:{port}/v1/state/metadata"
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(url)
        assert (r.status_code, r.json()) == (401, {"error": "unauthorized"})
        r = await http.get(url, headers={"Authorization": "Bearer wrong"})
        assert (r.status_code, r.json()) == (401, {"error": "unauthorized"})
        r = await http.get(url, headers={"Authorization": "bearer tok-123"})  # the scheme is case-insensitive
        assert (r.status_code, r.json()) == (200, {"env": "prod", "zone": "a"})
        # the token grants secrets (no group check on TCP), but never the daemon's control routes
        r = await http.get(f"http://{host}:{port}/v1/state/secrets", headers={"Authorization": "Bearer tok-123"})
        assert r.status_code == 200
        r = await http.get(f"http://{host}:{port}/v1/daemon/status", headers={"Authorization": "Bearer tok-123"})
        assert r.status_code == 404


async def test_tcp_listener_refuses_an_empty_token(served):
    from plexd.base.errors import PlexdError

    with pytest.raises(PlexdError, match="the token is empty"):
        await served.api.listen_tcp("127.0.0.1", 0, "")
