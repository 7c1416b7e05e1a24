"""Leaving the mesh: the deregistration marker, taking down what plexd set up, and `--purge`.

A node that deregistered keeps its identity (docs/decisions.md, Restart and rejoin) and writes
``data_dir/deregistered``; its next start re-registers with the node secret first (same key, node id and mesh IP)
and removes the marker. So a reboot, which deregisters on SIGTERM by default, never orphans the node: it comes back
as itself when it starts again. Only a purge (or an admin's forget) ends that identity.
"""

from __future__ import annotations

import logging
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from plexd.base.atomicfile import write_atomic
from plexd.base.errors import PlexdError
from plexd.base.gojson import format_time
from plexd.config import datadir
from plexd.system.steps import StepReport, format_steps
from plexd.system.systemd import booted, systemctl

DEREGISTER_PATH = "/v1/daemon/deregister"  # the running daemon's route that does all of this (plexd.node.control)

log = logging.getLogger(__name__)


def mark_departed(data_dir: str, when: datetime) -> None:
    """Remember that the control plane took our deregistration, and when."""
    try:
        write_atomic(Path(data_dir) / datadir.DEPARTED, (format_time(when) + "\n").encode(), mode=0o600)
    except OSError as exc:  # the next start then rejoins through the 401 path instead: slower, not worse
        log.warning("cannot record the deregistration in %s: %s", data_dir, exc.strerror)


def departed(data_dir: str) -> str | None:
    """When this node deregistered, if it has not rejoined since."""
    try:
        return (Path(data_dir) / datadir.DEPARTED).read_text(encoding="utf-8", errors="replace").strip() or "?"
    except OSError:
        return None


def clear_departed(data_dir: str) -> None:
    try:
        os.unlink(Path(data_dir) / datadir.DEPARTED)
    except FileNotFoundError:
        pass


async def take_down(config: Any) -> None:
    """Remove what a plexd left on this machine (peers, interface, userspace process, nftables table) when no
    daemon runs: after a stop with shutdown.deregister false, or a crash."""
    from plexd.node.domain_list import build_engine, wireguard

    engine = build_engine(config)
    device = wireguard(engine)
    try:
        await device.device()  # adopts a userspace process left behind, so that it is stopped too
        await engine.teardown()
    finally:
        await device.close()


def purge_local(config: Any, *, systemd_running: bool | None = None,
                daemon_paths: dict[str, Any] | None = None) -> StepReport:
    """``--purge``: data_dir, the bootstrap token file, and the systemd unit (disabled and stopped) when systemd
    is PID 1. Every step is attempted; each one says what it did, skipped, or could not do. `daemon_paths`: the
    running daemon's own (its answer names them): a daemon started with another --data-dir or PLEXD_DATA_DIR than
    this command's keeps its keys in its own, and those are the ones to remove."""
    report = StepReport()
    paths = daemon_paths or {}
    data_dir = _path(paths, "data_dir", config.data_dir)
    if os.path.lexists(data_dir):
        try:
            shutil.rmtree(data_dir)
            report.done.append(f"removed {data_dir} (identity, keys, caches, journals)")
        except OSError as exc:
            report.failed.append(f"could not remove {data_dir}: {exc.strerror or exc}")
    else:
        report.skipped.append(f"{data_dir} does not exist")
    queue_dir = _path(paths, "telemetry_queue_dir", config.telemetry.queue_dir)
    if queue_dir:  # an older version's telemetry.db, kept outside data_dir
        base = os.path.join(queue_dir, datadir.TELEMETRY_DB)
        removed = [p for p in (base, base + "-wal", base + "-shm") if _unlink(p)]
        if removed:
            report.done.append(f"removed the telemetry queue {base}")
    token_file = _path(paths, "token_file", config.token.file)
    if token_file:
        try:
            os.unlink(token_file)
            report.done.append(f"removed the bootstrap token file {token_file}")
        except FileNotFoundError:
            report.skipped.append(f"no bootstrap token file at {token_file}")
        except OSError as exc:
            report.failed.append(f"could not remove {token_file}: {exc.strerror}")
    if not (booted() if systemd_running is None else systemd_running):
        report.skipped.append("systemd is not running here: no unit to disable")
    elif error := systemctl("disable", "--now", "plexd.service"):
        report.failed.append(f"systemctl disable --now plexd.service: {error}")
    else:
        report.done.append("disabled and stopped plexd.service")
    return report


def _path(paths: dict[str, Any], name: str, default: str) -> str:
    value = paths.get(name)
    return value if isinstance(value, str) and (value.startswith("/") or not value) else default


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


