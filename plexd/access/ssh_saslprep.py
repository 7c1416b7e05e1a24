"""asyncssh's SASLprep (RFC 4013) of the login user and password, with a fast path for printable ASCII.

asyncssh prepares the user name and the password of every password login, one character at a time in Python
through `stringprep`: ~0.3 ms for a 232-character session token, ~0.5 ms of the server's ~4.4 ms of CPU for a
login (bench ssh_sessions). For printable ASCII (U+0020..U+007E) SASLprep is the identity: none of those characters
is unassigned, mapped (tables B.1, C.1.2) or prohibited (C.1.2, C.2.1 holds the ASCII controls, C.3-C.9 none
of ASCII), NFKC leaves them as they are, and none is right-to-left. Anything else goes to asyncssh's own.
"""

from __future__ import annotations

from collections.abc import Callable

import asyncssh.auth
import asyncssh.connection
from asyncssh.saslprep import saslprep as full_saslprep


def saslprep(text: str) -> str:
    if text.isascii() and text.isprintable():
        return text
    return full_saslprep(text)


def install() -> None:
    """Put the fast path where asyncssh's server looks the function up (its modules' own names for it)."""
    modules: tuple[object, ...] = (asyncssh.auth, asyncssh.connection)
    for module in modules:
        current: Callable[[str], str] | None = getattr(module, "saslprep", None)
        if current is full_saslprep:  # an asyncssh that moved or renamed it keeps its own
            module.saslprep = saslprep  # type: ignore[attr-defined]
