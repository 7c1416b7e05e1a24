"""Reading request bodies safely and checking their shape the way Go's decoder would.

A request body is size-limited (before and after gunzip), must be JSON, and must match the [C] shape of its
endpoint: unknown keys are ignored and keys match case-insensitively (like Go), but a value of the wrong type
fails with a 400 that names the field, exactly where Go's decoder would fail the whole request.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from plexd.base import gojson
from plexd.base.errors import PlexdError

MAX_BODY = 1 << 20  # 1 MiB, compressed and uncompressed, for the agent API
ADMIN_MAX_BODY = 16 << 20  # admin tests publish 1 MiB events on purpose


class DevplaneAPIError(PlexdError):
    """Turns into `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def bearer(request: Request) -> str | None:
    """The token of `Authorization: Bearer <token>`, or None when there is none."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def read_body(request: Request, limit: int = MAX_BODY) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise DevplaneAPIError(413, f"request body of {declared} bytes is larger than the {limit}-byte limit")
        except ValueError:
            raise DevplaneAPIError(400, f"bad Content-Length header {declared!r}") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise DevplaneAPIError(413, f"request body is larger than the {limit}-byte limit")
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip"):
        raise DevplaneAPIError(415, f"unsupported Content-Encoding {encoding!r} (use gzip or none)")
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise DevplaneAPIError(400, f"request body is not valid gzip: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise DevplaneAPIError(413, f"decompressed request body is larger than the {limit}-byte limit")
    if not inflater.eof:
        raise DevplaneAPIError(400, "request body is not valid gzip: truncated stream")
    return out


async def read_json(request: Request, schema: Any = "any", *, allow_empty: bool = False) -> Any:
    """Read, decompress, parse and type-check a JSON body. An empty body is `None` when `allow_empty`."""
    limit = ADMIN_MAX_BODY if request.url.path.startswith("/admin/") else MAX_BODY
    body = await read_body(request, limit)
    if not body.strip():
        if allow_empty:
            return None
        raise DevplaneAPIError(400, "request body is empty; expected JSON")
    try:
        value = json.loads(body, parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise DevplaneAPIError(400, "malformed JSON: body is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise DevplaneAPIError(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise DevplaneAPIError(400, "malformed JSON: nested too deeply") from None
    check(value, schema, "")
    return value


def _no_constants(name: str) -> Any:
    raise DevplaneAPIError(400, f"malformed JSON: {name} is not a JSON value")


_KINDS = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}


def kind(value: Any) -> str:
    return "null" if value is None else _KINDS.get(type(value), type(value).__name__)


def _where(path: str) -> str:
    return path or "body"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# scalar schema -> (accepts the value, what the error says it must be)
_SCALARS: dict[str, tuple[Any, str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "int": (lambda v: _is_number(v) and float(v).is_integer(), "an integer"),
    "num": (_is_number, "a number"),
    "obj": (lambda v: isinstance(v, dict), "an object"),
    "time": (lambda v: isinstance(v, str), "an RFC 3339 time string"),
}


def check(value: Any, schema: Any, path: str) -> None:
    """Raise DevplaneAPIError(400) naming `path` if `value` does not fit `schema` (null fits everything, like Go)."""
    if value is None or schema == "any":
        return
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise DevplaneAPIError(400, f"{_where(path)}: must be an object, got {kind(value)}")
        lowered = {k.lower(): v for k, v in value.items()}
        for key, sub in schema.items():
            if key in lowered:
                check(lowered[key], sub, f"{path}.{key}" if path else key)
        return
    if isinstance(schema, tuple):
        tag, elem = schema
        if tag == "list":
            if not isinstance(value, list):
                raise DevplaneAPIError(400, f"{_where(path)}: must be an array, got {kind(value)}")
            for i, item in enumerate(value):
                check(item, elem, f"{path}[{i}]")
        elif tag == "map":
            if not isinstance(value, dict):
                raise DevplaneAPIError(400, f"{_where(path)}: must be an object, got {kind(value)}")
            for k, item in value.items():
                check(item, elem, f"{path}.{k}" if path else k)
        return
    accepts, want = _SCALARS[schema]
    if not accepts(value):
        raise DevplaneAPIError(400, f"{_where(path)}: must be {want}, got {kind(value)} {_short(value)}")
    if schema == "time":
        try:
            gojson.parse_time(value)
        except ValueError as exc:
            raise DevplaneAPIError(400, f"{_where(path)}: {exc}") from None


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- request shapes (§1) ---------------------------------------------------------------------------------------

_PARAM = {"name": "str", "type": "str", "required": "bool", "description": "str"}
CAPABILITIES = {
    "binary": {"version": "str", "checksum": "str"},
    "builtin_actions": ("list", {"name": "str", "description": "str", "parameters": ("list", _PARAM)}),
    "hooks": ("list", {"name": "str", "description": "str", "source": "str", "checksum": "str",
                       "parameters": ("list", _PARAM), "timeout": "str", "sandbox": "str"}),
}
REGISTER = {"token": "str", "public_key": "str", "hostname": "str", "metadata": ("map", "str"),
            "capabilities": CAPABILITIES}
HEARTBEAT = {
    "node_id": "str", "timestamp": "time", "status": "str", "uptime": "str", "binary_checksum": "str",
    "mesh": {"interface": "str", "peer_count": "int", "listen_port": "int"},
    "nat": {"public_endpoint": "str", "type": "str"},
    "bridge": {"enabled": "bool", "access_interface": "str", "active_routes": "int", "relay_enabled": "bool",
               "active_relay_sessions": "int", "ingress_enabled": "bool", "active_ingress_rules": "int",
               "site_to_site_enabled": "bool", "active_site_to_site_tunnels": "int"},
    "user_access": {"enabled": "bool", "interface_name": "str", "peer_count": "int", "listen_port": "int"},
    "ingress": {"enabled": "bool", "rule_count": "int", "connection_count": "int"},
    "site_to_site": {"enabled": "bool", "tunnel_count": "int"},
}
KEY_ROTATE = {"node_id": "str", "new_public_key": "str"}
ENDPOINT = {"public_endpoint": "str", "nat_type": "str"}
DRIFT = {"timestamp": "time", "corrections": ("list", {"type": "str", "detail": "str"})}
REPORT = {"entries": ("list", {"key": "str", "content_type": "str", "payload": "any", "version": "int",
                               "updated_at": "time"}),
          "deleted": ("list", "str")}
ACK = {"execution_id": "str", "status": "str", "reason": "str"}
RESULT = {"execution_id": "str", "status": "str", "exit_code": "int", "stdout": "str", "stderr": "str",
          "duration": "str", "finished_at": "time",
          "triggered_by": {"type": "str", "session_id": "str", "user_id": "str", "email": "str"}}
METRICS = ("list", {"timestamp": "time", "group": "str", "peer_id": "str", "data": "any"})
LOGS = ("list", {"timestamp": "time", "source": "str", "unit": "str", "message": "str", "severity": "str",
                 "hostname": "str"})
AUDIT = ("list", {"timestamp": "time", "source": "str", "event_type": "str", "subject": "any", "object": "str",
                  "action": "str", "result": "str", "hostname": "str", "raw": "str"})
TUNNEL_READY = {"listen_addr": "str", "timestamp": "time"}
TUNNEL_CLOSED = {"reason": "str", "duration": "str", "timestamp": "time"}
INTEGRITY = {"type": "str", "path": "str", "expected_checksum": "str", "actual_checksum": "str", "detail": "str",
             "timestamp": "time"}


_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9._+-]+$")


def is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def safe_component(part: str) -> bool:
    """A path component that stays in its directory: no separator, not . or .."""
    return bool(_SAFE_COMPONENT.match(part)) and part not in (".", "..")


def etagged_json(request: Request, doc: Any) -> Response:
    """`doc` as JSON with an ETag of its bytes: asked again with `If-None-Match` and unchanged, a 304 (a node
    parses nothing; the Go control plane has no ETag, and plexd works either way)."""
    body = JSONResponse(doc).body
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(body, media_type="application/json", headers={"ETag": etag})
