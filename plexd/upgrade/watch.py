"""The upgrade watcher: systemd's part, for a daemon that re-executed itself into a new release without systemd.

Started by the old daemon just before its exec (`plexd.upgrade.launcher.restart`), detached from it. It watches
the daemon's process (same pid across the exec) and ``data_dir/upgrade.json``:

- the marker is gone (the new release is healthy) or rolled back: nothing to do, exit;
- the process is gone while the marker still waits: start `plexd up` again from the installed package, whose
  launcher rolls back to the old release (like systemd's Restart=on-failure would);
- the process outlives the health deadline by `--grace` without either: it hangs; kill it, then as above.

    python -P -m plexd.upgrade.watch --pid PID --data-dir DIR [--grace S] -- up [ARGS]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from plexd.base.log import setup_logging
from plexd.base.procstat import process_stat
from plexd.upgrade import marker as markers
from plexd.upgrade.launcher import installed_command

log = logging.getLogger("plexd.upgrade.watch")

POLL = 0.5
MAX_LIFE = 3600.0  # whatever happens, the watcher does not outlive this


def process_start(pid: int) -> int | None:
    """The start time of `pid` while it is alive, else None (gone, or a zombie nobody reaped yet)."""
    stat = process_stat(pid)
    return stat.start_ticks if stat is not None and stat.alive else None


def watch(pid: int, data_dir: str, grace: float, up_args: list[str], *, poll: float = POLL,
          start_again: Callable[[list[str]], str] | None = None) -> str:
    """Watch until the upgrade is settled; return what was done (for the log and tests)."""
    start_again = start_again or _start_again
    started = process_start(pid)
    give_up = time.monotonic() + MAX_LIFE
    while time.monotonic() < give_up:
        marker = markers.read(data_dir)
        if marker is None or marker.state == markers.ROLLED_BACK:
            return "settled"
        if started is None or process_start(pid) != started:
            log.error("plexd (pid %d) exited before plexd %s became healthy; starting plexd again to roll back",
                      pid, marker.to_version)
            return start_again(up_args)
        if marker.state == markers.STARTED and time.time() > marker.deadline + grace:
            log.error("plexd %s (pid %d) is not healthy %.0fs past its deadline and did not give up; killing it "
                      "to roll back", marker.to_version, pid, grace)
            os.kill(pid, signal.SIGKILL)
            while process_start(pid) == started:
                time.sleep(0.05)
            return start_again(up_args)
        time.sleep(poll)
    return "gave up"


def _start_again(up_args: list[str]) -> str:
    subprocess.Popen(installed_command(up_args), stdin=subprocess.DEVNULL, start_new_session=True)
    return "restarted"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plexd.upgrade.watch")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("up_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    up_args = args.up_args[1:] if args.up_args[:1] == ["--"] else args.up_args
    if os.fork() > 0:
        os._exit(0)  # the daemon reaps this first process at once; the watcher goes on, adopted by init
    setup_logging(args.log_level)
    log.info("%s", watch(args.pid, args.data_dir, args.grace, up_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
