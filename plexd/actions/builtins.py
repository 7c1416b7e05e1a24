"""The built-in actions, each announced with its parameters in the capabilities (``builtin_actions``).

    system.info             host, kernel, plexd, node and mesh facts, as JSON
    health.check            what `plexd status` knows, as JSON; exit 1 when the node is degraded
    diagnostics.ping_peer   peer_id [count] → ICMP to the peer's mesh IP over the mesh, with loss and RTT
    diagnostics.collect     status, recent log lines, the WireGuard device and the nftables table (no secrets)
    mesh.reconnect          reconnect the event stream, then run one reconcile cycle
    config.dump             the effective configuration and where each value came from (secrets hidden)
    service.reload_config   re-read the config file; apply what can change live, list what needs a restart
    service.upgrade         version checksum [allow_downgrade] → download, verify (signature, checksum,
                            version) and install a release, restart into it with the tunnels up; the result
                            is sent once the new release is healthy, or rolled back

A built-in sees the node only through `NodeView`, which the composition root fills in: it cannot reach
anything else. Output is JSON on stdout; an exception becomes status ``error`` with the message on stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import socket
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from plexd import __version__
from plexd.base.childenv import child_environment

Json = dict[str, Any]

# The execution a built-in runs for (set by the dispatcher): an action whose result comes later needs its id.
EXECUTION: ContextVar[str] = ContextVar("plexd_action_execution", default="")


@dataclass
class NodeView:
    """What built-ins may read and do, as plain callables (no daemon objects)."""

    node_id: Callable[[], str]
    mesh_ip: Callable[[], str]
    status: Callable[[], Awaitable[Json]]  # the `plexd status --json` document
    peer_ips: Callable[[], dict[str, str]]  # peer id → mesh IP, from the desired model
    device: Callable[[], Awaitable[list[Json]]]  # the live WireGuard peers (public data only)
    firewall: Callable[[], Awaitable[Any]]  # the live `inet plexd` table as nftables JSON
    config: Callable[[], Json]  # key → {value, source}, secrets hidden
    reconnect: Callable[[], Awaitable[Json]]  # reconnect the stream, reconcile once
    reload_config: Callable[[], Awaitable[Json]]
    recent_logs: Callable[[int], list[str]]
    # version, checksum, execution id → the install's output (plexd.upgrade.upgrader); None: not on this node
    upgrade: Callable[[str, str, str, bool], Awaitable[Output]] | None = None


@dataclass(frozen=True)
class Output:
    exit_code: int
    stdout: str
    stderr: str = ""
    deferred: bool = False  # the outcome is not known yet: the result is sent later (service.upgrade)


BuiltinFn = Callable[[NodeView, dict[str, str]], Awaitable[Output]]


@dataclass(frozen=True)
class Builtin:
    name: str
    description: str
    parameters: tuple[Json, ...] | None
    run: BuiltinFn

    def to_wire(self) -> Json:
        return {"name": self.name, "description": self.description,
                "parameters": [dict(p) for p in self.parameters or ()] or None}  # Go's nil slice: null


def _param(name: str, description: str, *, required: bool = False, type_: str = "string") -> Json:
    return {"name": name, "type": type_, "required": required, "description": description}


def json_output(doc: Any, exit_code: int = 0, *, deferred: bool = False) -> Output:
    """A built-in's output: `doc` as indented JSON on stdout."""
    return Output(exit_code, json.dumps(doc, indent=2, ensure_ascii=False, default=str) + "\n", deferred=deferred)


async def system_info(view: NodeView, params: dict[str, str]) -> Output:
    uname = os.uname()
    mem = _meminfo()
    status = await view.status()
    return json_output({
        "hostname": socket.gethostname(), "os": uname.sysname.lower(), "kernel": uname.release,
        "arch": platform.machine(), "python_version": platform.python_version(), "plexd_version": __version__,
        "node_id": view.node_id(), "mesh_ip": view.mesh_ip(), "peer_count": (status.get("peers") or {}).get(
            "on_device"), "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
        "memory_total_bytes": mem.get("MemTotal"), "memory_available_bytes": mem.get("MemAvailable"),
        "uptime_seconds": (status.get("daemon") or {}).get("uptime_seconds"),
    })


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


async def health_check(view: NodeView, params: dict[str, str]) -> Output:
    status = await view.status()
    healthy = (status.get("health") or {}).get("status") == "healthy"
    return json_output(status, 0 if healthy else 1)


