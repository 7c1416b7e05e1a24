"""One change: what the engine plans for (or did to) the machine, and the drift-report line naming it (§4.4).

Every domain's plan is a list of `Change`s; each is both an instruction its domain applies and, through
`correction()`, a `Correction`: the line the reconciler reports and the CLI and `plexd status` print. The same
value from the diff to the wire. Details never hold key material beyond a public-key fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Correction:
    type: str  # the [C] correction type: peer_added, peer_removed, peer_updated, route_added, ...
    detail: str  # names the object: "peer n_ab12: missing from the device"

    def to_wire(self) -> dict[str, str]:
        return {"type": self.type, "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.type}: {self.detail}"


@dataclass(frozen=True)
class Change:
    """Subclasses set `correction_type` and say what they change in `detail`: `<object>: <what>`."""

    correction_type: ClassVar[str] = ""

    @property
    def detail(self) -> str:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def correction(self) -> Correction:
        return Correction(self.correction_type, self.detail)
