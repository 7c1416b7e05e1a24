"""A relay on its own, driven over stdin/stdout: for the lab tests and the bench until the relay is a domain of
the converge engine (issue 32). Not a daemon: nothing in plexd/node starts it.

    python -m plexd.bridge.standalone --listen 0.0.0.0:51821

One JSON command per stdin line, one JSON answer per stdout line:
    {"sessions": [RelaySessionAssignment, ...]}   -> {"ok": true, "refused": [...]}
    {"cp_reachable": false}                       -> {"ok": true}
    {"status": true}                              -> the relay's status document
    {"fastpath": "RELAY_IPV4"} / {"fastpath": ""} -> the kernel fast path on / off: {"ok": true}
EOF to stdin stops the relay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from plexd import boundedjson
from plexd.bridge.relay import DEFAULT_PORT, Relay
from plexd.bridge.sessions import RelaySessionSet
from plexd.errors import PlexdError


async def serve(host: str, port: int) -> None:
    reachable = [True]
    relay = Relay(host, port, cp_reachable=lambda: reachable[0])
    await relay.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ok": True, "port": relay.port}), flush=True)
    try:
        while line := await reader.readline():
            answer = await _fastpath_command(relay, line)
            print(json.dumps(answer or _command(relay, reachable, line)), flush=True)
    finally:
        await relay.stop()


async def _fastpath_command(relay: Relay, line: bytes) -> dict[str, Any] | None:
    try:
        cmd = boundedjson.parse(line)
    except ValueError:
        return None
    if not isinstance(cmd, dict) or "fastpath" not in cmd:
        return None
    try:
        if cmd["fastpath"]:
            await relay.enable_fastpath(str(cmd["fastpath"]))
        else:
            await relay.disable_fastpath()
    except (ValueError, PlexdError) as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True}


def _command(relay: Relay, reachable: list[bool], line: bytes) -> dict[str, Any]:
    try:
        cmd = boundedjson.parse(line)
        if "sessions" in cmd:
            got = RelaySessionSet.from_state({"bridge": {"relay": {"sessions": cmd["sessions"]}}})
            relay.set_sessions(list(got.sessions.values()))
            return {"ok": True, "refused": [r.reason for r in got.refused]}
        if "cp_reachable" in cmd:
            reachable[0] = bool(cmd["cp_reachable"])
            return {"ok": True}
        if "sweep" in cmd:
            return {"ok": True, "expired": relay.sweep()}
        return relay.status()
    except (ValueError, PlexdError) as e:
        return {"ok": False, "error": str(e)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m plexd.bridge.standalone")
    parser.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", help="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    asyncio.run(serve(host, int(port)))


if __name__ == "__main__":
    main()
