"""The relay domain on its own, driven over stdin/stdout: for the lab tests and the bench (the daemon runs the same
domain in `mode: bridge`, from the control plane's state). Not a daemon.

    python -m plexd.bridge.standalone --listen 0.0.0.0:51821

One JSON command per stdin line, one JSON answer per stdout line:
    {"sessions": [RelaySessionAssignment, ...]}   -> {"ok": true, "refused": [...]}   a new listing (event path)
    {"converge": true}                            -> {"ok": true, "changes": [...], "errors": [...]}   the reconcile
    {"cp_reachable": false}                       -> {"ok": true}
    {"sweep": true}                               -> {"ok": true, "expired": [...]}
    {"status": true}                              -> the relay's status document
    {"fastpath": "RELAY_IPV4"} / {"fastpath": ""} -> the kernel fast path on / off: {"ok": true}
EOF to stdin stops the relay.

There are no state's peers here: a session's sides' WireGuard public keys, which the relay checks every
handshake's mac1 with, come from the session itself (`peer_a_public_key`, `peer_b_public_key`); a side without
one gets no handshake relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from plexd.base import boundedjson
from plexd.base.errors import PlexdError
from plexd.bridge.relay import DEFAULT_PORT
from plexd.bridge.relay_domain import RelayDomain
from plexd.converge.engine import Engine
from plexd.state.desired import DesiredState
from plexd.state.model import State


class Standalone:
    def __init__(self, host: str, port: int) -> None:
        self.reachable = True
        self.domain = RelayDomain(host, port, cp_reachable=lambda: self.reachable)
        self.engine = Engine([self.domain])
        self.desired = DesiredState.initial(interface="plexd0", listen_port=0, mtu=1420, private_key="",
                                            mesh_ip="")

    async def command(self, line: bytes) -> dict[str, Any]:
        relay = self.domain.relay
        try:
            cmd = boundedjson.parse(line)
            if not isinstance(cmd, dict):
                raise ValueError("a command is a JSON object")
            if "sessions" in cmd:
                self.desired = self.desired.with_state(State.from_wire({"bridge": {"relay": {
                    "sessions": cmd["sessions"]}}}))
                await self.engine.apply_delta(self.desired)
                return {"ok": True, "refused": [r.reason for r in self.desired.relay.refused]}
            if "converge" in cmd:
                result = await self.engine.converge(self.desired)
                return {"ok": True, "changes": [str(c.correction()) for c in result.changes],
                        "errors": list(result.errors)}
            if "cp_reachable" in cmd:
                self.reachable = bool(cmd["cp_reachable"])
                return {"ok": True}
            if "sweep" in cmd:
                return {"ok": True, "expired": relay.sweep()}
            if "fastpath" in cmd:
                self.domain.fastpath_address = str(cmd["fastpath"] or "")
                if self.domain.fastpath_address:
                    await relay.enable_fastpath(self.domain.fastpath_address)
                else:
                    await relay.disable_fastpath()
                return {"ok": True}
            return relay.status()
        except (ValueError, PlexdError) as e:
            return {"ok": False, "error": str(e)}


async def serve(host: str, port: int) -> None:
    standalone = Standalone(host, port)
    first = await standalone.engine.converge(standalone.desired)
    if first.errors:
        print(json.dumps({"ok": False, "errors": list(first.errors)}), flush=True)
        return
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ok": True, "port": standalone.domain.relay.port}), flush=True)
    try:
        while line := await reader.readline():
            print(json.dumps(await standalone.command(line)), flush=True)
    finally:
        await standalone.engine.teardown()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m plexd.bridge.standalone")
    parser.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", help="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    asyncio.run(serve(host, int(port)))


if __name__ == "__main__":
    main()
