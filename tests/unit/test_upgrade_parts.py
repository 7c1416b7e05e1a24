"""The parts of plexd.upgrade that need no daemon: the release build, the marker, the release directory, the
launcher's decisions and the watcher, with real files, real symlinks and real processes. Where the launcher would
exec (which would replace the test process), the exec is recorded instead; the real exec is in
tests/e2e/test_upgrade_lab.py."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nacl.signing import SigningKey
from test_procstat import wait_for_zombie

from plexd.config import settings as config_mod
from plexd.upgrade import launcher, signing, watch, zipapp
from plexd.upgrade import marker as markers
from plexd.upgrade.releases import ReleaseError, Releases

RELEASE_KEY = SigningKey.generate()


def config(tmp_path: Path) -> config_mod.Config:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "config.yaml").write_text(f"data_dir: {tmp_path / 'data'}\nupgrade: {{dir: {tmp_path / 'rel'}, "
                                          f"health_deadline: 42s, release_keys: ['{signing.public_key(RELEASE_KEY)}']}}"
                                          "\n")
    return config_mod.load(str(tmp_path / "config.yaml"), flags={})


def marker(tmp_path: Path, state: str = markers.INSTALLED, from_release: str | None = None) -> markers.UpgradeMarker:
    m = markers.UpgradeMarker("exec_1", "0.1.0", "a" * 64, from_release, "0.2.0", "b" * 64,
                              str(tmp_path / "rel" / "new.pyz"), 0.0, state)
    (tmp_path / "data").mkdir(exist_ok=True)
    markers.write(tmp_path / "data", m)
    return m


def releases(tmp_path: Path, *names: str) -> Releases:
    rel = Releases(tmp_path / "rel")
    rel.prepare()
    for name in names:
        (rel.dir / name).write_bytes(b"release " + name.encode())
    return rel


# -- the build ---------------------------------------------------------------------------------------------------

def test_a_release_is_reproducible_carries_its_version_and_runs(tmp_path):
    one = zipapp.build(tmp_path / "one.pyz", version="7.7.7")
    two = zipapp.build(tmp_path / "two.pyz", version="7.7.7")
    other = zipapp.build(tmp_path / "three.pyz", version="7.7.8")
    assert one == two != other
    out = subprocess.run([sys.executable, str(tmp_path / "one.pyz"), "--version"], capture_output=True, text=True,
                         cwd=tmp_path, check=True)
    assert out.stdout.strip() == "plexd 7.7.7"


# -- the marker --------------------------------------------------------------------------------------------------

def test_the_marker_round_trips_and_is_0600(tmp_path):
    m = marker(tmp_path)
    assert markers.read(tmp_path / "data") == m
    assert (tmp_path / "data" / "upgrade.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("text,why", [
    ("not json", "invalid JSON"),
    ("[1]", "not a JSON object"),
    ('{"execution_id": 1}', "execution_id: int where str belongs"),
    ('{"execution_id": "e"}', "from_version: missing"),
    ("x" * (70 << 10), "larger than"),
])
def test_a_malformed_marker_is_set_aside_with_one_error_naming_the_problem(tmp_path, caplog, text, why):
    (tmp_path / "upgrade.json").write_text(text)
    with caplog.at_level(logging.ERROR):
        assert markers.read(tmp_path) is None
    assert (tmp_path / "upgrade.json.bad").read_text() == text and not (tmp_path / "upgrade.json").exists()
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert why in record.getMessage() and "moved to" in record.getMessage()


def test_an_unknown_state_is_refused(tmp_path):
    m = marker(tmp_path)
    path = tmp_path / "data" / "upgrade.json"
    path.write_text(path.read_text().replace('"installed"', '"dancing"'))
    assert markers.read(tmp_path / "data") is None and (tmp_path / "data" / "upgrade.json.bad").exists()
    assert m.state == markers.INSTALLED


# -- the release directory ---------------------------------------------------------------------------------------

def test_switch_points_current_at_a_release_or_back_at_the_installed_package(tmp_path):
    rel = releases(tmp_path, "plexd-1-a.pyz", "plexd-2-b.pyz")
    assert rel.current() is None
    rel.switch(rel.dir / "plexd-1-a.pyz")
    assert rel.current() == (rel.dir / "plexd-1-a.pyz").resolve()
    rel.switch(rel.dir / "plexd-2-b.pyz")
    assert os.readlink(rel.dir / "current") == "plexd-2-b.pyz"  # relative: the directory may move
    assert not (rel.dir / ".current.new").exists()
    rel.switch(None)
    assert rel.current() is None and not (rel.dir / "current").is_symlink()


def test_a_current_link_to_a_missing_release_is_an_error_naming_both(tmp_path):
    rel = releases(tmp_path)
    os.symlink("plexd-gone.pyz", rel.dir / "current")
    with pytest.raises(ReleaseError, match=r"points to plexd-gone\.pyz, which does not exist"):
        rel.current()


def test_prune_keeps_the_current_the_kept_and_the_three_newest_others(tmp_path):
    names = [f"plexd-{i}-x.pyz" for i in range(7)]
    rel = releases(tmp_path, *names)
    for i, name in enumerate(names):
        os.utime(rel.dir / name, (1000 + i, 1000 + i))
    rel.switch(rel.dir / names[0])
    removed = rel.prune({rel.dir / names[1]})
    assert sorted(removed) == names[2:4]
    assert sorted(p.name for p in rel.dir.glob("plexd-*.pyz")) == [*names[:2], *names[4:]]


# -- the launcher ------------------------------------------------------------------------------------------------

def test_settle_moves_an_installed_upgrade_to_started_with_its_health_deadline(tmp_path):
    cfg = config(tmp_path)
    launcher.settle(cfg, releases(tmp_path), marker(tmp_path))
    m = markers.read(cfg.data_dir)
    assert m.state == markers.STARTED and abs(m.deadline - (time.time() + 42)) < 5


@pytest.mark.parametrize("from_release", [None, "old.pyz"])
def test_settle_rolls_back_a_started_upgrade_found_outside_the_new_release(tmp_path, caplog, from_release):
    cfg = config(tmp_path)
    rel = releases(tmp_path, "old.pyz", "new.pyz")
    rel.switch(rel.dir / "new.pyz")
    m = marker(tmp_path, markers.STARTED, str(rel.dir / from_release) if from_release else None)
    with caplog.at_level(logging.ERROR):
        launcher.settle(cfg, rel, m)
    after = markers.read(cfg.data_dir)
    assert after.state == markers.ROLLED_BACK and "stopped before it became healthy" in after.reason
    assert rel.current() == ((rel.dir / from_release).resolve() if from_release else None)
    assert "upgrade to plexd 0.2.0 failed" in caplog.text and "rolled back to plexd 0.1.0" in caplog.text


def test_settle_leaves_a_started_upgrade_alone_in_the_new_releases_own_start(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    rel = releases(tmp_path, "new.pyz")
    rel.switch(rel.dir / "new.pyz")
    m = marker(tmp_path, markers.STARTED)
    monkeypatch.setattr(launcher, "zipapp_of", lambda: (rel.dir / "new.pyz").resolve())
    launcher.settle(cfg, rel, m)
    assert markers.read(cfg.data_dir) == m and rel.current() == (rel.dir / "new.pyz").resolve()


def test_launch_execs_the_current_release_with_the_same_arguments(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    rel = releases(tmp_path, "new.pyz")
    rel.switch(rel.dir / "new.pyz")
    execs: list[list[str]] = []
    monkeypatch.setattr(launcher, "_exec", execs.append)
    launcher.launch(cfg, ["up", "--config", "x"])
    assert execs == [], "a release without a signature is never run"
    signing.sign_file(RELEASE_KEY, rel.dir / "new.pyz", "0.2.0")
    launcher.launch(cfg, ["up", "--config", "x"])
    assert execs == [[sys.executable, str((rel.dir / "new.pyz").resolve()), "up", "--config", "x"]]
    monkeypatch.setattr(launcher, "zipapp_of", lambda: (rel.dir / "new.pyz").resolve())
    launcher.launch(cfg, ["up"])
    assert len(execs) == 1, "the release already running is not started again"


def test_launch_runs_the_installed_package_when_current_is_broken(tmp_path, monkeypatch, caplog):
    cfg = config(tmp_path)
    rel = releases(tmp_path)
    os.symlink("gone.pyz", rel.dir / "current")
    execs: list[list[str]] = []
    monkeypatch.setattr(launcher, "_exec", execs.append)
    with caplog.at_level(logging.ERROR):
        launcher.launch(cfg, ["up"])
    assert execs == [] and "which does not exist; running plexd from the installed package" in caplog.text


def test_a_marker_that_cannot_be_written_never_keeps_the_node_from_starting(tmp_path, monkeypatch, caplog):
    # A full or read-only data_dir made `plexd up` die in the launcher at every start (and the unit then stayed
    # failed). The one stand-in: the marker write fails as ENOSPC would.
    import errno

    cfg = config(tmp_path)
    rel = releases(tmp_path, "new.pyz")
    rel.switch(rel.dir / "new.pyz")
    signing.sign_file(RELEASE_KEY, rel.dir / "new.pyz", "0.2.0")
    m = marker(tmp_path)  # installed: this start would be the new release's first

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    real_write = markers.write
    monkeypatch.setattr(markers, "write", full)
    execs: list[list[str]] = []
    monkeypatch.setattr(launcher, "_exec", execs.append)
    with caplog.at_level(logging.ERROR):
        launcher.launch(cfg, ["up"])  # no exception: the node starts
    assert execs == [], "the new release is not started without its marker: no rollback could follow"
    assert "cannot record the start of plexd 0.2.0" in caplog.text and markers.read(cfg.data_dir) == m
    # a rollback whose record cannot be written still rolls back
    monkeypatch.setattr(markers, "write", real_write)
    started = marker(tmp_path, markers.STARTED)
    monkeypatch.setattr(markers, "write", full)
    launcher.settle(cfg, rel, started)
    assert rel.current() is None and "cannot record the rollback" in caplog.text


def test_restart_exits_75_for_systemd_and_re_executes_otherwise(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    execs: list[list[str]] = []
    watchers: list[list[str]] = []
    monkeypatch.setattr(launcher, "_exec", execs.append)
    monkeypatch.setattr(launcher, "_start_watcher", lambda c, args: watchers.append(list(args)))
    monkeypatch.setattr(launcher, "booted", lambda: True)
    monkeypatch.setenv("INVOCATION_ID", "0123")
    assert launcher.restart(cfg, ["up"]) == launcher.EXIT_RESTART and execs == [] and watchers == []
    monkeypatch.delenv("INVOCATION_ID")
    launcher.restart(cfg, ["up", "-c", "f"])
    assert execs == [[sys.executable, "-P", "-m", "plexd", "up", "-c", "f"]] and watchers == [["up", "-c", "f"]]


# -- the watcher -------------------------------------------------------------------------------------------------

@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_watcher_starts_plexd_again_when_the_process_dies_before_it_is_healthy(tmp_path, child):
    marker(tmp_path, markers.STARTED)
    started: list[list[str]] = []
    child.kill()
    child.wait()
    assert watch.watch(child.pid, str(tmp_path / "data"), 30, ["up"], poll=0.01,
                       start_again=lambda args: started.append(args) or "restarted") == "restarted"
    assert started == [["up"]]


def test_the_watcher_kills_a_process_that_outlives_its_deadline(tmp_path, child):
    m = marker(tmp_path, markers.STARTED)
    markers.write(tmp_path / "data", dataclasses.replace(m, deadline=time.time() - 1))
    result = watch.watch(child.pid, str(tmp_path / "data"), 0, ["up"], poll=0.01, start_again=lambda args: "again")
    assert result == "again" and child.wait(5) == -9


def test_the_watcher_leaves_a_healthy_or_rolled_back_upgrade_alone(tmp_path, child):
    marker(tmp_path, markers.ROLLED_BACK)
    assert watch.watch(child.pid, str(tmp_path / "data"), 0, ["up"], poll=0.01,
                       start_again=lambda args: "wrong") == "settled"
    markers.remove(tmp_path / "data")
    assert watch.watch(child.pid, str(tmp_path / "data"), 0, ["up"], poll=0.01,
                       start_again=lambda args: "wrong") == "settled"
    assert child.poll() is None


def test_a_zombie_counts_as_gone(child):
    os.kill(child.pid, 9)
    # not reaped yet: a zombie, as the new release would be under a parent that does not wait
    assert wait_for_zombie(child.pid).state == "Z"
    assert watch.process_start(child.pid) is None


@pytest.mark.parametrize("new, running, ok", [
    ("0.2.1", "0.2.0", True), ("0.9.1-test", "0.1.0", True), ("0.1.0", "0.1.0", True),
    ("0.2.0", "0.2.0-rc1", True), ("0.2.0-rc2", "0.2.0-rc1", True), ("0.2.0-rc.10", "0.2.0-rc.9", True),
    ("0.0.9", "0.1.0", False),
    # the same release number took anything: an older build of it went in without either downgrade switch
    ("0.2.0-rc1", "0.2.0", False), ("0.2.0-rc1", "0.2.0-rc2", False), ("0.2.0", "0.2.0.post1", False),
    ("0.2.0+build1", "0.2.0+build9", False), ("0.2.0+b2", "0.2.0", False), ("nightly", "0.1.0", False),
])
def test_versions_are_ordered_and_what_cannot_be_ordered_counts_as_a_downgrade(new, running, ok):
    from plexd.upgrade.signing import downgrade_problem

    assert (downgrade_problem(new, running) == "") is ok, downgrade_problem(new, running)
