"""IPv4 forwarding per interface, and the value each knob had before plexd turned it on.

The bridge forwards between the interfaces it serves (user access, site-to-site, the mesh, the LAN of a local subnet).
It turns on `net.ipv4.conf.<if>.forwarding` for just those interfaces (the kernel decides per incoming interface), never
the machine-wide `ip_forward`, and records what each knob was before in `data_dir/bridge/forwarding.json`, written
before the knob is: a plexd killed in between still knows, at its next teardown, what to put back. Teardown restores
each knob it changed to that value; a knob that was already on is never recorded and never touched. The Go agent wrote 0
on teardown whatever was there before (docs/decisions.md, Go defect D5).

A knob forwards whatever arrives, to anywhere the routing table leads (the bridge's LAN, the Internet), so no
knob is turned on before its limits are in place: table `inet plexd_bridge`, the bridge's own, drops what arrives
on a forwarding interface for anywhere its parts do not name (`Forward.to`), replies of allowed flows aside:

    meta mark 0x706c7278 accept comment "plexd-bridge relay fast path"
    iifname "wg-access" ct state established,related accept
    iifname "wg-access" ip daddr 10.100.0.0/16 accept        an access peer: the mesh range, all a policy names
    iifname "wg-access" counter drop comment "plexd-bridge wg-access <digest>"

The relay's kernel fast path (`plexd.bridge.fastpath`) forwards relayed WireGuard packets untracked (no
`established` to match) and marked: accepted first, they pass when the relay's interface is also a LAN limited
here. It only narrows: the firewall's `inet plexd` still decides by the policy what passes within the limits. A LAN
(`Forward.lan`) is limited only while plexd is the one that turned its knob on: one already forwarding is this
machine's router, as its operator made it. A limit missing or changed is drift, as a knob turned off is
(`limit_drift`): the next converge puts it back and says so; a limit that cannot be written (a malformed prefix,
nftables refusing it) is an error line, its knob left off.

Blocking: libnftables is called on the event loop here, where the firewall and the fast path call it in a worker
thread. The ledger's callers (`plexd.bridge.wgif`: observe, apply, remove) use it synchronously, and that order
is the guarantee (the limits in place before a knob is written, the knobs put back before the limits go); the
calls are small and rare: a listing of this table of a few rules at most once per LIVE_FOR, a transaction only
when the limits change or drifted, about 3 ms each (measured beside a 1,000-rule table). Moving them to a thread
means making those callers await the ledger, with the firewall's care for a cancelled converge (`_write`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexd.base.atomicfile import write_atomic
from plexd.base.boundedjson import loads
from plexd.base.errors import PlexdError, WireFormatError
from plexd.bridge.fastpath import MARK

log = logging.getLogger(__name__)

PROC = "/proc/sys/net/ipv4/conf"
MAX_LEDGER = 1 << 16
GUARD_TABLE = "plexd_bridge"
FAST_PATH_KEY = "plexd-bridge relay fast path"  # the comment of the rule accepting the fast path's packets
LIVE_FOR = 1.0  # seconds a read of the live table answers for: every wanted interface asks at each observe


def _valid(interface: str) -> bool:
    return 0 < len(interface) <= 15 and not any(c in interface for c in '/. \t\0"\\') and interface not in (
        "all", "default")


@dataclass(frozen=True)
class Forward:
    """An interface a bridge part needs forwarding on, and `to`: the prefixes what arrives on it may be forwarded
    to (none: nowhere). `lan`: not plexd's own interface (a local subnet's), limited only while its knob is plexd's
    doing."""

    interface: str
    to: tuple[str, ...] = ()
    lan: bool = False


def guard_script(limits: Mapping[str, Iterable[str]]) -> str:
    """The nft script that makes `inet plexd_bridge` hold exactly `limits` (interface -> the prefixes what arrives
    on it may go to), replacing what was there in one transaction; with no limits, the table goes."""
    lines = [f"table inet {GUARD_TABLE}", f"delete table inet {GUARD_TABLE}"]
    if limits:
        lines += [f"table inet {GUARD_TABLE} {{", "  chain forward {",
                  "    type filter hook forward priority filter; policy accept;",
                  f'    meta mark {MARK:#x} accept comment "{FAST_PATH_KEY}"']
        for interface, prefixes in sorted(limits.items()):
            lines += [f"    {rule}" for rule in _limit_rules(interface, prefixes)]
        lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def _limit_rules(interface: str, prefixes: Iterable[str]) -> list[str]:
    if not _valid(interface):
        raise ValueError(f"{interface!r} is not an interface name plexd writes a rule for")
    rules = [f'iifname "{interface}" ct state established,related accept']
    rules += [f'iifname "{interface}" {"ip6" if n.version == 6 else "ip"} daddr {n} accept' for n in _nets(prefixes)]
    return [*rules, f'iifname "{interface}" counter drop comment "{_limit_key(interface, prefixes)}"']


def _nets(prefixes: Iterable[str]) -> list[Any]:
    return sorted({ipaddress.ip_network(p, strict=False) for p in prefixes}, key=lambda n: (n.version, n))


def _limit_key(interface: str, prefixes: Iterable[str]) -> str:
    """The drop rule's comment: the interface and a digest of its limit (a changed limit has another key)."""
    text = " ".join([interface, *map(str, _nets(prefixes))])
    return f"plexd-bridge {interface} " + hashlib.sha256(text.encode()).hexdigest()[:12]


