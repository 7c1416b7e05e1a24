"""Running the devplane: open the store, bind the socket, run uvicorn programmatically.

Everything an operator can get wrong (bad --listen, a --db that cannot be written, an unreadable admin token
file, a port in use) is checked before serving and ends in one clear line (a PlexdError), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from plexd.base.atomicfile import write_atomic
from plexd.base.errors import ConfigError, PlexdError
from plexd.devplane.deployment import Deployment
from plexd.devplane.server import create_app
from plexd.devplane.store import Store

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    listen: str = "127.0.0.1:8080"
    db: str = "devplane.db"
    admin_token_file: str | None = None
    heartbeat_interval: float = 30.0
    keepalive: float = 15.0
    ip_cooldown: float = 3600.0
    replay_window: float = 300.0
    artifacts_dir: str | None = None
    dialect: str = "spec"  # the node-facing contract: "spec" (docs/protocol.md) or "platform"


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[V6]:PORT`; PORT may be 0 (any free port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8080 (port 0 picks a free one)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ConfigError(f"--listen {text!r}: host must be an IP address or localhost") from None
    return host, int(port)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP, and without
    # it every response (headers, then body) stalls ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(4096)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def load_admin_token(db_path: Path, token_file: str | None) -> str:
    """The admin token: from --admin-token-file, else `<db>.admin-token` (created 0600 on first start)."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--admin-token-file {token_file}: {exc.strerror or exc}") from None
        if not token:
            raise ConfigError(f"--admin-token-file {token_file}: file is empty")
        return token
    path = db_path.with_name(db_path.name + ".admin-token")
    if path.exists():
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"admin token file {path}: {exc.strerror or exc}") from None
        if token:
            return token
    token = secrets.token_urlsafe(24)
    try:
        write_atomic(path, (token + "\n").encode())
    except OSError as exc:
        raise ConfigError(f"cannot write admin token file {path}: {exc.strerror or exc}") from None
    return token


def serve(opts: ServeOptions) -> None:
    host, port = parse_listen(opts.listen)
    db_path = Path(opts.db)
    if db_path.is_dir():
        raise ConfigError(f"--db {db_path}: is a directory; give a file path")
    store = Store(db_path)
    try:
        admin_token = load_admin_token(db_path, opts.admin_token_file)
        deployment = Deployment(store, heartbeat_interval=opts.heartbeat_interval, ip_cooldown=opts.ip_cooldown,
                                replay_window=opts.replay_window, dialect=opts.dialect)
        artifacts = Path(opts.artifacts_dir) if opts.artifacts_dir else db_path.with_name(db_path.name + ".artifacts")
        app = create_app(deployment, admin_token=admin_token, keepalive=opts.keepalive, artifacts_dir=artifacts)
        sock = bind(host, port)
        asyncio.run(_run(app, sock))
    finally:
        store.close()


async def _run(app: object, sock: socket.socket) -> None:
    from sse_starlette.sse import AppStatus

    AppStatus.should_exit = False  # a flag left over from an earlier server in this process would end our streams
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=2,
                            timeout_keep_alive=30, backlog=4096)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            raise PlexdError("devplane failed to start (see the log above)")
        await asyncio.sleep(0.01)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"plexd-devplane listening on http://{shown}:{port}", flush=True)
    log.info("serving", extra={"listen": f"{shown}:{port}"})
    with contextlib.suppress(asyncio.CancelledError):
        await task
    sys.stdout.flush()
