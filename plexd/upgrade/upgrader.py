"""The daemon's side of a self-upgrade: the ``service.upgrade`` built-in, and the report of its outcome.

Install (the built-in, in the old daemon), with nothing changed until the artifact is proven:

0. refused at once: no pinned release key (``upgrade.release_keys``), or a version older than the running one
   unless the action says ``allow_downgrade`` AND the config has ``upgrade.allow_downgrade: true``;
1. ``GET /v1/artifacts/plexd/{version}/linux/{arch}.sig``: the release's signature (plexd.upgrade.signing), which
   must sign exactly this version and the action's checksum under a pinned key, before anything else is fetched;
   then ``GET /v1/artifacts/plexd/{version}/linux/{arch}`` streamed into ``upgrade.dir`` as a ``.part`` file, capped at
   ``upgrade.max_size``, hashed on the way; a SHA-256 other than the action's ``checksum`` deletes it and fails
   the action (a release already there under that checksum is used without a download);
2. only now, signed and checksummed, the file must run here: ``python FILE --version`` answers ``plexd <version>``;
3. rename into place (its signature beside it, for the launcher to check again at every start), write the
   marker (state "installed"), point ``current`` at it;
4. restart with the tunnels up (`Agent.restart`): the action's result is deferred, not sent.

Outcome (this service, in whichever daemon starts next):

- the new release, healthy (its first converge ran and a heartbeat carrying its checksum was accepted) by the
  deadline: the action succeeds, with the new checksum in its output; the marker goes;
- the new release, not healthy by the deadline: it records why and restarts; the launcher rolls back;
- the old release after a rollback (the launcher's, or the watcher's): the action fails with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import platform
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexd import __version__
from plexd.actions.builtins import Output, json_output
from plexd.base.childenv import child_environment
from plexd.base.children import signal_child
from plexd.base.errors import PlexdError
from plexd.base.failpoint import failpoint
from plexd.controlplane import http_client
from plexd.controlplane.client_errors import ControlPlaneError, TransientError
from plexd.trust.integrity import sha256_file, zipapp_of
from plexd.upgrade import marker as markers
from plexd.upgrade.launcher import roll_back
from plexd.upgrade.releases import ReleaseError, Releases
from plexd.upgrade.signing import MAX_SIG_BYTES, SUFFIX, SignatureError, downgrade_problem, verify, verify_release

log = logging.getLogger(__name__)

VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_~-]{0,63}")
SHA256 = re.compile(r"[0-9a-f]{64}")
RUN_CHECK_TIMEOUT = 30.0
HEALTH_POLL = 0.5
# Go's GOARCH names, which the artifact path uses (docs/protocol.md §1.15).
GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "armv6l": "arm", "i686": "386", "i386": "386",
          "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}

Finish = Callable[[str, int, str, str, str], None]  # execution id, exit code, stdout, stderr, detail


class UpgradeRefused(PlexdError):
    """The request or the artifact is not acceptable; nothing was installed."""


def goarch() -> str:
    machine = platform.machine()
    return GOARCH.get(machine, machine)


def check_request(version: str, checksum: str) -> str:
    """Why a request cannot be an upgrade, or ""."""
    if not VERSION.fullmatch(version):
        return (f"version {version[:80]!r}: must be 1 to 64 letters, digits and . + _ ~ - (starting with a letter "
                "or digit)")
    if not SHA256.fullmatch(checksum):
        return f"checksum {checksum[:80]!r}: must be a SHA-256, 64 hex digits"
    return ""


class Upgrader:
    def __init__(self, agent: Any, healthy: Callable[[], str | None]) -> None:
        self.agent = agent
        self.config = agent.config.upgrade
        self.data_dir = agent.config.data_dir
        self.releases = Releases(self.config.dir)
        self.healthy = healthy  # None when healthy, else what is still missing
        self.installing = ""  # the version being installed
        # The upgrade this start belongs to, read once: its execution's result is ours to send (see `run`).
        self.found = markers.read(self.data_dir)
        self.last: dict[str, Any] | None = None  # the last outcome this daemon saw, for `plexd status`

    # -- install (the old daemon) -----------------------------------------------------------------------------

    async def install(self, version: str, checksum: str, execution_id: str, allow_downgrade: bool = False) -> Output:
        version, checksum = version.strip(), checksum.strip().lower()
        problem = check_request(version, checksum)
        if problem:
            return Output(1, "", f"{problem}; nothing installed\n")
        pending = markers.read(self.data_dir)
        if self.installing or pending is not None:
            what = self.installing or f"{pending.to_version} ({pending.state})"  # type: ignore[union-attr]
            return Output(1, "", f"an upgrade to plexd {what} is in progress; nothing installed\n")
        if checksum == self.agent.binary_checksum:
            return json_output({"status": "already running", "version": __version__, "binary_checksum": checksum})
        problem = self._policy_problem(version, allow_downgrade)
        if problem:
            log.error("upgrade to plexd %s refused: %s", version, problem, extra={"execution_id": execution_id})
            return Output(1, "", f"upgrade to plexd {version}: {problem}; nothing installed\n")
        self.installing = version
        installed = False
        try:
            out = await self._install(version, checksum, execution_id)
            installed = True
            return out
        except http_client.RequestFailed as exc:  # the download broke off (a reset, a stall): nothing installed
            why = f"the download broke off: {exc}; nothing installed"
            log.error("upgrade to plexd %s failed: %s", version, why, extra={"execution_id": execution_id})
            return Output(1, "", f"upgrade to plexd {version}: {why}\n")
        except (UpgradeRefused, SignatureError, ControlPlaneError, ReleaseError, OSError) as exc:
            why = str(exc) if isinstance(exc, PlexdError) else f"{exc.strerror or exc} ({self.releases.dir})"
            if isinstance(exc, SignatureError):
                why = f"release signature refused: {why}; nothing installed, nothing run"
            log.error("upgrade to plexd %s refused: %s", version, why, extra={"execution_id": execution_id})
            return Output(1, "", f"upgrade to plexd {version}: {why}\n")
        finally:
            if not installed:  # whatever ended it (an error of any kind, the action's timeout): not in progress
                self.installing = ""

    def _policy_problem(self, version: str, allow_downgrade: bool) -> str:
        """Why this node will not take `version` whatever the artifact is, or ""."""
        if problem := self.agent.client.artifacts_problem():
            return problem
        if not self.config.release_keys:
            return ("upgrade.release_keys is empty: this node trusts no release key, so it installs no release "
                    "(pin the publisher's public key in the config)")
        downgrade = downgrade_problem(version, __version__)
        if not downgrade:
            return ""
        if allow_downgrade and self.config.allow_downgrade:
            log.warning("downgrade allowed by the action and upgrade.allow_downgrade: %s", downgrade)
            return ""
        missing = [what for what, ok in (("the action's allow_downgrade", allow_downgrade),
                                         ("upgrade.allow_downgrade: true in the config", self.config.allow_downgrade))
                   if not ok]
        return f"downgrade refused: {downgrade}; a downgrade needs {' and '.join(missing)}"

    async def _install(self, version: str, checksum: str, execution_id: str) -> Output:
        self.releases.prepare()
        previous = self.releases.current()
        path = self.releases.path_for(version, checksum)
        if path.is_file() and await asyncio.to_thread(sha256_file, path) == checksum:
            signed = await asyncio.to_thread(verify_release, path, self.config.release_keys)
            if signed != (version, checksum):
                raise SignatureError(f"{path.name} is signed as plexd {signed[0]}, not {version}")
            log.info("release %s is already in %s (signature checked); not downloaded again", path.name,
                     self.releases.dir)
        else:
            path = await self._download(version, checksum)
        marker = markers.UpgradeMarker(
            execution_id=execution_id, from_version=__version__, from_checksum=self.agent.binary_checksum,
            from_release=str(previous) if previous else None, to_version=version, to_checksum=checksum,
            to_release=str(path), deadline=0.0)
        markers.write(self.data_dir, marker)
        try:
            self.releases.switch(path)
        except OSError:
            markers.remove(self.data_dir)
            raise
        self.releases.prune({path, *([previous] if previous else [])})
        failpoint("upgrade.switched")
        log.info("installed plexd %s (%s); restarting into it with the interface and peers up", version, path.name,
                 extra={"execution_id": execution_id, "checksum": checksum})
        asyncio.get_running_loop().call_soon(self.agent.restart, f"upgrade to plexd {version}")
        doc = {"status": "installed", "from_version": __version__, "to_version": version, "release": str(path),
               "binary_checksum": checksum, "next": "restarting; the result follows once it is healthy, or after "
               "a rollback"}
        return json_output(doc, deferred=True)

    async def _signature(self, version: str, checksum: str, arch: str) -> bytes:
        """The release's signature file from the control plane, verified for this version and checksum."""
        data = b""
        async with self.agent.client.open_artifact(version, "linux", arch + SUFFIX) as response:
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > MAX_SIG_BYTES:
                    raise SignatureError(f"the signature file is larger than {MAX_SIG_BYTES} bytes")
        signer = verify(data, self.config.release_keys, version, checksum)
        log.info("plexd %s is signed by release key %s", version, signer[:12])
        return data

    async def _download(self, version: str, checksum: str) -> Path:
        part = self.releases.part_path(version, checksum)
        arch, cap = goarch(), self.config.max_size
        try:
            signature = await self._signature(version, checksum, arch)
        except TransientError as exc:  # unreachable for now: not a refusal of the release
            raise UpgradeRefused(f"cannot fetch the signature of plexd/{version}/linux/{arch} now: {exc}; "
                                 "nothing installed") from None
        except ControlPlaneError as exc:
            raise SignatureError(f"no signature for plexd/{version}/linux/{arch}: {exc}") from None
        digest, size = hashlib.sha256(), 0
        try:
            with open(part, "wb") as fh:
                async with self.agent.client.open_artifact(version, "linux", arch) as response:
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > cap:
                            raise UpgradeRefused(f"the artifact is larger than upgrade.max_size ({cap} bytes); "
                                                 "nothing installed")
                        digest.update(chunk)
                        fh.write(chunk)
                await asyncio.to_thread(os.fsync, fh.fileno())
            got = digest.hexdigest()
            if got != checksum:
                raise UpgradeRefused(f"checksum mismatch: the artifact plexd/{version}/linux/{arch} has SHA-256 {got}, "
                                     f"the action asked for {checksum}; nothing installed")
            await self._check_runs(part, version)
        except BaseException:
            with contextlib.suppress(OSError):
                part.unlink()
            raise
        log.info("downloaded plexd %s (%d bytes, SHA-256 verified)", version, size)
        return self.releases.commit(part, version, checksum, signature)

    async def _check_runs(self, path: Path, version: str) -> None:
        """The release must at least start with this Python and its dependencies and say it is `version`."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(path), "--version", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=child_environment())
        try:
            async with asyncio.timeout(RUN_CHECK_TIMEOUT):
                out, _ = await proc.communicate()
        except BaseException as exc:  # the timeout, or the action cancelled: the child goes with it
            if proc.returncode is None:
                signal_child(proc, signal.SIGKILL)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(proc.wait())
            if isinstance(exc, TimeoutError):
                raise UpgradeRefused(f"the artifact did not answer --version within {RUN_CHECK_TIMEOUT:.0f}s; "
                                     "nothing installed") from None
            raise
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0 or text != f"plexd {version}":
            raise UpgradeRefused(f"the artifact does not run as plexd {version} here: --version printed "
                                 f"{text[-300:]!r} (exit status {proc.returncode}); nothing installed")

    # -- outcome (the next daemon) ----------------------------------------------------------------------------

    async def run(self, finish: Finish | None = None) -> None:
        """Settle the upgrade this start belongs to, if any (a service that ends when that is done); its execution's
        result goes through `finish` (the action dispatcher's `finish_deferred`)."""
        marker = self.found
        if marker is None:
            return
        own = self.agent.binary_checksum
        if marker.state != markers.ROLLED_BACK and own == marker.to_checksum:
            await self._prove(marker, finish)
            return
        if marker.state != markers.ROLLED_BACK:  # the launcher never started the new release
            roll_back(self.agent.config, self.releases, marker,
                      f"plexd {marker.to_version} was installed but this start runs {own[:12]} instead")
            marker = markers.read(self.data_dir) or marker.with_state(markers.ROLLED_BACK)
        self._report(marker, finish, healthy=False)

    async def _prove(self, marker: markers.UpgradeMarker, finish: Finish | None) -> None:
        deadline = marker.deadline or time.time() + self.config.health_deadline
        missing = self.healthy()
        while missing is not None and time.time() < deadline:
            if await self.agent.sleep(HEALTH_POLL):
                return  # stopping: the marker stays, the next start settles it
            missing = self.healthy()
        if missing is None:
            self._report(marker, finish, healthy=True)
            return
        reason = f"plexd {marker.to_version} was not healthy by its deadline: {missing}"
        markers.write(self.data_dir, marker.with_state(markers.STARTED, reason))
        log.error("%s; restarting to roll back to plexd %s", reason, marker.from_version)
        self.agent.restart(f"rolling back the upgrade to plexd {marker.to_version}")

    def _report(self, marker: markers.UpgradeMarker, finish: Finish | None, *, healthy: bool) -> None:
        status = "upgraded" if healthy else "rolled back"
        doc = {"status": status, "from_version": marker.from_version, "to_version": marker.to_version,
               "binary_checksum": self.agent.binary_checksum, "release": str(zipapp_of() or "installed package")}
        if healthy:
            log.info("upgraded from plexd %s to %s; healthy, checksum %s", marker.from_version, marker.to_version,
                     self.agent.binary_checksum, extra={"execution_id": marker.execution_id})
            self.last, stderr = {**doc, "at": time.time()}, ""
        else:
            reason = marker.reason or "unknown"
            self.last = {**doc, "reason": reason, "at": time.time()}
            stderr = f"{reason}; rolled back to plexd {marker.from_version}\n"
        if finish is not None and marker.execution_id:
            output = json_output(doc, 0 if healthy else 1)
            finish(marker.execution_id, output.exit_code, output.stdout, stderr, status)
        markers.remove(self.data_dir)

    def status(self) -> dict[str, Any]:
        pending = markers.read(self.data_dir) if not self.installing else None
        return {"release": str(zipapp_of() or "installed package"), "dir": self.config.dir,
                "installing": self.installing or None,
                "pending": None if pending is None else {"to_version": pending.to_version, "state": pending.state},
                "last": self.last}
