"""The CLI's side of the daemon's socket: stdlib http.client over AF_UNIX (no httpx import, fast start-up).

`call` returns the decoded JSON answer; raises `DaemonNotRunning` when nothing listens on the socket (the CLI then
works from the stored files) and `PlexdError` with one clear line when the daemon refuses the caller.
"""

from __future__ import annotations

import errno
import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

from plexd.base import boundedjson
from plexd.base.errors import PlexdError

TIMEOUT = 120.0  # a reconcile cycle may take a while on a large mesh


class DaemonNotRunning(PlexdError):
    """Nothing listens on the daemon's socket `socket_path`: no daemon runs."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(f"no plexd daemon is running (nothing listens on {socket_path})")
        self.socket_path = socket_path


class DaemonRefused(PlexdError):
    """The daemon answered with an error status; `reason` is its own message."""

    def __init__(self, message: str, status: int, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


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
    conn = _connect(socket_path, timeout, admin_group)
    try:
        response = _request(conn, socket_path, method, path, body, headers)
        try:
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise PlexdError(f"the plexd daemon at {socket_path} did not answer: {exc}") from None
    finally:
        conn.close()
    doc = _decode(data)
    if response.status >= 400:
        raise _refused(method, path, response.status, doc, data)
    return doc


def stream(socket_path: str, method: str, path: str, body: Any = None, *, admin_group: str = "plexd-admin",
           timeout: float = TIMEOUT) -> Iterator[Any]:
    """A streamed answer, one JSON document per line as the daemon sends it (``plexd actions run --local``)."""
    conn = _connect(socket_path, timeout, admin_group)
    try:
        response = _request(conn, socket_path, method, path, body, None)
        if response.status >= 400:
            data = response.read()
            raise _refused(method, path, response.status, _decode(data), data)
        try:
            for line in response:
                if line.strip():
                    yield boundedjson.parse(line)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise PlexdError(f"the plexd daemon at {socket_path} broke off its answer: {exc}") from None
    finally:
        conn.close()


def _connect(socket_path: str, timeout: float, admin_group: str) -> _UnixConnection:
    conn = _UnixConnection(socket_path, timeout)
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
    return conn


def _request(conn: _UnixConnection, socket_path: str, method: str, path: str, body: Any,
             headers: dict[str, str] | None) -> http.client.HTTPResponse:
    payload = None if body is None else json.dumps(body).encode()
    headers = {**({"Content-Type": "application/json"} if payload is not None else {}), **(headers or {})}
    try:
        conn.request(method, path, body=payload, headers=headers)
        return conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise PlexdError(f"the plexd daemon at {socket_path} did not answer: {exc}") from None


def _decode(data: bytes) -> Any:
    try:
        return boundedjson.parse(data) if data.strip() else None
    except ValueError:
        return None


def _refused(method: str, path: str, status: int, doc: Any, data: bytes) -> DaemonRefused:
    message = doc.get("error") if isinstance(doc, dict) else data.decode("utf-8", "replace").strip()
    return DaemonRefused(f"the plexd daemon refused {method} {path}: {message} (HTTP {status})", status,
                         str(message))
