"""A spent bootstrap token left readable: `token.value` in a 0644 config file. After the real `plexd join` against
the real devplane, the token is gone from the file (the rest of it, comments included, kept), was never printed,
and the config's repr never shows it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from plexd.config import settings as config_mod
from plexd.devplane.harness import Devplane
from plexd.identity.identity_store import IdentityStore

PLEXD = str(Path(sys.executable).with_name("plexd"))


@pytest.fixture
def dp(tmp_path):
    with Devplane(tmp_path / "devplane") as plane:
        yield plane


def write_config(root: Path, dp: Devplane, token_lines: str) -> Path:
    config = root / "config.yaml"
    config.write_text(
        f"# written by hand\napi: {{url: {dp.url}, allow_insecure: true}}\ndata_dir: {root / 'data'}\n{token_lines}"
        f"hooks: {{dir: {root / 'hooks'}}}   # no hooks here\n"
        f"registration: {{hostname: px-token-node, max_wait: 5s}}\nnode_api: {{socket_path: {root / 'api.sock'}}}\n")
    os.chmod(config, 0o644)
    return config


def join(config: Path) -> subprocess.CompletedProcess[str]:
    # join prints only its outcome unless asked for logs: ask, to see what it says about the token
    env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(config), "PLEXD_LOG_LEVEL": "info"}
    return subprocess.run([PLEXD, "join"], env=env, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("style", ["block", "flow"])
def test_the_bootstrap_token_is_gone_from_the_config_file_after_registration(tmp_path, dp, style):
    token = dp.admin.create_token()
    lines = (f"token:\n  # the one-time token from the admin\n  value: {token}\n  file: {tmp_path / 'no-file'}\n"
             if style == "block" else f"token: {{value: {token}, file: {tmp_path / 'no-file'}}}\n")
    config = write_config(tmp_path, dp, lines)
    before = config_mod.load(str(config), env={})
    assert before.token.value == token and token not in repr(before)

    r = join(config)
    assert r.returncode == 0, r.stderr
    assert IdentityStore(tmp_path / "data").load().identity is not None
    text = config.read_text()
    assert token not in text, text
    after = config_mod.load(str(config), env={})
    assert after.token.value == "" and after.token.file == str(tmp_path / "no-file")
    assert (after.api.url, after.data_dir, after.registration.hostname) == (dp.url, str(tmp_path / "data"),
                                                                             "px-token-node")
    assert "# written by hand" in text and "# no hooks here" in text
    assert stat.S_IMODE(config.stat().st_mode) == 0o644  # the file's mode is the operator's
    # the token was never printed; the operator was told where it was and that it is gone
    assert token not in r.stdout + r.stderr
    assert f"the bootstrap token is in {config}, which is mode 0644 (readable by others)" in r.stderr
    assert f"removed the used bootstrap token (token.value) from {config}" in r.stderr


def test_a_token_from_the_environment_leaves_the_config_file_alone(tmp_path, dp):
    """token.value set by PLEXD_TOKEN_VALUE is not in the file: nothing in the file is touched."""
    config = write_config(tmp_path, dp, "")
    text = config.read_text()
    env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(config), "PLEXD_TOKEN_VALUE": dp.admin.create_token()}
    r = subprocess.run([PLEXD, "join"], env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert config.read_text() == text
    assert "removed the used bootstrap token" not in r.stderr
