"""The ``system`` metrics group (docs/protocol.md §1.14) from /proc and statvfs: CPU use since the previous
sample, memory in use (MemTotal − MemAvailable), the root filesystem, and bytes through every interface but
loopback (of the network namespace plexd runs in)."""

from __future__ import annotations

import os
from typing import Any


class SystemSampler:
    def __init__(self, proc: str = "/proc", disk: str = "/") -> None:
        self.proc, self.disk = proc, disk
        self._cpu: tuple[int, int] | None = None  # (busy, total) jiffies at the previous sample

    def sample(self) -> dict[str, Any]:
        mem_total, mem_used = self._memory()
        disk_total, disk_used = self._disk()
        rx, tx = self._network()
        return {"cpu_usage_percent": self._cpu_percent(), "memory_used_bytes": mem_used,
                "memory_total_bytes": mem_total, "disk_used_bytes": disk_used, "disk_total_bytes": disk_total,
                "network_rx_bytes": rx, "network_tx_bytes": tx}

    def _cpu_percent(self) -> float:
        with open(f"{self.proc}/stat", "rb") as fh:
            parts = [int(x) for x in fh.readline().split()[1:]]
        idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
        total = sum(parts[:8])  # guest time is already in user and nice
        busy = total - idle
        previous, self._cpu = self._cpu, (busy, total)
        if previous is None or total <= previous[1]:
            return 0.0
        return round(100.0 * (busy - previous[0]) / (total - previous[1]), 2)

    def _memory(self) -> tuple[int, int]:
        values: dict[str, int] = {}
        with open(f"{self.proc}/meminfo", "rb") as fh:
            for line in fh:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable"):
                    values[key.decode()] = int(rest.split()[0]) * 1024
        total = values.get("MemTotal", 0)
        return total, total - values.get("MemAvailable", total)

    def _disk(self) -> tuple[int, int]:
        st = os.statvfs(self.disk)
        total = st.f_blocks * st.f_frsize
        return total, total - st.f_bfree * st.f_frsize

    def _network(self) -> tuple[int, int]:
        rx = tx = 0
        with open(f"{self.proc}/net/dev", "rb") as fh:
            for line in fh.readlines()[2:]:
                name, _, counters = line.partition(b":")
                if name.strip() == b"lo":
                    continue
                fields = counters.split()
                rx += int(fields[0])
                tx += int(fields[8])
        return rx, tx
