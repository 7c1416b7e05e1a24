"""One correction: what the converge engine changed on the machine, as the drift report names it (§4.4).

Every typed change of the plan (`plexd.plan.Change`) has one, the reconciler reports a list of them, and the CLI
and `plexd status` print them: the same value from the diff to the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Correction:
    type: str  # the [C] correction type: peer_added, peer_removed, peer_updated, route_added, ...
    detail: str  # names the object: "peer n_ab12: missing from the device"

    def to_wire(self) -> dict[str, str]:
        return {"type": self.type, "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.type}: {self.detail}"
