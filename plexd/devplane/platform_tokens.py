"""Bootstrap tokens and the project of a platform-dialect devplane.

A platform token is `psb_<env>_<project>_<kind>_<random>`: `<project>` the lower-case unpadded base32 of the
project UUID's 16 bytes (so a node can read its project from the token alone), `<kind>` `node` or `bridge`,
`<random>` at least 20 characters of [a-z2-7]. The devplane has one project, created with its database.
"""

from __future__ import annotations

import base64
import os
import re
import uuid
from dataclasses import dataclass

from plexd.devplane.platform_wire import uuid7
from plexd.devplane.store import Store

ENV = "dev"
KINDS = ("node", "bridge")
TOKEN = re.compile(r"^psb_([a-z]+)_([a-z2-7]+)_(node|bridge)_([a-z2-7]{20,})$")
_PROJECT_META = "project_id"


def project_id(store: Store) -> str:
    """The deployment's project, made on first use and kept in the database."""
    value = store.get_meta(_PROJECT_META)
    if value is None:
        value = uuid7()
        store.set_meta(_PROJECT_META, value)
    return value


def project_segment(project: str) -> str:
    return base64.b32encode(uuid.UUID(project).bytes).decode().rstrip("=").lower()


def new_token(project: str, kind: str) -> str:
    random = base64.b32encode(os.urandom(20)).decode().lower()  # 32 characters of [a-z2-7]
    return f"psb_{ENV}_{project_segment(project)}_{kind}_{random}"


@dataclass(frozen=True)
class TokenParts:
    env: str
    project: str  # the base32 segment, as in the token
    kind: str


def parse_token(token: str) -> TokenParts | None:
    m = TOKEN.match(token)
    return TokenParts(m.group(1), m.group(2), m.group(3)) if m else None
