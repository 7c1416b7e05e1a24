"""What `plexd up` does before anything else, and how a daemon restarts into a new release.

`launch` settles an upgrade marker and then runs the release `current` points to, by exec, unless that is the
code already running. Before it runs a release it checks it again: the file's SHA-256 and version must be what
its signature (beside it, ``.sig``) signs under a key pinned in ``upgrade.release_keys``; a swapped or unsigned
file is never run (one loud error, and the installed package runs instead).

Finding a marker in state "started" anywhere but in the new release's own first start means
the new release was started and never became healthy (it died, hung or gave up): `current` goes back to the old
release, the marker records why, and the old release starts and reports the failure. This runs from the installed
package on every start systemd makes, so a release that cannot even import is still rolled back.

`restart` ends a daemon that stopped for an upgrade (keeping the interface and peers, like shutdown.deregister
false): under systemd, exit status 75, which the unit restarts at once (RestartForceExitStatus); otherwise it
re-executes the installed package's `plexd up` in the same process, after starting the detached watcher
(`plexd.upgrade.watch`) that plays systemd's part if the new release dies at start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from plexd.config.settings import Config
from plexd.system.systemd import booted
from plexd.trust.integrity import zipapp_of
from plexd.upgrade import marker as markers
from plexd.upgrade.releases import ReleaseError, Releases
from plexd.upgrade.signing import SignatureError, verify_release

log = logging.getLogger(__name__)

EXIT_RESTART = 75  # EX_TEMPFAIL, "restart me": the unit restarts it at once (RestartForceExitStatus=75)
WATCH_GRACE = 30.0  # past the health deadline, the watcher kills a new release that neither got healthy nor gave up


def installed_command(args: Sequence[str]) -> list[str]:
    """`plexd ARGS` from the installed package. -P: never a `plexd` directory in the working directory."""
    return [sys.executable, "-P", "-m", "plexd", *args]


def launch(config: Config, args: Sequence[str]) -> None:
    """Settle an upgrade marker, then exec the current release with `args` unless it is running already.
    Returns when this process should run the daemon itself."""
    releases = Releases(config.upgrade.dir)
    marker = markers.read(config.data_dir)
    if marker is not None and not settle(config, releases, marker):
        log.error("running plexd from %s, not the new release: without its marker no rollback could follow",
                  zipapp_of() or "the installed package")
        return
    try:
        target = releases.current()
    except ReleaseError as exc:
        log.error("%s; running plexd from %s instead", exc, zipapp_of() or "the installed package")
        return
    running = zipapp_of()
    if target == running:
        return
    if target is not None:
        try:
            verify_release(target, config.upgrade.release_keys)
        except (SignatureError, OSError) as exc:
            # A swapped or unsigned file where a verified release was: never run it. The installed package is
            # what a node without releases runs; `current` stays for the operator to see (and the upgrade
            # service rolls a pending upgrade back from there).
            why = str(exc) if isinstance(exc, SignatureError) else f"cannot read it: {exc}"
            log.error("REFUSING to run the release %s: %s; running plexd from %s instead", target, why,
                      running or "the installed package", extra={"release": str(target)})
            return
    command = installed_command(args) if target is None else [sys.executable, str(target), *args]
    log.info("running %s", target or "the installed package", extra={"release": str(target or "")})
    _exec(command)


def settle(config: Config, releases: Releases, marker: markers.UpgradeMarker) -> bool:
    """Move the marker on; False when the new release must not be started (its marker could not be written). A
    full or read-only data_dir must not keep the node from starting: one error line, and the node runs."""
    if marker.state == markers.INSTALLED:
        deadline = time.time() + config.upgrade.health_deadline
        try:
            markers.write(config.data_dir, dataclasses.replace(marker.with_state(markers.STARTED), deadline=deadline))
        except OSError as exc:
            log.error("cannot record the start of plexd %s in %s: %s", marker.to_version, config.data_dir, exc)
            return False
        log.info("starting plexd %s (upgrading from %s); it has until %s to become healthy", marker.to_version,
                 marker.from_version, time.strftime("%H:%M:%S", time.gmtime(deadline)))
    elif marker.state == markers.STARTED and zipapp_of() != Path(marker.to_release).resolve():
        reason = marker.reason or (f"plexd {marker.to_version} stopped before it became healthy (it exited, was "
                                   "killed or could not start)")
        roll_back(config, releases, marker, reason)
    return True


def roll_back(config: Config, releases: Releases, marker: markers.UpgradeMarker, reason: str) -> None:
    """Point `current` at the release the node ran before, and record why for the old daemon to report."""
    previous = Path(marker.from_release) if marker.from_release else None
    try:
        releases.switch(previous)
    except OSError as exc:
        log.error("cannot switch %s back to %s: %s", releases.dir, previous or "the installed package", exc)
    try:
        markers.write(config.data_dir, marker.with_state(markers.ROLLED_BACK, reason))
    except OSError as exc:  # rolled back all the same; only the report to the old daemon is lost
        log.error("cannot record the rollback in %s: %s", config.data_dir, exc)
    log.error("upgrade to plexd %s failed: %s; rolled back to plexd %s", marker.to_version, reason,
              marker.from_version, extra={"execution_id": marker.execution_id})


def restart(config: Config, args: Sequence[str]) -> int:
    """After a stop that kept the tunnels up for an upgrade: hand over to the new release (see the module doc)."""
    if booted() and os.environ.get("INVOCATION_ID"):
        log.info("exiting with status %d for systemd to start the new release", EXIT_RESTART)
        return EXIT_RESTART
    _start_watcher(config, args)
    _exec(installed_command(args))
    return EXIT_RESTART  # not reached unless the exec failed


def _start_watcher(config: Config, args: Sequence[str]) -> None:
    command = [sys.executable, "-P", "-m", "plexd.upgrade.watch", "--pid", str(os.getpid()),
               "--data-dir", config.data_dir, "--grace", str(WATCH_GRACE), "--log-level", config.log_level,
               "--", *args]
    try:
        # The watcher forks once more and this first process exits at once: no zombie is left to the new daemon.
        subprocess.run(command, stdin=subprocess.DEVNULL, start_new_session=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        log.error("cannot start the upgrade watcher (%s): a new release that dies at start will not be rolled "
                  "back until plexd is started again", exc)


def _exec(command: list[str]) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()  # exec does not
    try:
        os.execv(command[0], command)
    except OSError as exc:
        log.error("cannot run %s: %s; running the code at hand", " ".join(command[:2]), exc.strerror)
