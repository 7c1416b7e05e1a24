"""The platform dialect's wire primitives (docs/platform-dialect.md): problem+json errors, capped raw bodies, strict
JSON objects, and the identifiers and digests its shapes are made of.

Every error is RFC 9457 problem+json `{type, title, status, detail, instance, code, correlation_id}` with the
correlation id mirrored in `X-Correlation-Id`; a problem without a machine code (the contract has a few) has type
`about:blank` and no `code`. Bodies are read as raw bytes: the platform gunzips only its three ingest routes, so a
compressed body anywhere else is simply not JSON.
"""

from __future__ import annotations

import base64
import binascii
import os
import time
import uuid
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from plexd.base import boundedjson
from plexd.base.errors import WireFormatError
from plexd.devplane.wire import DevplaneAPIError

MEDIA_TYPE = "application/problem+json"
PROBLEM_BASE = "https://api.plexsphere.com/problems/"


class Problem(DevplaneAPIError):
    """An error answered as problem+json with the contract's machine `code` ("" for the few it leaves without)."""

    def __init__(self, status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, detail, headers)
        self.code = code


def problem_response(status: int, code: str, detail: str, instance: str,
                     headers: dict[str, str] | None = None) -> JSONResponse:
    correlation_id = uuid.uuid4().hex
    try:
        title = HTTPStatus(status).phrase
    except ValueError:
        title = "Error"
    body: dict[str, Any] = {"type": PROBLEM_BASE + code if code else "about:blank", "title": title,
                            "status": status, "detail": detail, "instance": instance}
    if code:
        body["code"] = code
    body["correlation_id"] = correlation_id
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE,
                        headers={**(headers or {}), "X-Correlation-Id": correlation_id})


# -- bodies ------------------------------------------------------------------------------------------------------

async def read_raw(request: Request, limit: int, too_large: str) -> bytes:
    """The body as sent, at most `limit` bytes (else 413 with the route's code)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise Problem(413, too_large, f"request body of {declared} bytes is larger than the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Problem(413, too_large, f"request body is larger than the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes, code: str, status: int = 400) -> Any:
    """JSON text as Go's decoder reads it (no NaN or Infinity; nesting bounded), or a problem with `code`."""
    try:
        return boundedjson.loads(raw, "body")
    except WireFormatError as exc:
        raise Problem(status, code, str(exc)) from None


def strict_object(value: Any, known: Iterable[str], code: str, what: str = "body") -> dict[str, Any]:
    """A JSON object with no member outside `known` (Go's DisallowUnknownFields)."""
    if not isinstance(value, dict):
        raise Problem(400, code, f"{what}: must be a JSON object")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise Problem(400, code, f"{what}: unknown field {unknown[0]!r}")
    return value


def optional_str(body: dict[str, Any], key: str, code: str) -> str | None:
    """A string member, None when absent; null or another type is a decoding error."""
    if key not in body:
        return None
    value = body[key]
    if not isinstance(value, str):
        raise Problem(400, code, f"{key}: must be a string")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- digests and identifiers -------------------------------------------------------------------------------------

def std_b64_bytes(text: Any) -> bytes | None:
    """The bytes of a standard, padded base64 string, or None."""
    if not isinstance(text, str) or not text or len(text) % 4:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def is_digest32(text: Any) -> bool:
    """Standard base64 of exactly 32 bytes (a SHA-256, a WireGuard key): 44 characters, one '='."""
    raw = std_b64_bytes(text)
    return raw is not None and len(raw) == 32


def is_wireguard_key(text: Any) -> bool:
    """A usable X25519 public key: 32 bytes in standard base64, not all zero."""
    return isinstance(text, str) and len(text) == 44 and is_digest32(text) and text != "A" * 43 + "="


def uuid7() -> str:
    """A UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then random bits; ids sort by creation time."""
    millis = time.time_ns() // 1_000_000
    raw = bytearray(millis.to_bytes(6, "big") + os.urandom(10))
    raw[6] = 0x70 | (raw[6] & 0x0F)
    raw[8] = 0x80 | (raw[8] & 0x3F)
    return str(uuid.UUID(bytes=bytes(raw)))


def canonical_uuid(text: Any) -> str | None:
    """The canonical lower-case form of a non-zero UUID, or None."""
    if not isinstance(text, str):
        return None
    try:
        value = uuid.UUID(text)
    except ValueError:
        return None
    return None if value.int == 0 else str(value)
