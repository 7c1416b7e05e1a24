"""The local actions audit log: who ran what through ``plexd actions run --local``, and how it ended.

One JSON object per line in ``data_dir/actions/local-audit.log`` (0600): ``time`` (RFC 3339 UTC), ``event``
(``started`` | ``finished`` | ``refused``), ``execution_id``, ``action``, ``uid``, ``gid``, ``pid`` of the
caller (SO_PEERCRED), ``parameters`` (names only: values may be sensitive and the control plane sees them in
the result anyway), and for ``finished`` the ``status`` and ``exit_code``; for ``refused`` the ``reason``. At
`MAX_BYTES` the file is rotated to ``local-audit.log.1`` (one generation kept).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from plexd.base.gojson import format_time, now_utc

log = logging.getLogger(__name__)

MAX_BYTES = 10 << 20


class LocalAudit:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def record(self, event: str, **fields: Any) -> None:
        line = json.dumps({"time": format_time(now_utc()), "event": event, **fields}, ensure_ascii=False,
                          separators=(",", ":")) + "\n"
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.path.exists() and self.path.stat().st_size + len(line) > MAX_BYTES:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, line.encode("utf-8", "backslashreplace"))  # a lone surrogate: escaped, not a crash
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("cannot write the local actions audit log %s: %s (%s)", self.path, exc.strerror, event)
