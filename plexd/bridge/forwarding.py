"""IPv4 forwarding per interface, and the value each knob had before plexd turned it on.

The bridge forwards between the interfaces it serves (user access, site-to-site, the mesh, the LAN of a local
subnet). It turns on `net.ipv4.conf.<if>.forwarding` for just those interfaces (the kernel decides per incoming
interface), never the machine-wide `ip_forward`, and records what each knob was before in
`data_dir/bridge/forwarding.json`, written before the knob is: a plexd killed in between still knows, at its next
teardown, what to put back. Teardown restores each knob it changed to that value; a knob that was already on is
never recorded and never touched. The Go agent wrote 0 on teardown whatever was there before (its D5).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from plexd.base.atomicfile import write_atomic
from plexd.base.boundedjson import loads
from plexd.base.errors import WireFormatError

log = logging.getLogger(__name__)

PROC = "/proc/sys/net/ipv4/conf"
MAX_LEDGER = 1 << 16


def _valid(interface: str) -> bool:
    return 0 < len(interface) <= 15 and not any(c in interface for c in "/. \t\0") and interface not in ("all",
                                                                                                          "default")


class ForwardingLedger:
    def __init__(self, data_dir: str | os.PathLike[str], proc: str = PROC) -> None:
        self.path = Path(data_dir) / "bridge" / "forwarding.json"
        self.proc = proc
        self.saved: dict[str, str] = self._load()
        self.holders: dict[str, set[str]] = {}  # in memory: rebuilt as the domains apply after a restart

    def _load(self) -> dict[str, str]:
        try:
            doc = loads(self.path.read_bytes()[:MAX_LEDGER], str(self.path))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, WireFormatError) as e:
            log.error("bridge: cannot read %s (%s): the forwarding knobs it recorded will not be restored",
                      self.path, e)
            return {}
        if not isinstance(doc, dict):
            return {}
        return {k: v for k, v in doc.items() if isinstance(k, str) and _valid(k) and v in ("0", "1")}

    def _save(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self.saved, sort_keys=True).encode(), mode=0o600)

    def _knob(self, interface: str) -> Path:
        return Path(self.proc) / interface / "forwarding"

    def is_on(self, interface: str) -> bool:
        try:
            return self._knob(interface).read_text().strip() == "1"
        except OSError:
            return False

    def enable(self, interface: str, holder: str) -> bool:
        """Forwarding on for packets arriving on `interface`, held by `holder` (the bridge interface that needs
        it); True when it was off (and is now recorded)."""
        if not _valid(interface):
            raise ValueError(f"{interface!r} is not an interface name plexd writes a sysctl for")
        self.holders.setdefault(interface, set()).add(holder)
        knob = self._knob(interface)
        before = knob.read_text().strip()
        if before == "1":
            return False
        if interface not in self.saved:
            self.saved[interface] = before
            self._save()
        knob.write_text("1\n")
        return True

    def hold(self, interface: str, holder: str) -> None:
        """`holder` needs forwarding on `interface`, without touching it: the holders are in memory, so after a
        restart the domains say again what their wanted interfaces need before anything is released."""
        if _valid(interface):
            self.holders.setdefault(interface, set()).add(holder)

    def release(self, holder: str) -> list[str]:
        """`holder` no longer needs forwarding: every recorded knob nobody holds goes back to what it was (also
        those whose holder went before a restart, which only the file remembers)."""
        for interface, holders in list(self.holders.items()):
            holders.discard(holder)
            if not holders:
                del self.holders[interface]
        return self.restore([interface for interface in self.saved if interface not in self.holders])

    def restore(self, interfaces: Iterable[str]) -> list[str]:
        """Put back what plexd changed on these interfaces; errors, one line each. An interface that is gone
        (plexd's own, deleted) has nothing left to restore."""
        errors = []
        restored = False
        for interface in interfaces:
            before = self.saved.get(interface)
            if before is None:
                continue
            try:
                if self._knob(interface).parent.exists():
                    self._knob(interface).write_text(before + "\n")
            except OSError as e:
                errors.append(f"net.ipv4.conf.{interface}.forwarding: cannot restore it to {before}: {e}")
                continue
            del self.saved[interface]
            restored = True
        if restored:
            self._save()
        return errors
