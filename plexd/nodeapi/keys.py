"""Keys from outside (URL paths, the control plane) and the file names they are stored under.

A report key comes from a local workload and must be a plain name: not empty, not `.` or `..`, no `/` or `\\`,
no control character (NUL included), at most `MAX_KEY_BYTES` bytes of UTF-8. Data keys come from the control plane
and are stored whatever they are: `file_name` maps any key to one file name inside its directory, so no key can
escape it (the Go agent joins data keys into paths as they are, §8.6 [I]). Files are found again by the `key`
field inside them, never by their names.
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import unquote_to_bytes

from plexd.base.errors import PlexdError

MAX_KEY_BYTES = 255
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


class BadKey(PlexdError):
    """A key that cannot be used; the message names why."""


def report_key_problem(key: str) -> str:
    """Why `key` cannot be a report key, or "" when it can."""
    if not key:
        return "key is empty"
    if key in (".", ".."):
        return f"key {key!r} is a path component"
    if "/" in key or "\\" in key:
        return "key contains a path separator ('/' or '\\')"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        return "key contains a control character"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "key is not valid UTF-8"
    if size > MAX_KEY_BYTES:
        return f"key is {size} bytes long; the limit is {MAX_KEY_BYTES}"
    return ""


def path_key(segment: str) -> str:
    """The key a URL path segment names, percent-decoded. Raises BadKey when it is not UTF-8."""
    try:
        return unquote_to_bytes(segment).decode("utf-8")
    except UnicodeDecodeError:
        raise BadKey(f"key {segment[:80]!r} is not valid UTF-8 once percent-decoded") from None


def file_name(key: str) -> str:
    """The file a key is stored in: `<key>.json` for a plain name, else `~<sha256 of the key>.json` (`~` never
    starts a plain name, so the two kinds cannot collide)."""
    if _PLAIN.fullmatch(key):
        return f"{key}.json"
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    return f"~{digest}.json"
