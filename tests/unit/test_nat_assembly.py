"""How the composition root builds NAT traversal from the config: off means no service, no port hand-over and no
heartbeat block; on, the listen port is bound before any converge and the mesh waits for it to be let go."""

from __future__ import annotations

import asyncio
import socket

from plexd.config.settings import load
from plexd.converge.coalesce import Requests
from plexd.nat.nat_service import disabled_status
from plexd.node.builders import build_nat


def config(tmp_path, port: int, **env: str):
    return load(env={"PLEXD_CONFIG": "", "PLEXD_DATA_DIR": str(tmp_path), "PLEXD_MESH_LISTEN_PORT": str(port),
                     "PLEXD_API": "http://127.0.0.1:9", "PLEXD_API_ALLOW_INSECURE": "true", **env})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


async def test_disabled_or_without_servers_there_is_no_nat_service(tmp_path) -> None:
    port = free_port()
    for env, why in (({"PLEXD_NAT_TRAVERSAL_ENABLED": "false", "PLEXD_NAT_TRAVERSAL_STUN_SERVERS": "192.0.2.1"},
                      "nat_traversal.enabled is false"),
                     ({}, "no nat_traversal.stun_servers configured")):
        cfg = config(tmp_path, port, **env)
        assert build_nat(cfg, Requests()) is None
        assert disabled_status(cfg.nat_traversal) == {"enabled": False, "reason": why}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("0.0.0.0", port))  # nothing holds the listen port


async def test_enabled_binds_the_listen_port_until_the_first_discovery_lets_it_go(tmp_path) -> None:
    port = free_port()
    cfg = config(tmp_path, port, PLEXD_NAT_TRAVERSAL_STUN_SERVERS="192.0.2.1,192.0.2.2:3479")
    built = build_nat(cfg, Requests())
    assert built is not None and built.handover is not None
    nat = built.service
    assert [str(s) for s in nat.servers] == ["192.0.2.1:3478", "192.0.2.2:3479"]
    assert disabled_status(cfg.nat_traversal) is None
    assert nat.current() is None and nat.status()["public_endpoint"] == ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind(("0.0.0.0", port))
            raise AssertionError("the listen port should be held for the first discovery")
        except OSError:
            pass
    built.handover.release()  # what the first discovery does when it is done (or the 3 s deadline)
    await asyncio.wait_for(built.handover.released(), 1)  # what the gate awaits before its first converge
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("0.0.0.0", port))  # the device can have it now
