"""The environment of every process plexd starts: an allow-list, never the daemon's own.

The daemon's environment holds what a child has no business seeing (``PLEXD_BOOTSTRAP_TOKEN``, ``PLEXD_*``
settings, ``NOTIFY_SOCKET`` through which a child could speak for the daemon, whatever a drop-in put there). A
child gets ``PATH`` and the locale (``LANG``, ``LC_ALL``: taken from the daemon, they decide only how text is
printed), ``HOME`` (``/root``: plexd runs as root) and what its caller adds explicitly (a hook's
``PLEXD_*`` variables and parameters, wireguard-go's settings).

The one exception is plexd itself: the launcher's exec of the current release and the upgrade watcher are the
daemon continuing, and need its configuration (``PLEXD_*``) and systemd's variables (``NOTIFY_SOCKET``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INHERITED = ("PATH", "LANG", "LC_ALL")  # the only names ever copied from the daemon's environment


def child_environment(extra: Mapping[str, str] | None = None, *,
                      parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed environment for a child, plus `extra` (which wins)."""
    parent = os.environ if parent is None else parent
    env = {name: parent[name] for name in INHERITED if parent.get(name)}
    env.setdefault("PATH", DEFAULT_PATH)
    env["HOME"] = "/root"
    env.update(extra or {})
    return env
