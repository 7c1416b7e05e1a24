"""nftables through libnftables' JSON API (pip-nftables): list the table, apply one atomic transaction.

The domain that converges the table is `plexd.firewall.domain`; the bridge's fast path uses these contexts too.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from plexd.errors import PlexdError
from plexd.firewall.ruleset import FAMILY, TABLE

JSON = Any


class FirewallError(PlexdError):
    """nftables could not be used or refused a change."""


class Nftables:
    """The two libnftables contexts plexd uses (listing, and applying with echo for the new rules' handles).

    Blocking: called from a worker thread, one call at a time. A context works in the network namespace it was
    created in, so it is created lazily by the daemon itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lister: Any = None
        self._applier: Any = None

    def _contexts(self) -> tuple[Any, Any]:
        if self._lister is None:
            try:
                import nftables  # pip-nftables
            except ImportError:
                raise FirewallError("the Python module nftables is missing (pip install pip-nftables)") from None
            try:
                lister, applier = nftables.Nftables(), nftables.Nftables()
            except OSError as e:
                raise FirewallError(f"libnftables cannot be loaded ({e}); install it: apt-get install libnftables1"
                                    ) from None
            for ctx in (lister, applier):
                ctx.set_json_output(True)
                ctx.set_handle_output(True)
            applier.set_echo_output(True)
            self._lister, self._applier = lister, applier
        return self._lister, self._applier

    def list_table(self) -> list[JSON] | None:
        """The table's objects, or None when it does not exist."""
        with self._lock:
            lister, _ = self._contexts()
            rc, out, err = lister.json_cmd({"nftables": [{"list": {"table": {"family": FAMILY, "name": TABLE}}}]})
        if rc != 0:
            if "No such file or directory" in err:
                return None
            raise FirewallError(f"reading table {FAMILY} {TABLE}: {_first_line(err)}")
        return list(out.get("nftables", [])) if isinstance(out, dict) else []

    def run(self, commands: Sequence[JSON], echo: bool = False) -> list[JSON]:
        """One transaction; with `echo`, returns the commands as applied (with the handles of new rules). Echo
        makes libnftables load the whole table first (~50 ms at 1,000 rules), so only rule additions ask for it:
        a set element (a peer joining) costs ~3 ms at any size."""
        with self._lock:
            lister, applier = self._contexts()
            rc, out, err = (applier if echo else lister).json_cmd({"nftables": list(commands)})
        if rc != 0:
            raise FirewallError(f"nftables refused the change: {_first_line(err)}")
        return list(out.get("nftables", [])) if echo and isinstance(out, dict) else []

    def probe(self) -> None:
        """Raise FirewallError naming what is missing when nftables cannot be used here at all."""
        with self._lock:
            lister, _ = self._contexts()
            rc, _out, err = lister.json_cmd({"nftables": [{"list": {"tables": {"family": FAMILY}}}]})
        if rc != 0:
            raise FirewallError(f"the kernel refuses nftables ({_first_line(err)}); is nf_tables loaded?")


def _first_line(err: str) -> str:
    lines = [line.strip() for line in (err or "").splitlines() if line.strip()]
    for line in lines:
        if "Error" in line:
            return line[line.find("Error"):][:300]
    return (lines[0] if lines else "unknown error")[:300]

