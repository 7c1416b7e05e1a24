"""The failpoints' switch (plexd/base/failpoint.py): what a test may arm, and what is refused with a clear line.
The kills themselves, at every point, are in tests/e2e/test_failpoints_lab.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from plexd.base.failpoint import ENV, POINTS, BadFailpoint, parse


def test_points_and_counts_are_read():
    assert parse("") == {}
    assert parse("register.answered, converge.between_domains:3") == {"register.answered": 1,
                                                                        "converge.between_domains": 3}


@pytest.mark.parametrize("text, named", [("register.answerd", "no failpoint 'register.answerd'"),
                                         ("mirror.commit:0", "positive whole number"),
                                         ("mirror.commit:x", "positive whole number")])
def test_a_point_that_does_not_exist_or_a_bad_count_is_named(text, named):
    with pytest.raises(BadFailpoint, match=named):
        parse(text)


def test_an_armed_point_kills_the_process_on_the_pass_it_names():
    code = ("from plexd.base.failpoint import failpoint\n"
            "for i in range(3):\n    print(i, flush=True)\n    failpoint('mirror.commit')\n")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV: "mirror.commit:2"},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == -9 and run.stdout.split() == ["0", "1"]
    assert "failpoint mirror.commit (pass 2): SIGKILL now" in run.stderr


def test_without_the_variable_nothing_happens():
    code = "from plexd.base.failpoint import failpoint, POINTS\nfor p in POINTS: failpoint(p)\nprint('alive')"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.strip() == "alive" and len(POINTS) == 7


def test_plexd_up_refuses_a_point_that_does_not_exist(monkeypatch):
    from plexd.base import failpoint

    monkeypatch.setenv(ENV, "register.answered,nope")
    with pytest.raises(BadFailpoint, match=r"no failpoint 'nope'; the points: action\.finished"):
        failpoint.check()
