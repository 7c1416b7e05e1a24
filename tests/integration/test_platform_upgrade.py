"""service.upgrade in the platform dialect (plexd.controlplane.release_store): the platform serves no releases to
nodes, so a platform node fetches one from `upgrade.release_url`, laid out as a release page, and checks it as
the spec dialect does (its signature under a pinned key, the execution's checksum, `--version`).

Real parts: a real Upgrader and client in the platform dialect, real release zipapps built from this checkout,
served by the REAL devplane in the platform dialect (its /releases stands in for a release page) or, where what
the node sends must be seen, by a real HTTP server that records each request. The restart and the result sent
after it are the dialect-free path of tests/e2e/test_upgrade_lab.py, which also runs one upgrade on a platform
node."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import threading
from pathlib import Path

import pytest
from agentcore_recorder import Recorder, self_signed_ca, serving_tls
from nacl.signing import SigningKey
from upgrade_node import left_behind, upgrade_node

from plexd.controlplane.client import ControlPlaneClient
from plexd.controlplane.client_errors import ControlPlaneError
from plexd.controlplane.platform_actions import action_requests
from plexd.controlplane.release_store import asset_url, shown
from plexd.devplane.harness import Devplane
from plexd.upgrade import signing, zipapp
from plexd.upgrade.upgrader import goarch

RELEASE_KEY = SigningKey.generate()
VERSION = "0.9.2-test"


@pytest.fixture(scope="module")
def platform_dp(tmp_path_factory):
    with Devplane(tmp_path_factory.mktemp("dp"), dialect="platform") as plane:
        yield plane


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[bytes, bytes]:
    """Release VERSION built from this checkout: (the zipapp, its signature by RELEASE_KEY)."""
    path = tmp_path_factory.mktemp("rel") / "good.pyz"
    checksum = zipapp.build(path, version=VERSION)
    return path.read_bytes(), signing.sign(RELEASE_KEY, VERSION, checksum)


@pytest.fixture(scope="module")
def published(platform_dp, release) -> str:
    """The release stored in the devplane, served on its release page; its checksum."""
    data, signature = release
    return platform_dp.admin.put_artifact(VERSION, data, signature=signature)["sha256"]


def node(tmp_path: Path, url: str, release_url: str | None):
    class Plane:  # what upgrade_node reads of a devplane: its URL
        pass

    plane = Plane()
    plane.url = url
    extra = {} if release_url is None else {"release_url": release_url}
    return upgrade_node(plane, "nsk_plexd_not-for-the-release-page", tmp_path, [signing.public_key(RELEASE_KEY)],
                        dialect="platform", **extra)


async def test_a_release_is_installed_from_the_release_page(platform_dp, published, tmp_path):
    up, agent = node(tmp_path, platform_dp.url, f"{platform_dp.url}/releases")
    out = await up.install(VERSION, published, "exec_platform")
    await asyncio.sleep(0)  # the restart it asks for is scheduled on the loop
    assert out.exit_code == 0 and out.deferred and '"status": "installed"' in out.stdout, out
    assert agent.restarts == [f"upgrade to plexd {VERSION}"]
    assert (tmp_path / "releases" / "current").is_symlink()
    assert (tmp_path / "releases" / f"plexd-{VERSION}-{published[:12]}.pyz").is_file()


async def test_without_a_release_url_a_platform_node_refuses_naming_the_setting(platform_dp, published, tmp_path):
    up, agent = node(tmp_path, platform_dp.url, None)
    out = await up.install(VERSION, published, "exec_platform")
    assert out.exit_code == 1 and "upgrade.release_url is empty" in out.stderr, out
    assert "nothing installed" in out.stderr and left_behind(tmp_path) == [] and agent.restarts == []


async def test_a_release_the_page_does_not_have_is_refused(platform_dp, published, tmp_path):
    up, agent = node(tmp_path, platform_dp.url, f"{platform_dp.url}/releases")
    out = await up.install("9.9.9", published, "exec_platform")
    assert out.exit_code == 1 and f"/releases/v9.9.9/plexd-linux-{goarch()}.sig does not exist" in out.stderr, out
    assert left_behind(tmp_path) == [] and agent.restarts == []


async def test_a_checksum_other_than_the_signed_one_is_refused_before_the_release_is_fetched(platform_dp, published,
                                                                                           tmp_path):
    up, agent = node(tmp_path, platform_dp.url, f"{platform_dp.url}/releases")
    out = await up.install(VERSION, "0" * 64, "exec_platform")
    assert out.exit_code == 1 and "release signature refused" in out.stderr, out
    assert left_behind(tmp_path) == [] and agent.restarts == []


class Recording(http.server.ThreadingHTTPServer):
    """A release page on loopback that serves the release, or redirects to where it is (`moved`, as GitHub sends
    its assets to an object store), and records what each request carried."""

    def __init__(self, files: dict[str, bytes], moved: dict[str, str] | None = None) -> None:
        self.files, self.moved, self.seen = files, moved or {}, []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.seen.append((self.path, dict(self.headers)))
        if self.path in self.server.moved:
            self.send_response(302)
            self.send_header("Location", self.server.moved[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self.server.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


async def test_the_release_page_is_sent_nothing_of_the_node(release, tmp_path):
    # The store is not the control plane: no bearer (the node's NSK envelope), no cookie, only what a browser
    # would send. Paths as a GitHub release page lays them out.
    data, signature = release
    asset = f"/v{VERSION}/plexd-linux-{goarch()}"
    stored = "/objects/release-asset?signed=1"
    server = Recording({stored: data, asset + ".sig": signature}, moved={asset: stored})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        up, _ = node(tmp_path, "http://127.0.0.1:9", f"http://127.0.0.1:{server.server_port}/")
        out = await up.install(VERSION, hashlib.sha256(data).hexdigest(), "exec_platform")
    finally:
        server.shutdown()
        server.server_close()
    assert out.exit_code == 0, out
    assert [path for path, _ in server.seen] == [asset + ".sig", asset, stored]  # the redirect followed
    for _, headers in server.seen:
        assert {k.lower() for k in headers} <= {"host", "user-agent", "accept", "accept-encoding", "connection"}, \
            headers


@pytest.mark.parametrize(("moved", "why"), [
    ({"/a": "/a"}, "more than 5 redirects"),
    ({"/a": "file:///etc/passwd"}, "redirected to 'file:///etc/passwd', which is not an http(s) address"),
], ids=["a loop", "another scheme"])
async def test_a_redirect_that_leads_nowhere_usable_is_refused(tmp_path, moved, why):
    asset = f"/v{VERSION}/plexd-linux-{goarch()}.sig"
    server = Recording({}, moved={asset: "/a", **moved})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        up, agent = node(tmp_path, "http://127.0.0.1:9", f"http://127.0.0.1:{server.server_port}")
        out = await up.install(VERSION, "ab" * 32, "exec_platform")
    finally:
        server.shutdown()
        server.server_close()
    assert out.exit_code == 1 and why in out.stderr, out
    assert left_behind(tmp_path) == [] and agent.restarts == []


def test_a_release_page_address_keeps_its_query_and_messages_show_no_query_or_credentials():
    url = asset_url("https://releases.example/plexd/?token=s3cret", "1.4.2", "linux", "amd64.sig")
    assert url == "https://releases.example/plexd/v1.4.2/plexd-linux-amd64.sig?token=s3cret"
    assert shown("https://user:pw@objects.example/a/b?X-Amz-Signature=abc") == "https://objects.example/a/b"


async def test_the_release_page_is_checked_against_the_system_store_not_the_control_planes_ca(tmp_path):
    # The control plane's private CA (api.tls.ca_file) trusts only itself: applied to a public release page it
    # would fail every TLS check. Shown the other way round: a server only that CA vouches for is trusted as the
    # control plane and refused as a release page.
    cert, key = self_signed_ca(tmp_path)
    async with Recorder(ssl_context=serving_tls(cert, key)) as server:
        client = ControlPlaneClient(server.url, ca_file=str(cert), dialect="platform", release_url=server.url)
        try:
            await client.ping()
            with pytest.raises(ControlPlaneError, match=r"(?i)certificate"):
                async with client.open_artifact(VERSION, "linux", "amd64"):
                    pass
        finally:
            await client.aclose()
        assert [r.path for r in server.requests] == ["/v1/health"]


def test_the_platforms_wording_of_an_upgrade_is_read_as_plexds():
    # The platform names a release by its tag and may type its digest; the built-in takes a version and hex
    block = [{"execution_id": "e1", "action": "service.upgrade", "type": "builtin", "status": "pending",
              "parameters": {"version": "v1.4.2", "checksum": "sha256:" + "ab" * 32},
              "requested_at": "2026-12-03T10:00:00Z", "expires_at": "2099-01-01T00:00:00Z"},
             {"execution_id": "e2", "action": "service.upgrade", "type": "builtin", "status": "pending",
              "parameters": {"version": "1.4.2-rc.1", "checksum": "cd" * 32},
              "requested_at": "2026-12-03T10:00:00Z", "expires_at": "2099-01-01T00:00:00Z"},
             {"execution_id": "e4", "action": "service.upgrade", "type": "builtin", "status": "pending",
              "parameters": {"version": "V1.4.2", "checksum": "SHA256:" + "ef" * 32},
              "requested_at": "2026-12-03T10:00:00Z", "expires_at": "2099-01-01T00:00:00Z"},
             {"execution_id": "e3", "action": "shell.run", "type": "hook", "status": "pending",
              "parameters": {"version": "v2"}, "requested_at": "2026-12-03T10:00:00Z",
              "expires_at": "2099-01-01T00:00:00Z"}]
    first, second, upper, other = action_requests(block)
    assert dict(first.parameters) == {"version": "1.4.2", "checksum": "ab" * 32}
    assert dict(second.parameters) == {"version": "1.4.2-rc.1", "checksum": "cd" * 32}
    assert dict(upper.parameters) == {"version": "1.4.2", "checksum": "ef" * 32}
    assert dict(other.parameters) == {"version": "v2"}  # only service.upgrade's parameters are its to read
