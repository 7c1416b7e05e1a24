"""Reloading the config file in a running daemon (SIGHUP, ``systemctl reload plexd``, ``service.reload_config``).

The file and the environment are read again, with the command-line flags the daemon started with. A file that
does not load leaves everything as it was and says why. Of what changed, these take effect at once:

    log_level                 the root logger's level
    actions.*                 the dispatcher's limits, timeouts and local_auth (read per request)
    shutdown.*                what the next stop does: deregister (and tear down) or keep the tunnels, drain

Everything else (the control plane, data_dir, the mesh interface and port, node_api listeners, intervals...)
is reported as needing a restart and keeps its old value until then.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plexd.base.errors import PlexdError
from plexd.base.log import LEVELS
from plexd.config import settings as config_mod
from plexd.config.settings import Config

log = logging.getLogger(__name__)

LIVE_PREFIXES = ("log_level", "actions.", "shutdown.")


@dataclass
class ConfigReloader:
    running: Config  # what the daemon runs with: the start config, its live parts replaced at each reload
    apply: Callable[[Config], None]  # installs the running config once its live parts were replaced
    also: list[Callable[[Config], None]] = dataclasses.field(default_factory=list)  # parts built after the reloader

    def subscribe(self, apply: Callable[[Config], None]) -> None:
        """`apply(running)` after each reload that changed a live part, after `apply`."""
        self.also.append(apply)

    def reload(self) -> dict[str, Any]:
        old = self.running
        try:
            new = config_mod.load(old.config_file, flags=old.given_flags())
        except PlexdError as exc:
            log.error("config reload refused, nothing changed: %s", exc)
            return {"config_file": old.config_file, "error": str(exc), "applied": [], "restart_needed": []}
        changed = [key for key, value, _ in new.items() if old.get(key) != value]
        live = [key for key in changed if key.startswith(LIVE_PREFIXES)]
        later = [key for key in changed if key not in live]
        if live:
            logging.getLogger().setLevel(LEVELS.get(new.log_level.lower(), logging.INFO))
            self.running = dataclasses.replace(old, log_level=new.log_level, actions=new.actions,
                                               shutdown=new.shutdown)
            self.apply(self.running)
            for then in self.also:
                then(self.running)
        log.info("config reloaded from %s: %d applied, %d need a restart", old.config_file or "(no file)",
                 len(live), len(later), extra={"applied": live, "restart_needed": later})
        return {"config_file": old.config_file, "error": "", "applied": live, "restart_needed": later}
