"""sd_notify without libsystemd: datagrams to a real NOTIFY_SOCKET (path and abstract), the watchdog's interval
from systemd's variables, and what one watchdog round sends."""

from __future__ import annotations

import logging
import socket

import pytest

from plexd.system.systemd import Watchdog, notify, watchdog_interval


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_reaches_a_real_socket(tmp_path, abstract):
    name = f"pxnotify-{id(tmp_path)}" if abstract else str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name if abstract else name)
        assert notify("READY=1", "STATUS=up", env={"NOTIFY_SOCKET": "@" + name if abstract else name})
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"


def test_notify_is_a_no_op_outside_systemd_and_when_the_socket_is_gone(tmp_path):
    assert notify("READY=1", env={}) is False
    assert notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}) is False


def test_the_watchdog_runs_only_when_systemd_asked_for_it_and_for_this_process():
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "60000000"}
    assert watchdog_interval(env, pid=42) == 20.0  # a third of WatchdogSec
    assert watchdog_interval({**env, "WATCHDOG_PID": "42"}, pid=42) == 20.0
    assert watchdog_interval({**env, "WATCHDOG_PID": "7"}, pid=42) is None  # meant for another process
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}, pid=42) is None
    assert watchdog_interval({**env, "WATCHDOG_USEC": "soon"}, pid=42) is None
    assert watchdog_interval({**env, "WATCHDOG_USEC": "0"}, pid=42) is None


def test_a_round_pings_while_healthy_withholds_while_stuck_and_sends_status_on_change(caplog):
    sent: list[str] = []
    state = {"problem": None, "status": "connected, 2 peers"}
    dog = Watchdog(20, lambda: state["problem"], lambda: state["status"], send=lambda line: sent.append(line) or True)
    dog.tick()
    dog.tick()
    assert sent == ["WATCHDOG=1", "STATUS=connected, 2 peers", "WATCHDOG=1"]  # the status only when it changes
    sent.clear()
    state["problem"] = "a converge has been running for 31s"
    with caplog.at_level(logging.ERROR):
        dog.tick()
        dog.tick()
    assert sent == []
    assert [r.getMessage() for r in caplog.records] == [
        "withholding the systemd watchdog ping: a converge has been running for 31s"]
    state["problem"], state["status"] = None, "control plane unreachable since 2026-11-23 12:00:00 UTC"
    dog.tick()
    assert sent == ["WATCHDOG=1", "STATUS=control plane unreachable since 2026-11-23 12:00:00 UTC"]


def test_without_watchdogsec_only_the_status_is_kept_current():
    sent: list[str] = []
    dog = Watchdog(5, lambda: None, lambda: "connected, 0 peers", ping=False, send=lambda line: sent.append(line))
    dog.tick()
    assert sent == ["STATUS=connected, 0 peers"]


def test_a_restart_of_the_unit_is_told_from_a_stop_by_its_job(tmp_path, monkeypatch):
    """`systemctl restart plexd` keeps the tunnels up: the stop asks systemd whether the job for its own unit is a
    restart (a stand-in systemctl here, printing what the real one prints; systemd as PID 1 runs the real one in
    the systemd tier)."""
    from plexd.system import systemd

    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/system.slice/plexd.service\n")
    assert systemd.own_unit(str(cgroup)) == "plexd.service"
    cgroup.write_text("0::/user.slice/user-0.slice/session-3.scope\n")
    assert systemd.own_unit(str(cgroup)) == ""
    assert systemd.own_unit(str(tmp_path / "none")) == ""

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemctl"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(systemd, "booted", lambda: True)
    env = {"INVOCATION_ID": "0123"}
    for listed, restarting in (("17 plexd.service restart running\n", True), ("17 plexd.service stop running\n",
                                                                              False), ("", False)):
        fake.write_text(f"#!/bin/sh\nprintf '{listed}'\n")
        fake.chmod(0o755)
        assert systemd.restart_queued(env, unit="plexd.service") is restarting, listed
    assert systemd.restart_queued({}, unit="plexd.service") is False  # not started by systemd
