"""``plexd reconcile --once [--dry-run]``: one reconcile cycle from the command line.

With a daemon running, the daemon does it (`POST /v1/daemon/reconcile` on its socket): one engine, one lock,
never two engines fighting over the device. Without one, the command runs the cycle itself: it pulls the state
with the stored identity, diffs it against the live device and link, and prints the plan (``--dry-run``) or the
corrections it made, which it also reports with ``POST /drift`` as the daemon does. Standalone it never starts
the userspace WireGuard process: a process started by a short-lived command would die with it, so when the
device is missing it says to run ``plexd up`` instead (``--dry-run`` still shows the plan).

Both paths give the same document: ok, dry_run, reasons, corrections, updates, held, errors, drift_reported.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexd.base.errors import PlexdError

if TYPE_CHECKING:
    from plexd.config.settings import Config
    from plexd.converge.engine import ConvergeResult
    from plexd.services.reconciler import CycleResult

log = logging.getLogger(__name__)


async def reconcile_standalone(config: Config, *, dry_run: bool) -> dict[str, Any]:
    from plexd.base.backoff import Backoff
    from plexd.base.clock import Clock
    from plexd.config import datadir
    from plexd.controlplane.client import ControlPlaneClient
    from plexd.controlplane.ledger import read_mirror
    from plexd.identity.identity_store import IdentityStore
    from plexd.node.builders import build_mesh
    from plexd.node.domain_list import wireguard
    from plexd.node.mesh import StatePull, build_verifier, initial_desired
    from plexd.services.reconciler import Reconciler, drift_uplink
    from plexd.state.desired_store import DesiredStore

    loaded = IdentityStore(config.data_dir).load()
    if loaded.identity is None:
        why = f" ({loaded.problem})" if loaded.problem else ""
        raise PlexdError(f"this node is not registered{why}; run 'plexd join' first")
    ident = loaded.identity
    # Drift is measured against the daemon's last desired state (its mirror); without one there is nothing to
    # hold the machine to, so only the pulled state is applied.
    verifier = build_verifier(config.data_dir, Clock(), ident.signing_public_key)
    desired, restored = initial_desired(config, ident, read_mirror(config.data_dir))
    mesh = build_mesh(config, DesiredStore(desired), verifier=verifier, known=restored)
    engine = mesh.engine

    if not dry_run and await wireguard(engine).device() is None:
        raise PlexdError(f"WireGuard interface {config.mesh.interface} is not up; start the daemon with "
                         "'plexd up' (or use --dry-run to see the plan)")

    async with ControlPlaneClient.for_config(config, token=ident.bearer, dialect=ident.dialect) as client:
        async def post(report: dict[str, Any]) -> None:
            await client.report_drift(ident.node_id, report)

        # A dry run changes nothing local: no signing key installed or persisted.
        pull = StatePull(mesh, lambda: client.fetch_state(ident.node_id), None if dry_run else verifier)
        # The daemon's outbox file: a report the control plane cannot take now is sent by the next `plexd up`.
        uplink = None if dry_run else drift_uplink(Path(config.data_dir) / datadir.UPLINK_DB, post, Backoff())
        reconciler = Reconciler(pull, mesh.gate, post, outbox=uplink)
        try:
            result = await reconciler.run_once(dry_run=dry_run, drift_phase=restored)
        finally:
            if uplink is not None:
                uplink.close()
    # The device belongs to the daemon: never stop or close a process this command did not start.
    return _outcome(result, engine.last_result)


def _outcome(cycle: CycleResult, last: ConvergeResult | None) -> dict[str, Any]:
    """The cycle as the daemon's socket answers it, with the engine's own errors."""
    doc = cycle.to_json()
    doc["errors"] = [cycle.error] if cycle.error else []
    if last is not None:
        doc["errors"] += list(last.errors)
    doc["ok"] = cycle.ok and not doc["errors"]
    doc["hold"] = None
    doc["by_daemon"] = False
    return doc


def format_outcome(doc: dict[str, Any]) -> str:
    lines = []
    held = doc.get("held") or []
    hold = doc.get("hold")
    if hold:
        lines.append(f"reconcile held until {hold['until']} ({hold.get('reason') or 'no reason given'}): "
                     "nothing is corrected")
    verb = "would correct" if doc["dry_run"] else "corrected"
    if doc["corrections"]:
        lines.append(f"{verb} {len(doc['corrections'])} item(s):")
        lines += [f"  {c['type']:<22} {c['detail']}" for c in doc["corrections"]]
    if held:
        lines.append(f"held, not corrected: {len(held)} item(s):")
        lines += [f"  {c['type']:<22} {c['detail']}" for c in held]
    if doc["updates"]:
        lines.append(f"applied {len(doc['updates'])} update(s) from the control plane:")
        lines += [f"  {c['type']:<22} {c['detail']}" for c in doc["updates"]]
    if not doc["corrections"] and not doc["updates"] and not held:
        lines.append("in sync: nothing to correct")
    if doc.get("drift_reported"):
        lines.append("drift report sent to the control plane")
    lines += [f"error: {e}" for e in doc["errors"]]
    return "\n".join(lines)
