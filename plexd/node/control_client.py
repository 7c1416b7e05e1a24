"""The CLI's side of the daemon's socket: stdlib http.client over AF_UNIX (no httpx import, fast start-up).

`call` returns the decoded JSON answer; raises `DaemonNotRunning` when nothing listens on the socket (the CLI then
works from the stored files) and `PlexdError` with one clear line when the daemon refuses the caller.
"""

from __future__ import annotations

import errno
import http.client
import json
import socket
from typing import Any

from plexd.errors import PlexdError

TIMEOUT = 120.0  # a reconcile cycle may take a while on a large mesh


class DaemonNotRunning(Exception):
    pass


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def call(socket_path: str, method: str, path: str, body: Any = None, *, admin_group: str = "plexd-admin",
         timeout: float = TIMEOUT, headers: dict[str, str] | None = None) -> Any:
    conn = _UnixConnection(socket_path, timeout)
    try:
        try:
            conn.connect()
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonNotRunning(socket_path) from None
        except PermissionError:
            raise PlexdError(f"cannot reach the plexd daemon at {socket_path}: permission denied (run as root or "
                             f"as a member of group {admin_group})") from None
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                raise DaemonNotRunning(socket_path) from None
            raise PlexdError(f"cannot reach the plexd daemon at {socket_path}: {exc.strerror or exc}") from None
        payload = None if body is None else json.dumps(body).encode()
        headers = {**({"Content-Type": "application/json"} if payload is not None else {}), **(headers or {})}
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise PlexdError(f"the plexd daemon at {socket_path} did not answer: {exc}") from None
    finally:
        conn.close()
    try:
        doc = json.loads(data) if data.strip() else None
    except ValueError:
        doc = None
    if response.status >= 400:
        message = doc.get("error") if isinstance(doc, dict) else data.decode("utf-8", "replace").strip()
        raise PlexdError(f"the plexd daemon refused {method} {path}: {message} (HTTP {response.status})")
    return doc
