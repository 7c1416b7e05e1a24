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


def is_resolvable(text: str) -> bool:
    """Whether the resolver can be asked for `text` at all: labels of 1-63 printable ASCII characters (an
    underscore too: internal DNS has them, and resolvers take them), 253 in all. Looser than `is_hostname`, for
    names an operator configures."""
    name = text[:-1] if text.endswith(".") else text
    return (0 < len(name) <= 253 and name.isascii() and name.isprintable()
            and not any(c in name for c in " /@:") and all(0 < len(label) <= 63 for label in name.split(".")))


def is_ip(text: str, version: int | None = None) -> bool:
    """Whether `text` is a bare IP address (of `version`, 4 or 6, when given): no prefix, no port."""
    import ipaddress  # lazily: `plexd status` checks identities and should start fast

    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    return version is None or address.version == version