class ForwardingLedger:
    def __init__(self, data_dir: str | os.PathLike[str], proc: str = PROC, guard: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`guard`: the nftables context (`plexd.machine.nft.Nftables`) the limits are written through; by default
        plexd's own, and none on a stand-in `proc` (a test's: its machine is not this one)."""
        self.path = Path(data_dir) / "bridge" / "forwarding.json"
        self.proc = proc
        self.saved: dict[str, str] = self._load()
        self.holders: dict[str, set[str]] = {}  # in memory: rebuilt as the domains apply after a restart
        self.reach: dict[str, dict[str, Forward]] = {}  # interface -> holder -> the limit it asked for
        if guard is None and proc == PROC:
            from plexd.machine.nft import Nftables  # libnftables, as the firewall and the relay's fast path

            guard = Nftables()
        self.guard = guard
        self.clock = clock
        self._installed: str | None = None  # the script last applied (None: not yet, by this process)
        self._live: tuple[float, frozenset[str]] | None = None  # (when read, the drop rules' comments)

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

    def limit_drift(self, interface: str) -> str:
        """How the limit on `interface` is not the one its holders want: "missing", "differs" (another one is
        there: a part's prefixes changed), or "" (in place, or none is wanted)."""
        limit = self.limits().get(interface)
        if limit is None or self.guard is None:
            return ""
        try:
            live = self._live_keys()
            key = _limit_key(interface, limit)
        except (OSError, ValueError, PlexdError) as e:  # unreadable or unwritable: not known to be in place
            log.debug("bridge: the limit on %s in table inet %s: %s", interface, GUARD_TABLE, e)
            return "missing"  # the next apply tries it, and says why it cannot
        if key in live and FAST_PATH_KEY in live:
            return ""
        return "differs" if FAST_PATH_KEY in live and any(k.startswith(f"plexd-bridge {interface} ")
                                                          for k in live) else "missing"

    def enable(self, forward: Forward, holder: str) -> bool:
        """Forwarding on for packets arriving on `forward.interface`, held by `holder` (the bridge interface that
        needs it), once the limits it needs are in place (OSError when they cannot be: the knob stays as it is);
        True when it was off (and is now recorded)."""
        interface = forward.interface
        if not _valid(interface):
            raise ValueError(f"{interface!r} is not an interface name plexd writes a sysctl for")
        self._hold(forward, holder)
        knob = self._knob(interface)
        before = knob.read_text().strip()
        if before != "1" and interface not in self.saved:
            self.saved[interface] = before
            self._save()
        self._apply_limits()  # before the knob: nothing is forwarded past them, not for a moment
        if before == "1":
            return False
        knob.write_text("1\n")
        return True

    def hold(self, forward: Forward, holder: str) -> None:
        """`holder` needs forwarding on `forward.interface`, without touching it: the holders are in memory, so
        after a restart the domains say again what their wanted interfaces need before anything is released."""
        if _valid(forward.interface):
            self._hold(forward, holder)

    def _hold(self, forward: Forward, holder: str) -> None:
        self.holders.setdefault(forward.interface, set()).add(holder)
        self.reach.setdefault(forward.interface, {})[holder] = forward

    def limits(self) -> dict[str, tuple[str, ...]]:
        """Each limited interface and the prefixes what arrives on it may go to (what all its holders name)."""
        out = {}
        for interface, wanted in self.reach.items():
            if wanted and (interface in self.saved or not all(f.lan for f in wanted.values())):
                out[interface] = tuple(sorted({p for f in wanted.values() for p in f.to}))
        return out

    def _apply_limits(self) -> None:
        if self.guard is None:
            return
        try:  # a malformed prefix too: an error line for the caller, never an exception out of its converge
            script = guard_script(self.limits())
            wanted = self._wanted_keys()
            if script == self._installed and wanted <= self._live_keys():
                return  # as this process left it, and still there
            self.guard.run_script(script)
        except (OSError, ValueError, PlexdError) as e:  # nftables missing or refusing: nothing forwards unlimited
            self._installed = self._live = None
            raise OSError(f"its limits (table inet {GUARD_TABLE}) cannot be put in place: {e}") from None
        self._installed = script
        self._live = (self.clock(), wanted)

    def _wanted_keys(self) -> frozenset[str]:
        keys = {_limit_key(i, p) for i, p in self.limits().items()}
        return frozenset({*keys, FAST_PATH_KEY} if keys else keys)

    def _live_keys(self) -> frozenset[str]:
        now = self.clock()
        if self._live is None or now - self._live[0] >= LIVE_FOR:
            objects = self.guard.list_table("inet", GUARD_TABLE) or []
            keys = frozenset(str(o["rule"].get("comment", "")) for o in objects if isinstance(o, dict) and "rule" in o)
            self._live = (now, keys)
        return self._live[1]

    def release(self, holder: str) -> list[str]:
        """`holder` no longer needs forwarding: every recorded knob nobody holds goes back to what it was (also
        those whose holder went before a restart, which only the file remembers)."""
        for interface, holders in list(self.holders.items()):
            holders.discard(holder)
            if not holders:
                del self.holders[interface]
        for interface, wanted in list(self.reach.items()):
            wanted.pop(holder, None)
            if not wanted:
                del self.reach[interface]
        errors = self.restore([interface for interface in self.saved if interface not in self.holders])
        try:  # after the knobs: an interface still forwarding is never left without its limit
            self._apply_limits()
        except OSError as e:
            errors.append(f"forwarding: {e}")
        return errors

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