_RTT = re.compile(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms")
_COUNTS = re.compile(r"(\d+) packets transmitted, (\d+) (?:packets )?received")


async def ping_peer(view: NodeView, params: dict[str, str]) -> Output:
    peer_id = params["peer_id"]
    ip = view.peer_ips().get(peer_id)
    if ip is None:
        return Output(1, "", f"unknown peer {peer_id!r}: not in this node's mesh\n")
    count_text = params.get("count") or "3"
    if not count_text.isdigit() or not 1 <= int(count_text) <= 20:
        return Output(1, "", f"count {count_text!r}: must be a whole number from 1 to 20\n")
    proc = await asyncio.create_subprocess_exec(
        "ping", "-n", "-c", count_text, "-i", "0.2", "-W", "2", ip, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_environment())
    out, err = await proc.communicate()
    text = out.decode(errors="replace")
    counts = _COUNTS.search(text)
    rtt = _RTT.search(text)
    sent, received = (int(counts.group(1)), int(counts.group(2))) if counts else (int(count_text), 0)
    doc = {"peer_id": peer_id, "mesh_ip": ip, "transmitted": sent, "received": received,
           "loss_percent": round(100 * (sent - received) / sent, 1) if sent else 100.0,
           "rtt_ms": ({"min": float(rtt.group(1)), "avg": float(rtt.group(2)), "max": float(rtt.group(3))}
                      if rtt else None)}
    return Output(0 if received else 1, json.dumps(doc, indent=2) + "\n", err.decode(errors="replace"))


async def collect(view: NodeView, params: dict[str, str]) -> Output:
    doc: Json = {"status": await view.status(), "recent_logs": view.recent_logs(200)}
    for key, read in (("device", view.device), ("firewall", view.firewall)):
        try:
            doc[key] = await read()
        except Exception as exc:  # a diagnostics dump reports what it could not read
            doc[key] = {"error": str(exc) or type(exc).__name__}
    doc["config"] = view.config()
    return json_output(doc)


async def reconnect(view: NodeView, params: dict[str, str]) -> Output:
    doc = await view.reconnect()
    return json_output(doc, 0 if doc.get("ok") else 1)


async def config_dump(view: NodeView, params: dict[str, str]) -> Output:
    return json_output(view.config())


async def reload_config(view: NodeView, params: dict[str, str]) -> Output:
    doc = await view.reload_config()
    return json_output(doc, 0 if not doc.get("error") else 1)


async def upgrade(view: NodeView, params: dict[str, str]) -> Output:
    if view.upgrade is None:
        return Output(1, "", "self-upgrade is not available in this plexd\n")
    allow_downgrade = params.get("allow_downgrade", "").strip().lower() in ("true", "1", "yes")
    return await view.upgrade(params["version"], params["checksum"], EXECUTION.get(), allow_downgrade)


BUILTINS: dict[str, Builtin] = {b.name: b for b in (
    Builtin("system.info", "host, kernel, plexd, node and mesh facts as JSON", (), system_info),
    Builtin("health.check", "the daemon's status document as JSON; exit status 1 when degraded", (), health_check),
    Builtin("diagnostics.ping_peer", "ICMP echo to a peer's mesh IP over the mesh: loss and round-trip times",
            (_param("peer_id", "the peer's node id", required=True),
             _param("count", "echo requests to send, 1 to 20 (default 3)", type_="integer")), ping_peer),
    Builtin("diagnostics.collect", "status, recent log lines, the WireGuard device and the nftables table, "
            "secrets redacted", (), collect),
    Builtin("mesh.reconnect", "reconnect the event stream, then run one reconcile cycle", (), reconnect),
    Builtin("config.dump", "the effective configuration with each value's source, secrets redacted", (),
            config_dump),
    Builtin("service.reload_config", "re-read the config file: apply what can change live, list what needs a "
            "restart", (), reload_config),
    Builtin("service.upgrade", "download the plexd release `version`, verify its SHA-256 against `checksum`, "
            "install it beside the running one and restart into it with the tunnels up; the result follows once "
            "it is healthy, or after an automatic rollback",
            (_param("version", "the release to install, e.g. 0.2.0", required=True),
             _param("checksum", "its SHA-256, 64 hex digits", required=True),
             _param("allow_downgrade", "install an older release (the node's upgrade.allow_downgrade must also be "
                    "true)", type_="boolean")), upgrade),
)}


def builtin_capabilities() -> list[Json]:
    """The ``builtin_actions`` of the capabilities document, in a stable order."""
    return [b.to_wire() for b in BUILTINS.values()]
