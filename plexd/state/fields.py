"""The readers of the control plane's JSON documents the model shares (an object's fields, a text field), and how
it names a bad one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plexd.base.errors import WireFormatError


def kind(value: Any) -> str:
    """A JSON value's type as the wire names it, for errors ("number", "array", "null", ...)."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def object_fields(obj: Any, path: str) -> dict[str, Any]:
    """A JSON object's fields under lower-cased keys: Go's decoder matches keys case-insensitively."""
    if not isinstance(obj, dict):
        raise WireFormatError(path, f"must be a JSON object, got {kind(obj)}")
    return {str(k).lower(): v for k, v in obj.items()}


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def text(doc: Mapping[str, Any], key: str, path: str, default: str = "", *, required: bool = False,
         limit: int | None = None, printable_ascii: bool = False) -> str:
    """`doc[key]` as a string; absent (or null) gives `default` unless `required`, which also refuses "". `limit`
    bounds its length; `printable_ascii` (ids and names) allows printable ASCII only. WireFormatError names the
    field's path and what is wrong."""
    value = doc.get(key)
    if value is None and not required:
        return default
    if not isinstance(value, str):
        raise WireFormatError(join(path, key), f"must be a {'non-empty ' if required else ''}string, got {kind(value)}")
    if required and not value:
        raise WireFormatError(join(path, key), "must be a non-empty string")
    if printable_ascii and ((limit is not None and len(value) > limit) or not value.isprintable()
                            or not value.isascii()):
        raise WireFormatError(join(path, key), f"must be printable ASCII of at most {limit} characters")
    if limit is not None and len(value) > limit:
        raise WireFormatError(join(path, key), f"longer than {limit} characters")
    return value
