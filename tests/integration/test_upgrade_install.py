"""The install half of service.upgrade (plexd.upgrade.upgrader.Upgrader.install) against the REAL devplane over
HTTP, with real release zipapps built from this checkout and run by this Python. The agent around it is a small
stand-in that records the restart it is asked for: the restart itself (re-exec, watcher, rollback) is shown with
real daemons in tests/e2e/test_upgrade_lab.py.

Every refusal must leave nothing installed: no release file, no `.part`, no `current` link, no marker. Releases
are signed with a release key made for this module and pinned in the node's upgrade.release_keys; the attacks on
signatures, checksums and versions are in tests/security/test_signed_upgrade.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
from nacl.signing import SigningKey
from upgrade_node import Agent, left_behind, upgrade_node

from plexd.upgrade import marker as markers
from plexd.upgrade import signing, zipapp
from plexd.upgrade.upgrader import Upgrader

RELEASE_KEY = SigningKey.generate()


def put_signed(devplane, version: str, data: bytes) -> str:
    """Store `data` as release `version` with its signature by RELEASE_KEY; returns its checksum."""
    checksum = hashlib.sha256(data).hexdigest()
    devplane.admin.put_artifact(version, data, signature=signing.sign(RELEASE_KEY, version, checksum))
    return checksum


@pytest.fixture(scope="module")
def good(devplane, tmp_path_factory) -> tuple[str, str]:
    """A release 0.9.1-test stored in the devplane: (version, checksum)."""
    path = tmp_path_factory.mktemp("rel") / "good.pyz"
    checksum = zipapp.build(path, version="0.9.1-test")
    assert put_signed(devplane, "0.9.1-test", path.read_bytes()) == checksum
    return "0.9.1-test", checksum


def upgrader(devplane, secret: str, tmp_path: Path, **upgrade: object) -> tuple[Upgrader, Agent]:
    return upgrade_node(devplane, secret, tmp_path, [signing.public_key(RELEASE_KEY)], **upgrade)


installed = left_behind


async def install(up: Upgrader, version: str, checksum: str):
    try:
        return await up.install(version, checksum, "exec_test")
    finally:
        await asyncio.sleep(0)  # let a scheduled restart run, as the event loop would


@pytest.mark.parametrize("version,checksum,why", [
    ("", "a" * 64, "version ''"),
    ("../../etc", "a" * 64, "version '../../etc'"),
    ("1.0", "abc", "checksum 'abc': must be a SHA-256"),
    ("1.0", "z" * 64, "must be a SHA-256"),
])
async def test_a_malformed_request_is_refused_naming_the_field(devplane, secret, tmp_path, version, checksum, why):
    up, agent = upgrader(devplane, secret, tmp_path)
    out = await install(up, version, checksum)
    assert out.exit_code == 1 and why in out.stderr and "nothing installed" in out.stderr
    assert installed(tmp_path) == [] and agent.restarts == []


async def test_a_missing_artifact_is_refused(devplane, secret, tmp_path):
    up, agent = upgrader(devplane, secret, tmp_path)
    out = await install(up, "9.0.404", "b" * 64)
    assert out.exit_code == 1 and "404" in out.stderr and "no artifact plexd/9.0.404" in out.stderr, out.stderr
    assert installed(tmp_path) == [] and agent.restarts == []


async def test_an_artifact_larger_than_max_size_is_cut_off_while_streaming(devplane, secret, tmp_path, good):
    up, agent = upgrader(devplane, secret, tmp_path, max_size=65536)
    out = await install(up, *good)
    assert out.exit_code == 1 and "larger than upgrade.max_size (65536 bytes)" in out.stderr
    assert installed(tmp_path) == [] and agent.restarts == []


async def test_an_artifact_that_is_not_a_plexd_release_is_refused_after_the_checksum(devplane, secret, tmp_path):
    junk = os.urandom(4096)
    put_signed(devplane, "0.9.2-junk", junk)  # signed by the right key: the run check still refuses it
    up, agent = upgrader(devplane, secret, tmp_path)
    out = await install(up, "0.9.2-junk", hashlib.sha256(junk).hexdigest())
    assert out.exit_code == 1 and "does not run as plexd 0.9.2-junk" in out.stderr, out.stderr
    assert installed(tmp_path) == [] and agent.restarts == []


async def test_a_release_that_calls_itself_another_version_is_refused(devplane, secret, tmp_path):
    path = tmp_path / "liar.pyz"
    checksum = zipapp.build(path, version="0.9.9-other")
    put_signed(devplane, "0.9.3-liar", path.read_bytes())
    path.unlink()
    up, agent = upgrader(devplane, secret, tmp_path)
    out = await install(up, "0.9.3-liar", checksum)
    assert out.exit_code == 1 and "'plexd 0.9.9-other'" in out.stderr, out.stderr
    assert installed(tmp_path) == [] and agent.restarts == []


async def test_a_good_release_is_installed_switched_and_marked_then_a_restart_is_asked(devplane, secret, tmp_path,
                                                                                         good):
    version, checksum = good
    up, agent = upgrader(devplane, secret, tmp_path)
    out = await install(up, version, checksum)
    assert out.exit_code == 0 and out.deferred, out.stderr
    name = f"plexd-{version}-{checksum[:12]}.pyz"
    assert installed(tmp_path) == ["current", name, name + ".sig", "upgrade.json"]
    assert os.readlink(tmp_path / "releases" / "current") == name
    assert hashlib.sha256((tmp_path / "releases" / name).read_bytes()).hexdigest() == checksum
    marker = markers.read(tmp_path / "data")
    assert marker is not None and marker.state == markers.INSTALLED and marker.execution_id == "exec_test"
    assert (marker.from_release, marker.to_checksum) == (None, checksum)
    assert agent.restarts == [f"upgrade to plexd {version}"]

    # While that upgrade is pending, another is refused, and nothing changes.
    again = await install(up, version, checksum)
    assert again.exit_code == 1 and "in progress" in again.stderr
    assert agent.restarts == [f"upgrade to plexd {version}"]


async def test_an_install_cut_off_by_the_actions_timeout_leaves_no_child_and_blocks_nothing(devplane, secret,
                                                                                           tmp_path, good):
    """The action's timeout cancels the install while the artifact's --version check runs: `installing` stayed
    set for the life of the daemon (every later upgrade "in progress"), and the checked artifact kept running."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("__main__.py", "import time\ntime.sleep(120)\n")  # never answers --version
    checksum = put_signed(devplane, "0.9.4-hang", buf.getvalue())
    up, _ = upgrader(devplane, secret, tmp_path)
    task = asyncio.ensure_future(up.install("0.9.4-hang", checksum, "exec_hang"))

    def checking() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"0.9.4-hang" in cmd and b"--version" in cmd:
                found.append(int(pid))
        return found
    for _ in range(200):
        if checking():
            break
        await asyncio.sleep(0.05)
    assert checking(), "the --version check never started"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert checking() == [] and up.installing == "" and installed(tmp_path) == []
    out = await install(up, *good)  # the next upgrade is not "in progress"
    assert out.exit_code == 0 and out.deferred, out.stderr


async def test_the_running_checksum_is_not_installed_again(devplane, secret, tmp_path, good):
    up, agent = upgrader(devplane, secret, tmp_path)
    agent.binary_checksum = good[1]
    out = await install(up, *good)
    assert out.exit_code == 0 and not out.deferred and "already running" in out.stdout
    assert installed(tmp_path) == [] and agent.restarts == []


async def test_a_release_already_on_disk_is_reused_without_a_download(devplane, secret, tmp_path):
    # The devplane has no artifact for this version: only the file already in the release directory can do.
    rel = tmp_path / "releases"
    rel.mkdir()
    checksum = zipapp.build(tmp_path / "local.pyz", version="0.9.4-local")
    os.replace(tmp_path / "local.pyz", rel / f"plexd-0.9.4-local-{checksum[:12]}.pyz")
    (rel / f"plexd-0.9.4-local-{checksum[:12]}.pyz.sig").write_bytes(signing.sign(RELEASE_KEY, "0.9.4-local",
                                                                                   checksum))
    up, agent = upgrader(devplane, secret, tmp_path)
    out = await install(up, "0.9.4-local", checksum)
    assert out.exit_code == 0 and out.deferred, out.stderr
    assert agent.restarts == ["upgrade to plexd 0.9.4-local"]
