"""What a DNS host name may look like: labels of 1-63 letters, digits and inner hyphens, 253 characters in all.

One rule for every name that comes from outside (peer endpoints, session targets, STUN servers): a name Python's
resolver cannot even encode (an empty label, a label over 63 characters) raises UnicodeError from getaddrinfo,
which no caller expects from a lookup.
"""

from __future__ import annotations

import re

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")


def is_hostname(text: str, *, trailing_dot: bool = False) -> bool:
    """Whether `text` is a host name (with `trailing_dot`, a fully qualified one ending in "." too)."""
    if trailing_dot and text.endswith(".") and len(text) > 1:
        text = text[:-1]
    return _HOSTNAME.fullmatch(text) is not None
