"""Attack: plant a directory plexd trusts. Whoever can write data_dir (keys, journals) or hooks.dir (code run as
root), or any directory above them, can rename it away and put their own in its place. `plexd up` refuses to
start with one line naming the setting, the path and what is wrong; a hooks directory that becomes unsafe while
plexd runs loses its hooks (refused, with the reason), and nothing crashes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plexd.trust.integrity import scan_hooks
from plexd.trust.pathtrust import trust_problem

pytestmark = pytest.mark.root  # chown to another uid; paths owned by root

PLEXD = str(Path(sys.executable).with_name("plexd"))
NOBODY = 65534


def up(tmp_path: Path, data: Path, hooks: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "config.yaml"
    config.write_text(f"api: {{url: http://127.0.0.1:9, allow_insecure: true}}\n"
                      f"data_dir: {data}\nhooks: {{dir: {hooks}}}\n"
                      f"token: {{file: {tmp_path / 'token'}}}\nnode_api: {{socket_path: {tmp_path / 'api.sock'}}}\n"
                      f"upgrade: {{dir: {tmp_path / 'releases'}}}\n")
    return subprocess.run([PLEXD, "up"], env={"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(config)},
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_up_refuses_a_data_dir_under_a_world_writable_parent(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may rename data away and plant their own
    line = one_line(up(tmp_path, shared / "data", tmp_path / "hooks"))
    assert f"data_dir {shared / 'data'}" in line and f"{shared} is writable by group or other" in line, line
    assert "0777" in line
    assert not (shared / "data").exists()  # refused before anything was created


def test_up_refuses_a_hooks_dir_whose_parent_is_group_writable(tmp_path):
    etc = tmp_path / "etc"
    (etc / "hooks.d").mkdir(parents=True)
    etc.chmod(0o775)
    line = one_line(up(tmp_path, tmp_path / "data", etc / "hooks.d"))
    assert f"hooks.dir {etc / 'hooks.d'}" in line and f"{etc} is writable by group or other" in line, line


def test_up_refuses_a_data_dir_owned_by_another_user_and_one_writable_by_others(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, NOBODY, NOBODY)
    line = one_line(up(tmp_path, data, tmp_path / "hooks"))
    assert f"{data} is owned by uid {NOBODY}, not root" in line, line
    os.chown(data, 0, 0)
    data.chmod(0o733)
    line = one_line(up(tmp_path, data, tmp_path / "hooks"))
    assert f"{data} is writable by group or other (mode 0733)" in line, line


def test_a_sticky_world_writable_parent_like_tmp_is_accepted_but_not_for_the_directory_itself(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "data").mkdir(mode=0o700)
    assert trust_problem(sticky / "data") == ""
    assert "writable by group or other" in trust_problem(sticky)  # as the directory plexd trusts: refused
    # A symlink on the way is followed and its target's parents checked too.
    unsafe = tmp_path / "unsafe"
    (unsafe / "real").mkdir(parents=True)
    unsafe.chmod(0o777)
    (tmp_path / "link").symlink_to(unsafe / "real")
    assert f"{unsafe} is writable by group or other without the sticky bit" in trust_problem(tmp_path / "link")


def test_hooks_lose_trust_when_a_parent_becomes_writable_while_plexd_runs(tmp_path):
    hooks = tmp_path / "etc" / "hooks.d"
    hooks.mkdir(parents=True)
    (hooks / "job").write_text("#!/bin/sh\ntrue\n")
    (hooks / "job").chmod(0o755)
    assert [h.name for h in scan_hooks(hooks).hooks] == ["job"]
    (tmp_path / "etc").chmod(0o777)
    scan = scan_hooks(hooks)  # what the watcher and every request's check run: no exception, a reason
    assert scan.hooks == ()
    [refused] = scan.refused
    assert f"{tmp_path / 'etc'} is writable by group or other" in refused.reason
