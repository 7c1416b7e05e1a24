"""nftables through libnftables' JSON API (pip-nftables): list the table, apply one atomic transaction.

The firewall's domain (`plexd.firewall.firewall_domain`) and the bridge's fast path and forwarding guard use it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from plexd.base.errors import PlexdError

JSON = Any


class FirewallError(PlexdError):
    """nftables could not be used or refused a change."""


class UnreadableTable(FirewallError):
    """The table exists but its listing cannot be read: plexd's own table is rebuilt, not left unknown."""


class Nftables:
    """The libnftables context plexd uses, for listing and for applying.

    Applies are never echoed: echo makes libnftables load the whole table first (~55 ms at 1,000 rules and sets),
    while a rule added after a known handle costs ~3 ms; the handles of the rules plexd adds are learnt at the
    next read (`plexd.firewall.plan.UNKNOWN_HANDLE`).

    Blocking: called from a worker thread, one call at a time. A context works in the network namespace it was
    created in, so it is created lazily by the daemon itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ctx: Any = None

    def _context(self) -> Any:
        if self._ctx is None:
            try:
                import nftables  # pip-nftables
            except ImportError:
                raise FirewallError("the Python module nftables is missing (pip install pip-nftables)") from None
            try:
                ctx = nftables.Nftables()
            except OSError as e:
                raise FirewallError(f"libnftables cannot be loaded ({e}); install it: apt-get install libnftables1"
                                    ) from None
            ctx.set_json_output(True)
            ctx.set_handle_output(True)
            self._ctx = ctx
        return self._ctx

    def list_table(self, family: str, name: str) -> list[JSON] | None:
        """The table's objects, or None when it does not exist."""
        with self._lock:
            try:
                rc, out, err = self._context().json_cmd(
                    {"nftables": [{"list": {"table": {"family": family, "name": name}}}]})
            except ValueError as e:  # not JSON: nft 1.0.6 lists a dormant table's flags as nothing at all
                raise UnreadableTable(f"nftables lists table {family} {name} as invalid JSON ({e})") from None
        if rc != 0:
            if "No such file or directory" in err:
                return None
            raise FirewallError(f"reading table {family} {name}: {_first_line(err)}")
        return list(out.get("nftables", [])) if isinstance(out, dict) else []

    def run(self, commands: Sequence[JSON]) -> None:
        """One transaction: all of it or nothing."""
        with self._lock:
            rc, _out, err = self._context().json_cmd({"nftables": list(commands)})
        if rc != 0:
            raise FirewallError(f"nftables refused the change: {_first_line(err)}")

    def run_script(self, script: str) -> None:
        """One transaction written as an nft script (`nft -f`): all of it or nothing."""
        with self._lock:
            rc, _out, err = self._context().cmd(script)
        if rc != 0:
            raise FirewallError(f"nftables refused the change: {_first_line(err)}")

    def probe(self) -> None:
        """Raise FirewallError naming what is missing when nftables cannot be used here at all."""
        with self._lock:
            rc, _out, err = self._context().json_cmd({"nftables": [{"list": {"tables": {"family": "inet"}}}]})
        if rc != 0:
            raise FirewallError(f"the kernel refuses nftables ({_first_line(err)}); is nf_tables loaded?")


def _first_line(err: str) -> str:
    lines = [line.strip() for line in (err or "").splitlines() if line.strip()]
    for line in lines:
        if "Error" in line:
            return line[line.find("Error"):][:300]
    return (lines[0] if lines else "unknown error")[:300]

