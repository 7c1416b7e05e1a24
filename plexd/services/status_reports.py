"""A bridge's status published as node-state report entries: `status.bridge`, `status.user-access`,
`status.ingress` and `status.site-to-site` (docs/protocol.md §A2.3), each only when it changed.

They go into the node's report store like any report entry, so the report sync carries them upstream through
its durable queue (and the local node API lists them). Each payload is at most 4 KiB, as the newer contract
caps it: a list that would pass that is cut, and the payload says `truncated`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from plexd.nodeapi.reports import EntryTooLarge, ReportStore, StoreFull

log = logging.getLogger(__name__)

MAX_PAYLOAD = 4096
CONTENT_TYPE = "application/json"

Sample = Callable[[], Mapping[str, Mapping[str, Any]]]


def bounded(payload: Mapping[str, Any]) -> dict[str, Any]:
    """`payload` within MAX_PAYLOAD bytes of JSON: its longest list is shortened until it fits."""
    out = dict(payload)
    while len(json.dumps(out, separators=(",", ":"))) > MAX_PAYLOAD:
        lists = [k for k, v in out.items() if isinstance(v, list) and v]
        if not lists:
            break
        longest = max(lists, key=lambda k: len(out[k]))
        out[longest] = out[longest][:-1]
        out["truncated"] = True
    return out


class StatusReports:
    def __init__(self, reports: ReportStore, sample: Sample, interval: float,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.reports = reports
        self.sample = sample
        self.interval = interval
        self._sleep = sleep
        self.published = 0
        self._failing: set[str] = set()

    async def publish(self) -> list[str]:
        """Write the entries whose payload changed; the keys written."""
        written = []
        for key, payload in self.sample().items():
            value = bounded(payload)
            entry = self.reports.get(key)
            if entry is not None and entry.payload == value:
                continue
            try:
                await self.reports.put(key, CONTENT_TYPE, value, None)
            except (StoreFull, EntryTooLarge, OSError) as e:
                if key not in self._failing:
                    log.error("status report %s not published: %s", key, e)
                    self._failing.add(key)
                continue
            self._failing.discard(key)
            self.published += 1
            written.append(key)
        return written

    async def run(self) -> None:
        while True:
            await self.publish()
            await self._sleep(self.interval)
