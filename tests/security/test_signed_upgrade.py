"""Attack: get a node to run code that its pinned release key did not sign, or an older release.

The real devplane over HTTP serves the artifacts and their signature files; the real install path
(plexd.upgrade.upgrader.Upgrader.install, as service.upgrade calls it) downloads and checks them; the real launcher
(plexd.upgrade.launcher.launch, in a child process since it execs) starts `current`. The agent around the
Upgrader is the small stand-in of tests/integration/test_upgrade_install.py (config, client, restart recorded).

Every evil artifact is a real plexd zipapp that writes a sentinel file the moment it is run or its plexd package is
imported: "nothing executed" is that file not existing. The good controls show the same artifact does write it
when a check lets it through, so the sentinel would catch a missing check.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nacl.signing import SigningKey
from upgrade_node import Agent, left_behind, upgrade_node

from plexd import __version__
from plexd.trust.integrity import package_root
from plexd.upgrade import signing, zipapp
from plexd.upgrade.upgrader import Upgrader

RELEASE_KEY = SigningKey.generate()  # the publisher's key, pinned in the node's upgrade.release_keys
OTHER_KEY = SigningKey.generate()  # someone else's


def evil_release(path: Path, version: str, sentinel: Path) -> str:
    """A plexd zipapp `version` that writes `sentinel` when run or imported (and otherwise behaves); its SHA-256."""
    plant = f"open({str(sentinel)!r}, 'a').write('executed\\n')\n".encode()
    init = (package_root() / "__init__.py").read_bytes()
    init = init.replace(f'__version__ = "{__version__}"'.encode(), f'__version__ = "{version}"'.encode())
    main = plant + b"import sys\n\nfrom plexd.cli import main\n\nsys.exit(main())\n"
    return zipapp.build(path, overrides={"plexd/__init__.py": plant + init, "__main__.py": main})


def node(devplane, secret: str, tmp_path: Path, **upgrade: object) -> tuple[Upgrader, Agent]:
    keys = upgrade.pop("release_keys", [signing.public_key(RELEASE_KEY)])
    return upgrade_node(devplane, secret, tmp_path, keys, **upgrade)  # type: ignore[arg-type]


left = left_behind


async def install(up: Upgrader, version: str, checksum: str, allow_downgrade: bool = False):
    try:
        return await up.install(version, checksum, "exec_sec", allow_downgrade)
    finally:
        await asyncio.sleep(0)


def refused(out, why: str, tmp_path: Path, agent: Agent, sentinel: Path) -> None:
    assert out.exit_code == 1 and why in out.stderr and "nothing installed" in out.stderr, out.stderr
    assert not sentinel.exists(), "the artifact was executed before it was verified"
    assert left(tmp_path) == [] and agent.restarts == []


async def test_an_unsigned_artifact_is_never_executed(devplane, secret, tmp_path, caplog):
    sentinel = tmp_path / "ran"
    checksum = evil_release(tmp_path / "a.pyz", "7.0.1", sentinel)
    devplane.admin.put_artifact("7.0.1", (tmp_path / "a.pyz").read_bytes())  # no .sig
    up, agent = node(devplane, secret, tmp_path)
    out = await install(up, "7.0.1", checksum)
    refused(out, "release signature refused: no signature for plexd/7.0.1/linux/", tmp_path, agent, sentinel)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "no signature" in lines[0], lines


async def test_an_artifact_signed_by_another_key_is_never_executed(devplane, secret, tmp_path):
    sentinel = tmp_path / "ran"
    checksum = evil_release(tmp_path / "a.pyz", "7.0.2", sentinel)
    devplane.admin.put_artifact("7.0.2", (tmp_path / "a.pyz").read_bytes(),
                                signature=signing.sign(OTHER_KEY, "7.0.2", checksum))
    up, agent = node(devplane, secret, tmp_path)
    out = await install(up, "7.0.2", checksum)
    refused(out, "the signature is by no key in upgrade.release_keys", tmp_path, agent, sentinel)
    assert signing.public_key(OTHER_KEY)[:20] in out.stderr


async def test_a_node_with_no_pinned_key_installs_nothing(devplane, secret, tmp_path):
    sentinel = tmp_path / "ran"
    checksum = evil_release(tmp_path / "a.pyz", "7.0.3", sentinel)
    devplane.admin.put_artifact("7.0.3", (tmp_path / "a.pyz").read_bytes(),
                                signature=signing.sign(RELEASE_KEY, "7.0.3", checksum))
    up, agent = node(devplane, secret, tmp_path, release_keys=[])
    out = await install(up, "7.0.3", checksum)
    refused(out, "upgrade.release_keys is empty", tmp_path, agent, sentinel)


async def test_a_tampered_artifact_under_a_good_signature_is_never_executed(devplane, secret, tmp_path):
    # The publisher signed a good release; the artifact store now serves other bytes under its name.
    sentinel = tmp_path / "ran"
    good = zipapp.build(tmp_path / "good.pyz", version="7.0.4")
    evil = evil_release(tmp_path / "evil.pyz", "7.0.4", sentinel)
    devplane.admin.put_artifact("7.0.4", (tmp_path / "evil.pyz").read_bytes(),
                                signature=signing.sign(RELEASE_KEY, "7.0.4", good))
    up, agent = node(devplane, secret, tmp_path)
    out = await install(up, "7.0.4", good)  # the action names the signed checksum: the bytes do not match it
    refused(out, f"checksum mismatch: the artifact plexd/7.0.4/linux/{_arch()} has SHA-256 {evil}", tmp_path,
            agent, sentinel)
    out = await install(up, "7.0.4", evil)  # the action names the evil bytes' checksum: no signature covers it
    refused(out, f"the signature is for SHA-256 '{good}', not {evil}", tmp_path, agent, sentinel)


async def test_an_old_release_relabelled_as_a_new_version_is_never_executed(devplane, secret, tmp_path):
    # A validly signed old release (0.0.9) served as 9.0.0 with its own signature: the signature names 0.0.9.
    sentinel = tmp_path / "ran"
    old = evil_release(tmp_path / "old.pyz", "0.0.9", sentinel)
    devplane.admin.put_artifact("9.0.0", (tmp_path / "old.pyz").read_bytes(),
                                signature=signing.sign(RELEASE_KEY, "0.0.9", old))
    up, agent = node(devplane, secret, tmp_path)
    out = await install(up, "9.0.0", old)
    refused(out, "the signature is for version '0.0.9', not '9.0.0'", tmp_path, agent, sentinel)


@pytest.mark.parametrize("action,config", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["neither", "action only", "config only", "both"])
async def test_an_older_release_is_installed_only_when_the_action_and_the_config_both_allow_it(
        devplane, secret, tmp_path, action, config):
    sentinel = tmp_path / "ran"
    old = evil_release(tmp_path / "old.pyz", "0.0.9", sentinel)  # properly signed, but older than the running one
    devplane.admin.put_artifact("0.0.9", (tmp_path / "old.pyz").read_bytes(),
                                signature=signing.sign(RELEASE_KEY, "0.0.9", old))
    up, agent = node(devplane, secret, tmp_path, allow_downgrade=str(config).lower())
    out = await install(up, "0.0.9", old, allow_downgrade=action)
    if action and config:
        # The control: the same artifact goes through every check, and its run check does execute it.
        assert out.exit_code == 0 and out.deferred, out.stderr
        assert sentinel.exists() and agent.restarts == ["upgrade to plexd 0.0.9"]
        return
    refused(out, f"downgrade refused: plexd 0.0.9 is older than the running {__version__}", tmp_path, agent,
            sentinel)
    if not action:
        assert "the action's allow_downgrade" in out.stderr
    if not config:
        assert "upgrade.allow_downgrade: true in the config" in out.stderr


def _arch() -> str:
    from plexd.upgrade.upgrader import goarch

    return goarch()


# -- the launcher ----------------------------------------------------------------------------------------------

LAUNCH = """
import logging, sys
from plexd.config import settings as config
from plexd.upgrade import launcher
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
launcher.launch(config.load(sys.argv[1], flags={}), ["--version"])
print("FELL BACK to the installed package")
"""


def launch(cfg: Path) -> subprocess.CompletedProcess[str]:
    """`launch` as `plexd up` calls it, with `--version` for the release it execs (so the child ends)."""
    return subprocess.run([sys.executable, "-c", LAUNCH, str(cfg)], capture_output=True, text=True, timeout=60,
                          check=False)


async def test_a_swapped_current_release_is_refused_by_the_launcher(devplane, secret, tmp_path):
    sentinel = tmp_path / "ran"
    good = zipapp.build(tmp_path / "good.pyz", version="7.1.0")
    devplane.admin.put_artifact("7.1.0", (tmp_path / "good.pyz").read_bytes(),
                                signature=signing.sign(RELEASE_KEY, "7.1.0", good))
    up, _ = node(devplane, secret, tmp_path)
    out = await install(up, "7.1.0", good)
    assert out.exit_code == 0, out.stderr
    (tmp_path / "data" / "upgrade.json").unlink()  # the upgrade is settled; only `current` matters here
    release = tmp_path / "releases" / os.readlink(tmp_path / "releases" / "current")

    # The control: the signed release is verified and executed.
    ok = launch(tmp_path / "config.yaml")
    assert ok.stdout.strip() == "plexd 7.1.0" and "FELL BACK" not in ok.stdout, (ok.stdout, ok.stderr)

    # Someone with write access to the release directory swaps the file (its name and .sig stay).
    evil_release(tmp_path / "evil.pyz", "7.1.0", sentinel)
    os.replace(tmp_path / "evil.pyz", release)
    swapped = launch(tmp_path / "config.yaml")
    assert "FELL BACK to the installed package" in swapped.stdout, (swapped.stdout, swapped.stderr)
    assert not sentinel.exists(), "the launcher ran a swapped release"
    errors = [line for line in swapped.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "REFUSING to run the release" in errors[0] and \
        f"the signature is for SHA-256 '{good}'" in errors[0], swapped.stderr

    # Its signature file gone: refused the same way.
    os.unlink(f"{release}.sig")
    unsigned = launch(tmp_path / "config.yaml")
    assert "FELL BACK" in unsigned.stdout and "has no signature file" in unsigned.stderr, unsigned.stderr
    assert not sentinel.exists()


def test_the_signature_covers_version_and_checksum_and_nothing_else_verifies():
    good = hashlib.sha256(b"x").hexdigest()
    keys = [signing.public_key(RELEASE_KEY)]
    data = signing.sign(RELEASE_KEY, "1.2.3", good)
    assert signing.verify(data, keys, "1.2.3", good) == keys[0]
    forged = data.replace(b'"1.2.3"', b'"1.2.4"')  # the document edited: the signature no longer matches
    with pytest.raises(signing.SignatureError, match="by no key"):
        signing.verify(forged, keys, "1.2.4", good)