DAEMON_WAIT = 60.0  # the daemon's stop budget (34 s) and the answer's way back


def deregister_command(config: Any, *, purge: bool, force: bool) -> dict[str, Any]:
    """``plexd deregister``: through the running daemon (it runs its stop sequence and answers when done), or
    alone when none runs. Then `purge`. A failed POST changes nothing, unless `force`."""
    from plexd.node.control_client import DaemonNotRunning, DaemonRefused, call

    try:
        doc = call(config.node_api.socket_path, "POST", DEREGISTER_PATH, {"purge": purge, "force": force},
                   admin_group=config.node_api.admin_group, timeout=DAEMON_WAIT)
        doc["by_daemon"] = True
        _wait_gone(config.node_api.socket_path)
    except DaemonRefused as exc:
        if exc.status != 502:
            raise
        raise PlexdError(_unchanged(exc.reason, daemon=True)) from None
    except DaemonNotRunning:
        doc = _deregister_alone(config, purge=purge, force=force)
    paths = doc.pop("paths", None) if doc.get("by_daemon") else None
    doc["purge"] = purge_local(config, daemon_paths=paths if isinstance(paths, dict) else None).to_json() \
        if purge else None
    return doc


def _deregister_alone(config: Any, *, purge: bool, force: bool) -> dict[str, Any]:
    import asyncio

    from plexd.controlplane.client import ControlPlaneClient
    from plexd.controlplane.client_errors import ControlPlaneError
    from plexd.identity.identity_store import IdentityStore

    loaded = IdentityStore(config.data_dir).load()
    ident = loaded.identity
    doc: dict[str, Any] = {"by_daemon": False, "node_id": ident.node_id if ident else "", "deregistered": False,
                           "error": "", "torn_down": False}
    if ident is None:
        why = f"stored identity unusable: {loaded.problem}" if loaded.problem else f"no identity in {config.data_dir}"
        if not force:
            raise PlexdError(f"this node is not registered ({why}); nothing to deregister (--force removes what "
                             "plexd left on this machine anyway)")
        doc["error"] = why
    else:
        config.require_api()

        async def post() -> None:
            async with ControlPlaneClient.for_config(config, token=ident.bearer, dialect=ident.dialect) as client:
                await client.deregister(ident.node_id, purge=purge)

        try:
            asyncio.run(post())
            doc["deregistered"] = True
        except ControlPlaneError as exc:
            if not force:
                raise PlexdError(_unchanged(str(exc), daemon=False)) from None
            doc["error"] = str(exc)
    try:
        asyncio.run(take_down(config))
        doc["torn_down"] = True
    except PlexdError as exc:
        doc["teardown_error"] = str(exc)
    if doc["deregistered"] and not purge:
        mark_departed(config.data_dir, datetime.now(UTC))
    return doc


def _unchanged(reason: str, *, daemon: bool) -> str:
    kept = "the daemon keeps running and " if daemon else ""
    return (f"the control plane did not take the deregistration: {reason}. Nothing was changed: {kept}the node "
            "stays on the mesh. Try again when the control plane is reachable, or add --force to leave anyway")


def _wait_gone(socket_path: str, timeout: float = 5.0) -> None:
    """The daemon answered after its teardown; wait for it to let go of its socket, so what follows (a purge,
    systemctl) never races its last steps."""
    import time

    deadline = time.monotonic() + timeout
    while os.path.exists(socket_path) and time.monotonic() < deadline:
        time.sleep(0.05)


def format_deregister(doc: dict[str, Any], config: Any) -> str:
    node = doc.get("node_id") or "(unknown node)"
    lines = []
    if doc["deregistered"]:
        lines.append(f"node {node} deregistered")
    else:
        lines.append(f"node {node} was NOT deregistered ({doc['error']}); going on because of --force")
    if doc.get("torn_down"):
        how = "the daemon stopped and removed" if doc["by_daemon"] else "removed"
        lines.append(f"{how} the {config.mesh.interface} interface, its peers and the nftables table inet plexd")
    elif doc.get("teardown_error"):
        lines.append(f"could not remove what plexd set up: {doc['teardown_error']}")
    report = doc.get("purge")
    if report is not None:
        lines.append(format_steps(report, done_label="purged"))
    elif doc["deregistered"]:
        lines.append(f"the identity stays in {config.data_dir}: 'plexd up' (or the next boot) rejoins as the same "
                     "node; 'plexd deregister --purge' forgets it")
    return "\n".join(lines)
