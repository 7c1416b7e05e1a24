"""``plexd reconcile --once [--dry-run]``: one reconcile cycle from the command line, standalone.

Pulls the state with the stored identity, diffs it against the live device and link, and prints the plan
(``--dry-run``) or the corrections it made, which it also reports with ``POST /drift`` like the daemon does.
It never starts the userspace WireGuard process itself: a process started by a short-lived command would die with
it, so when the device is missing it says to run ``plexd up`` instead (``--dry-run`` still shows the plan).
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexd.errors import PlexdError

if TYPE_CHECKING:
    from plexd.config import Config

log = logging.getLogger(__name__)


@dataclass
class ReconcileOutcome:
    ok: bool
    dry_run: bool
    corrections: list[dict[str, str]]  # drift corrected (the whole plan with --dry-run)
    updates: list[dict[str, str]]  # changes the pulled state asked for
    errors: list[str]
    reported: bool

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "dry_run": self.dry_run, "corrections": self.corrections, "updates": self.updates,
                "errors": self.errors, "drift_reported": self.reported}


def build_converger(config: Config) -> Any:
    """A `Converger` for this machine's device, with the backend the config (or the kernel) selects."""
    from plexd.converge import Converger
    from plexd.mesh.links import Links
    from plexd.mesh.wireguard.kernel import KernelBackend
    from plexd.mesh.wireguard.userspace import UserspaceBackend

    backend_kind = config.mesh.backend
    if backend_kind == "auto":
        backend_kind = "kernel" if KernelBackend.available() else "userspace"
    if backend_kind == "kernel":
        backend: Any = KernelBackend(config.mesh.interface)
    else:
        backend = UserspaceBackend(config.mesh.interface, implementation=config.mesh.userspace_implementation)
    return Converger(backend, Links(config.mesh.interface))


async def reconcile_once(config: Config, *, dry_run: bool) -> ReconcileOutcome:
    from plexd.clock import Clock
    from plexd.controlplane.client import ControlPlaneClient
    from plexd.desired import DesiredState
    from plexd.identity import IdentityStore
    from plexd.services.connected import MeshHandle, build_verifier, load_mirror, state_applier, state_fetcher
    from plexd.services.reconciler import Reconciler

    loaded = IdentityStore(config.data_dir).load()
    if loaded.identity is None:
        why = f" ({loaded.problem})" if loaded.problem else ""
        raise PlexdError(f"this node is not registered{why}; run 'plexd join' first")
    ident = loaded.identity
    converger = build_converger(config)
    private_key = base64.b64encode(ident.private_key).decode()
    desired = DesiredState.initial(interface=config.mesh.interface, listen_port=config.mesh.listen_port,
                                   mtu=config.mesh.mtu, private_key=private_key, mesh_ip=ident.mesh_ip)
    # Drift is measured against the daemon's last desired state (its mirror); without one there is nothing to
    # hold the machine to, so only the pulled state is applied.
    mirrored = load_mirror(Path(config.data_dir), private_key)
    mesh = MeshHandle(converger, mirrored if mirrored is not None and mirrored.mesh_ip == ident.mesh_ip else desired)

    if not dry_run:
        observed = await converger.observe()
        if observed.device is None:
            raise PlexdError(f"WireGuard interface {config.mesh.interface} is not up; start the daemon with "
                             "'plexd up' (or use --dry-run to see the plan)")

    verifier = build_verifier(config.data_dir, Clock(), ident.signing_public_key)
    reports: list[dict[str, Any]] = []
    async with ControlPlaneClient.for_config(config, token=ident.node_secret_key) as client:
        async def post(report: dict[str, Any]) -> None:
            await client.report_drift(ident.node_id, report)
            reports.append(report)

        # A dry run changes nothing local: no signing key installed or persisted.
        apply = state_applier(mesh, None, None) if dry_run else state_applier(mesh, verifier, config.data_dir)
        fetch = state_fetcher(mesh, lambda: client.fetch_state(ident.node_id))
        reconciler = Reconciler(fetch, apply, mesh.converge, post)
        result = await reconciler.run_once(dry_run=dry_run, drift_phase=mirrored is not None)
    # The device belongs to the daemon: never stop or close a process this command did not start.
    errors = [result.error] if result.error else []
    last = getattr(converger, "last_result", None)
    if last is not None:
        errors += list(last.errors)
    return ReconcileOutcome(ok=result.ok and not errors, dry_run=dry_run,
                            corrections=[{"type": c.type, "detail": c.detail} for c in result.corrections],
                            updates=[{"type": c.type, "detail": c.detail} for c in result.updates],
                            errors=errors, reported=bool(reports))


def format_outcome(outcome: ReconcileOutcome) -> str:
    lines = []
    verb = "would correct" if outcome.dry_run else "corrected"
    if outcome.corrections:
        lines.append(f"{verb} {len(outcome.corrections)} item(s):")
        lines += [f"  {c['type']:<22} {c['detail']}" for c in outcome.corrections]
    if outcome.updates:
        lines.append(f"applied {len(outcome.updates)} update(s) from the control plane:")
        lines += [f"  {c['type']:<22} {c['detail']}" for c in outcome.updates]
    if not outcome.corrections and not outcome.updates:
        lines.append("in sync: nothing to correct")
    if outcome.reported:
        lines.append("drift report sent to the control plane")
    lines += [f"error: {e}" for e in outcome.errors]
    return "\n".join(lines)
