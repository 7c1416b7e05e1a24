"""The server side of bench ssh_sessions, in a process of its own so its RSS and CPU are the server's alone.

Reads N on argv, starts N `SshSessionServer`s on 127.0.0.1 for the running user, prints one JSON line
{"pid", "sessions": [[port, token], ...]}, then answers each line on stdin ("live") with the number of sessions
whose process runs, and stops at EOF.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import sys
import tempfile
import time

from nacl.signing import SigningKey

from plexd.access.ssh import SshSessionServer
from plexd.access.ssh_host_key import load_or_create_host_key
from plexd.access.token import sign_session_token
from plexd.base.children import watch_children_with_pidfds
from plexd.state.sessions_block import Session, SshTarget


def running(server: SshSessionServer) -> int:
    return sum(1 for conn in server.connections for chan in conn.channels if chan.proc is not None)


async def main(count: int) -> None:
    user = pwd.getpwuid(os.geteuid()).pw_name
    key = SigningKey.generate()
    servers: list[SshSessionServer] = []
    out = []
    with tempfile.TemporaryDirectory() as key_dir:
        host_key = load_or_create_host_key(key_dir)
        for i in range(count):
            sid = f"bench_{i}"
            server = SshSessionServer(Session(sid, "ssh", SshTarget(user), time.time() + 3600), "127.0.0.1",
                                      host_key=host_key, keys=lambda: [key.verify_key], is_live=lambda s: True,
                                      record_command=lambda s, c: True)
            out.append([await server.start(), sign_session_token(
                key, {"jti": sid, "kind": "ssh", "target": {"kind": "ssh", "user": user}, "exp": time.time() + 3600})])
            servers.append(server)
        print(json.dumps({"pid": os.getpid(), "user": user, "sessions": out}), flush=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while await reader.readline():
            print(sum(running(s) for s in servers), flush=True)
        await asyncio.gather(*(s.close("plexd_close") for s in servers))


if __name__ == "__main__":
    watch_children_with_pidfds()  # as `plexd up` does
    asyncio.run(main(int(sys.argv[1])))
