"""JSON from outside, decoded with a bound on nesting.

Python's decoder recurses once per level, so a few thousand nested brackets (a few kilobytes) raise
RecursionError from deep inside it. Nothing plexd is sent legitimately nests deeper than a handful of levels;
`loads` refuses anything past `MAX_DEPTH` with a WireFormatError before decoding, so a parser of outside input
only ever raises the project's own error types.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from plexd.base.errors import WireFormatError

MAX_DEPTH = 64
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)  # a string (skipped) or a bracket


def nesting_depth_exceeds(text: str, limit: int = MAX_DEPTH) -> bool:
    """True when arrays/objects in `text` nest deeper than `limit` (brackets inside strings do not count)."""
    return too_deep_at(text, limit) is not None


def too_deep_at(text: str, limit: int = MAX_DEPTH) -> int | None:
    """The offset of the first bracket past `limit` levels of nesting, None when `text` stays within it."""
    if text.count("[") + text.count("{") <= limit or _nests_within(text, limit):  # the common cases, in C
        return None
    depth = 0  # too deep, or brackets that do not pair up: the exact scan finds where
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return m.start()
        elif token in "]}":
            depth -= 1
    return None


_ESCAPE = re.compile(rb"\\.", re.S)
_NOT_BRACKET_OR_QUOTE = bytes(c for c in range(256) if c not in b'[]{}"')
_BARE_STRING = re.compile(rb'"[^"]*"')
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")


def _nests_within(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest at most `limit` deep, decided by C loops (a state of 1,000 peers and
    rules: ~1.5 ms where the token scan takes ~6): escapes, then everything but brackets and quotes, then the
    strings go; each pass of `_EMPTY_PAIR` then removes exactly the innermost level (a pair that becomes empty in
    a pass is removed by the next). False also for brackets that do not pair up."""
    rest = _ESCAPE.sub(b"", text.encode("utf-8", "surrogatepass")).translate(None, _NOT_BRACKET_OR_QUOTE)
    rest = _BARE_STRING.sub(b"", rest)
    for _ in range(limit):
        if not rest:
            return True
        peeled = _EMPTY_PAIR.sub(b"", rest)
        if peeled == rest:
            return False
        rest = peeled
    return not rest


def check_depth(text: str, what: str = "", limit: int = MAX_DEPTH) -> None:
    if nesting_depth_exceeds(text, limit):
        raise WireFormatError(what, f"JSON nested deeper than {limit} levels")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads(text: str | bytes, what: str = "") -> Any:
    """json.loads for outside input: WireFormatError (naming `what`) for bad JSON or excessive nesting."""
    if isinstance(text, bytes | bytearray):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireFormatError(what, f"not valid UTF-8 at byte {exc.start}") from None
    check_depth(text, what)
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except ValueError as exc:
        raise WireFormatError(what, f"invalid JSON: {exc}") from None
    except RecursionError:  # belt and braces: the depth check should make this unreachable
        raise WireFormatError(what, f"JSON nested deeper than {MAX_DEPTH} levels") from None


def parse(text: str | bytes, limit: int = MAX_DEPTH) -> Any:
    """json.loads behind the same depth bound, for callers written against json.loads: every failure, excessive
    nesting included, is a json.JSONDecodeError (a ValueError), so their `except ValueError` keeps holding."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8")  # UnicodeDecodeError is a ValueError too
    at = too_deep_at(text, limit)
    if at is not None:
        raise json.JSONDecodeError(f"JSON nested deeper than {limit} levels", text, at)
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
