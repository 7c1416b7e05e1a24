"""The real `plexd doctor` and `plexd bugreport` executables, as an operator runs them (PLEXD_CONFIG naming a
config in a temporary directory), against a real devplane, up and down; the control-plane steps (DNS, TCP, TLS,
HTTP) against real servers on loopback.

Stand-ins, each where the real part cannot be had here: a TLS control plane with a certificate of our own and a
Date header we choose (the recording server of tests/integration/agentcore_recorder.py: the devplane serves plain
HTTP with the true time); STUN servers that report the mapping a NAT of each type would make (real UDP, but
loopback has no NAT); a daemon whose status answer leaks the node's private key and secret (the real daemon's
never does: this proves the bug report's scrub catches what a future field might carry).

Checks whose verdict is the host's own (WireGuard, nftables, capabilities, routes, the mesh interface) are
asserted only where the host is known (root: capabilities), never assumed healthy.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import os
import re
import socket
import stat
import sys
import tarfile
import time
from email.utils import formatdate
from pathlib import Path

import pytest
from agentcore_recorder import Recorder, Reply, self_signed_ca, serving_tls

from plexd.base.wgkeys import generate_private_key
from plexd.controlplane.ledger import EventLedger, MirrorChange
from plexd.devplane.harness import Devplane
from plexd.identity.identity_store import Identity, IdentityStore
from plexd.nat.stun import binding_response
from plexd.node.doctor_reach import reach

PLEXD = str(Path(sys.executable).with_name("plexd"))
IS_ROOT = os.geteuid() == 0
SIGNING = base64.b64encode(b"\x05" * 32).decode()


class Node:
    """A config in a temporary directory, and the plexd executable run against it."""

    def __init__(self, tmp_path: Path, api: str, extra: str = "") -> None:
        self.tmp = tmp_path
        self.data = tmp_path / "data"
        self.socket = tmp_path / "api.sock"
        self.token = tmp_path / "bootstrap-token"
        self.config = tmp_path / "config.yaml"
        self.config.write_text(
            f"api: {{url: {api}, allow_insecure: true}}\ndata_dir: {self.data}\nhooks: {{dir: {tmp_path / 'hooks'}}}\n"
            f"node_api: {{socket_path: {self.socket}}}\nmesh: {{interface: pxdoc{os.getpid() % 10000}}}\n{extra}")

    async def run(self, *args: str, env: dict[str, str] | None = None,
                  prefix: tuple[str, ...] = ()) -> tuple[int, str, str, float]:
        full = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(self.config), "PLEXD_TEST_NO_SYSTEMD": "1",
                **(env or {})}
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*prefix, PLEXD, *args, env=full, cwd=self.tmp,
                                                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert "Traceback" not in err.decode(), err.decode()
        return proc.returncode, out.decode(), err.decode(), time.monotonic() - started

    async def doctor(self, **kw) -> tuple[int, dict[str, dict], float]:
        rc, out, _, took = await self.run("doctor", "--json", **kw)
        doc = json.loads(out)
        assert rc == (0 if doc["ok"] else 1)  # exit status 1 exactly when a check failed
        assert doc["ok"] == all(c["verdict"] != "fail" for c in doc["checks"])
        return rc, {c["name"]: c for c in doc["checks"]}, took


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- doctor against the devplane ----------------------------------------------------------------------------------


async def test_doctor_against_a_healthy_devplane(tmp_path, devplane):
    node = Node(tmp_path, devplane.url)
    rc, checks, took = await node.doctor()
    cp = checks["control_plane"]
    assert cp["verdict"] == "warn" and "GET /v1/ping answered 200" in cp["detail"] and "plain http://" in cp["detail"]
    assert "https://" in cp["fix"]
    clock = checks["clock"]
    assert clock["verdict"] == "ok" and "the control plane's (by its Date header), within 5s" in clock["detail"]
    assert checks["mtu"]["verdict"] == "ok" and "route to 127.0.0.1 via lo" in checks["mtu"]["detail"]
    assert checks["stun"]["detail"].startswith("not checked: no STUN servers configured")
    assert checks["systemd"] == {**checks["systemd"], "verdict": "ok",
                                 "detail": "not checked: systemd is not PID 1 here (PLEXD_TEST_NO_SYSTEMD=1)"}
    assert checks["trusted_dirs"]["verdict"] == "ok" and "(not created yet)" in checks["trusted_dirs"]["detail"]
    assert checks["mesh_interface"]["verdict"] == "ok"
    if IS_ROOT:
        assert checks["capabilities"]["verdict"] == "ok"
    assert took < 10

    # in words: one line per check, its verdict first, then the summary
    rc_text, out, _, _ = await node.run("doctor")
    lines = out.splitlines()
    assert rc_text == rc and len(lines) == len(checks) + 1
    assert all(line.split()[0] in ("ok", "warn", "fail") for line in lines[:-1])
    assert any(line.startswith("warn  control_plane") and "-> fix: " in line for line in lines)
    assert lines[-1].startswith(f"{len(checks)} checks: ")


async def test_doctor_with_the_control_plane_down(tmp_path):
    dp = Devplane(tmp_path / "devplane")
    dp.start()
    url = dp.url
    dp.stop()  # its port is closed now: the devplane is down
    node = Node(tmp_path, url)
    rc, checks, took = await node.doctor()
    port = url.rpartition(":")[2]
    assert rc == 1
    cp = checks["control_plane"]
    assert cp["verdict"] == "fail" and f"TCP: connection refused by 127.0.0.1:{port}" in cp["detail"]
    assert "is the control plane running" in cp["fix"]
    assert checks["clock"]["verdict"] == "warn"
    assert checks["clock"]["detail"] == "not checked: the control plane did not answer (TCP)"
    assert took < 10

    rc, out, err, _ = await node.run("doctor")
    line = next(x for x in out.splitlines() if x.startswith("fail  control_plane"))
    assert rc == 1 and "TCP: connection refused" in line and "-> fix: " in line and err == ""


# -- the control plane's steps against real servers ---------------------------------------------------------------


@pytest.fixture
def tls_files(tmp_path):
    return self_signed_ca(tmp_path)


async def test_reach_names_the_step_that_failed(tmp_path, tls_files, devplane):
    cert, key = tls_files
    now = formatdate(usegmt=True)
    async with Recorder(ssl_context=serving_tls(cert, key)) as tls_cp, Recorder() as plain_cp:
        tls_cp.route("GET", "/v1/ping", Reply(200, "{}", {"Date": now}))
        plain_cp.route("GET", "/v1/ping", Reply(503, '{"error":"draining"}', {"Date": now}))
        trusted = await asyncio.to_thread(reach, tls_cp.url, ca_file=str(cert))
        untrusted = await asyncio.to_thread(reach, tls_cp.url)
        tls_to_plain = await asyncio.to_thread(reach, devplane.url.replace("http://", "https://"))
        failing = await asyncio.to_thread(reach, plain_cp.url)
    assert trusted.ok and trusted.tls == "verified" and trusted.address == "127.0.0.1"
    assert trusted.server_date is not None and abs(trusted.server_date - time.time()) < 5
    assert tls_cp.requests[0].headers["user-agent"].endswith("(doctor)")
    assert (untrusted.step, untrusted.ok) == ("TLS", False)
    assert "certificate of 127.0.0.1 is not trusted" in untrusted.error and "api.tls.ca_file" in untrusted.fix
    # uvicorn answers a TLS hello on its plain port with an HTTP 400, which is no TLS record
    assert tls_to_plain.step == "TLS" and "handshake with 127.0.0.1" in tls_to_plain.error, tls_to_plain
    assert "WRONG_VERSION_NUMBER" in tls_to_plain.error and "plain-http server" in tls_to_plain.fix
    assert failing.step == "HTTP" and failing.error == "HTTP: GET /v1/ping answered 503"

    unknown = await asyncio.to_thread(reach, "https://plexd-doctor-test.invalid")
    assert unknown.step == "DNS" and "cannot resolve plexd-doctor-test.invalid" in unknown.error
    refused = await asyncio.to_thread(reach, f"http://127.0.0.1:{free_port()}")
    assert refused.step == "TCP" and "connection refused" in refused.error
    proxy = f"127.0.0.1:{free_port()}"
    proxied = await asyncio.to_thread(reach, "https://cp.example", env={"HTTPS_PROXY": f"http://{proxy}"})
    assert proxied.step == "HTTP" and proxied.error.startswith(f"HTTP through proxy {proxy}: cannot connect")
    assert proxied.address == "127.0.0.1"  # the MTU check follows the path to the proxy


@pytest.mark.root
async def test_doctor_names_the_capabilities_a_root_process_lacks(tmp_path, devplane):
    node = Node(tmp_path, devplane.url)
    drop = ("setpriv", "--bounding-set=-net_admin,-net_raw", "--inh-caps=-net_admin,-net_raw")
    rc, out, _, _ = await node.run("doctor", "--json", prefix=drop)
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert rc == 1 and checks["capabilities"]["verdict"] == "fail"
    assert checks["capabilities"]["detail"] == "this process (uid 0) lacks CAP_NET_ADMIN and CAP_NET_RAW"
    assert "add NET_ADMIN and NET_RAW" in checks["capabilities"]["fix"]
    assert checks["nftables"]["verdict"] == "fail" and "Operation not permitted" in checks["nftables"]["detail"]


async def test_doctor_over_verified_tls_with_a_clock_two_minutes_off(tmp_path, tls_files):
    cert, key = tls_files
    def two_minutes_behind(req):  # the Date of a server whose clock is 120 s behind ours
        return Reply(200, "{}", {"Date": formatdate(time.time() - 120, usegmt=True)})

    async with Recorder(two_minutes_behind, ssl_context=serving_tls(cert, key)) as cp:
        node = Node(tmp_path, cp.url)
        node.config.write_text(node.config.read_text().replace("allow_insecure: true",
                                                               f"tls: {{ca_file: {cert}}}"))
        rc, checks, _ = await node.doctor()
    assert checks["control_plane"]["verdict"] == "ok" and "TLS verified" in checks["control_plane"]["detail"]
    clock = checks["clock"]
    seconds = re.search(r"this clock is about (\d+)s ahead of the control plane's", clock["detail"])
    assert rc == 1 and clock["verdict"] == "fail" and seconds and 118 <= int(seconds.group(1)) <= 122, clock
    assert "timedatectl set-ntp true" in clock["fix"]


# -- STUN: real UDP, answers a NAT of each type would give --------------------------------------------------------


class Stun(asyncio.DatagramProtocol):
    """Answers a Binding request as if a NAT had mapped its source to port + `shift`."""

    def __init__(self, shift: int) -> None:
        self.shift = shift

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.transport.sendto(binding_response(data[8:20], addr[0], addr[1] + self.shift), addr)


@pytest.mark.parametrize("shifts,verdict,words", [
    ((1, 1), "ok", "endpoint-independent NAT mapping"),
    ((1, 2), "warn", "symmetric NAT (a mapping per destination): peers cannot use it, so the relay"),
    ((0, 0), "ok", "no NAT"),
])
async def test_doctor_tells_the_nat_type(tmp_path, devplane, shifts, verdict, words):
    loop = asyncio.get_running_loop()
    servers = []
    for shift in shifts:
        transport, _ = await loop.create_datagram_endpoint(lambda s=shift: Stun(s), local_addr=("127.0.0.1", 0))
        servers.append(transport)
    try:
        listed = ", ".join(f"'127.0.0.1:{t.get_extra_info('sockname')[1]}'" for t in servers)
        node = Node(tmp_path, devplane.url, f"nat_traversal: {{stun_servers: [{listed}]}}\n")
        _, checks, _ = await node.doctor()
    finally:
        for t in servers:
            t.close()
    stun = checks["stun"]
    assert stun["verdict"] == verdict and words in stun["detail"], stun
    assert bool(stun["fix"]) == (verdict != "ok")


async def test_doctor_when_no_stun_server_answers(tmp_path, devplane):
    node = Node(tmp_path, devplane.url, f"nat_traversal: {{stun_servers: ['127.0.0.1:{free_port()}']}}\n")
    rc, checks, took = await node.doctor()
    assert rc == 1 and checks["stun"]["verdict"] == "fail" and "no STUN server answered" in checks["stun"]["detail"]
    assert took < 10


# -- bugreport ----------------------------------------------------------------------------------------------------


def plant_secrets(node: Node) -> dict[str, str]:
    """Every kind of secret a node holds, where plexd keeps it; returns them by name."""
    identity = Identity("n_bug", "10.100.0.9", SIGNING, "node-secret-" + base64.b64encode(os.urandom(24)).decode(),
                        generate_private_key(), "hkdf-sha256")
    IdentityStore(node.data).save(identity)  # private_key, node_secret_key: plexd's own identity code
    secrets = {"private key": identity.private_key_b64, "node secret": identity.node_secret_key,
               "bearer": identity.bearer, "bootstrap token": "plx_enroll_" + os.urandom(12).hex(),
               "secret value": "s3cr3t-value-" + os.urandom(8).hex(),
               "session token": "eyJhbGciOiJFZERTQSJ9." + os.urandom(24).hex() + ".c2lnbmF0dXJl"}
    node.token.write_text(secrets["bootstrap token"] + "\n")
    node.config.write_text(node.config.read_text() + f"token: {{file: {node.token}}}\n")
    cache = node.data / "state"
    (cache / "data").mkdir(parents=True)
    (cache / "secrets.json").write_text(json.dumps([{"key": "db", "version": 1, "value": secrets["secret value"]}]))
    (cache / "data" / "db.json").write_text(json.dumps({"password": secrets["secret value"]}))
    ledger = EventLedger(node.data / "events.db")
    head = {"state": {"sessions": [{"session_id": "s1", "kind": "ssh", "token": secrets["session token"]}]}}
    ledger.write(None, time.time(), MirrorChange(json.dumps(head), [], [], full=True))
    ledger.close(time.time())
    return secrets


@contextlib.asynccontextmanager
async def leaky_daemon(path: Path, leaks: list[str]):
    """A daemon socket whose every answer carries `leaks` (see the module doc)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = (await reader.readline()).decode()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        doc = {"daemon": {"running": True}, "version": 1, "path": request.split()[1], "oops": leaks}
        body = json.dumps(doc).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


