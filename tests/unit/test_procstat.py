"""plexd.base.procstat against real processes: one whose command name holds ") " (fields are counted after the last
parenthesis), a zombie, and a pid that is gone."""

from __future__ import annotations

import os
import subprocess
import time

from plexd.base.procstat import process_stat


def wait_for_zombie(pid: int, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while (stat := process_stat(pid)) is not None and stat.state != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    return stat


def test_a_command_name_with_parentheses_and_spaces_is_read_right(tmp_path):
    odd = tmp_path / "x) S (y"
    os.symlink("/bin/sleep", odd)
    proc = subprocess.Popen([str(odd), "30"])
    try:
        stat = process_stat(proc.pid)
        assert stat is not None and stat.alive
        # the state may go from R to S between two reads (the sleep settles): the start time is what stays
        again = process_stat(proc.pid)
        assert again is not None and again.start_ticks == stat.start_ticks > 0
        proc.kill()  # not reaped yet: a zombie, once the kill has landed
        zombie = wait_for_zombie(proc.pid)
        assert zombie is not None and zombie.state == "Z" and not zombie.alive
        assert zombie.start_ticks == stat.start_ticks
    finally:
        proc.kill()
        proc.wait()
    assert process_stat(proc.pid) is None or process_stat(proc.pid).start_ticks != stat.start_ticks
