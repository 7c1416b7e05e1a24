"""RFC 9457 problem details, as the platform contract sends every error (docs/platform-dialect.md §Errors).

``code`` is read only from an ``application/problem+json`` body, and only when it is printable and at most 128
characters; ``correlation_id`` from the body, else the ``X-Correlation-Id`` header (at most 256 characters); the
message is ``detail``, else ``title``. A spec control plane's plain error bodies give an empty code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from plexd.base import boundedjson

MAX_CODE = 128
MAX_CORRELATION_ID = 256
MEDIA_TYPE = "application/problem+json"


@dataclass(frozen=True)
class Problem:
    code: str = ""
    message: str = ""
    correlation_id: str = ""
    is_problem: bool = False  # the body was application/problem+json (the platform contract's errors)


def _printable(value: object, limit: int) -> str:
    return value if isinstance(value, str) and 0 < len(value) <= limit and value.isprintable() else ""


def parse_problem(content_type: str, body: bytes, headers: Mapping[str, str] | None = None) -> Problem:
    """The problem in an error answer; an empty Problem when the body is not problem+json."""
    header_id = _printable((headers or {}).get("X-Correlation-Id", ""), MAX_CORRELATION_ID)
    if content_type.split(";")[0].strip().lower() != MEDIA_TYPE:
        return Problem(correlation_id=header_id)
    try:
        doc = boundedjson.parse(body.decode("utf-8", errors="replace"))
    except ValueError:
        return Problem(correlation_id=header_id, is_problem=True)
    if not isinstance(doc, dict):
        return Problem(correlation_id=header_id, is_problem=True)
    message = next((doc[k] for k in ("detail", "title") if isinstance(doc.get(k), str) and doc[k]), "")
    return Problem(code=_printable(doc.get("code"), MAX_CODE), message=message,
                   correlation_id=_printable(doc.get("correlation_id"), MAX_CORRELATION_ID) or header_id,
                   is_problem=True)