def archive_files(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()}


async def test_bugreport_holds_no_secret(tmp_path):
    node = Node(tmp_path, f"http://127.0.0.1:{free_port()}")
    secrets = plant_secrets(node)
    out = tmp_path / "report.tar.gz"
    async with leaky_daemon(node.socket, [secrets["private key"], secrets["node secret"], secrets["bearer"]]):
        rc, text, err, took = await node.run("bugreport", "--output", str(out), "--lines", "50")
    assert rc == 0 and err == "", err
    assert text.splitlines()[0] == f"wrote {out} ({out.stat().st_size} bytes, mode 0600): attach it to the ticket"
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    raw = gzip.decompress(out.read_bytes())  # the whole tar stream: names, headers and every file
    for what, secret in secrets.items():
        assert secret.encode() not in raw, f"the {what} is in the bug report"
        assert base64.b64encode(secret.encode()) not in raw
    files = archive_files(out)
    assert set(files) == {"README.txt", "version.json", "config.json", "status.json", "peers.json", "policies.json",
                          "nftables.json", "routes.json", "rules.json", "log.txt", "doctor.json", "doctor.txt"}
    status = json.loads(files["status.json"])
    assert status["daemon"] == {"running": True} and status["oops"] == ["<redacted>"] * 3
    assert json.loads(files["policies.json"])["path"] == "/v1/daemon/policies"
    assert "6 occurrence(s) of a secret value were replaced" in text  # 3 in status, 3 in policies
    assert took < 20


async def test_bugreport_without_a_daemon(tmp_path):
    node = Node(tmp_path, f"http://127.0.0.1:{free_port()}")
    plant_secrets(node)
    rc, text, _, _ = await node.run("bugreport")  # the default name, in the current directory
    written = Path(text.splitlines()[0].split()[1])
    assert rc == 0 and written.parent == tmp_path and written.name.startswith("plexd-bugreport-")
    files = archive_files(written)
    status = json.loads(files["status.json"])
    assert status["daemon"] == {"running": False} and status["node_id"] == "n_bug"
    assert json.loads(files["policies.json"]) == {"error": "no daemon running: policies are only known to it"}
    assert "does not exist" in json.loads(files["peers.json"])["error"]
    assert files["log.txt"].startswith(b"none: systemd is not PID 1 here")
    doctor = json.loads(files["doctor.json"])
    assert doctor["ok"] is False and any("TCP: connection refused" in c["detail"] for c in doctor["checks"])
    settings = json.loads(files["config.json"])["settings"]
    assert settings["token.file"]["value"] == str(node.token) and settings["data_dir"]["value"] == str(node.data)
    routes = json.loads(files["routes.json"])
    assert isinstance(routes["ipv4"], list) and any(r.get("dev") == "lo" for r in routes["ipv4"])
    readme = files["README.txt"].decode()
    assert "status.json    no daemon running: what data_dir says" in readme


async def test_bugreport_errors_are_one_line(tmp_path):
    node = Node(tmp_path, f"http://127.0.0.1:{free_port()}")
    rc, _, err, _ = await node.run("bugreport", "--lines", "0")
    assert rc == 1 and err == "plexd: --lines 0: give 1 to 100000\n"
    rc, _, err, _ = await node.run("bugreport", "-o", str(tmp_path / "no" / "such" / "dir.tar.gz"))
    assert rc == 1 and err.startswith("plexd: cannot write the bug report ") and err.count("\n") == 1
    assert "No such file or directory" in err
