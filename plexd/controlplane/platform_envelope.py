"""The platform contract's signed event envelope and bearer (docs/platform-dialect.md), shared by the node and the
reference control plane.

An envelope is ``{id, type, scope, key_id, issued_at, payload, signature}``. The signature is Ed25519 over Go's
``json.Marshal`` of ``{id, type, scope, key_id, issued_at, payload}`` in exactly that order: compact, HTML-safe
escaping, ``issued_at`` re-printed as RFC3339Nano, the payload's own key order kept (its raw text is cut out of the
envelope and compacted, never re-serialised). There is no nonce: replay is bounded by the ±5 minute window and
by the events only asking for a state pull.

The bearer of every call after registration is ``nsk_<env>_<base64url(node_id's 16 UUID bytes ‖ the NSK's 32
bytes), unpadded>``; the NSK itself never goes on the wire again.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from plexd.base import boundedjson, gojson
from plexd.base.errors import WireFormatError
from plexd.controlplane.envelope import PayloadText, issued_at_field, top_level_spans, top_level_string
from plexd.controlplane.sse import valid_event_id

_EVENT_TYPE = re.compile(r"[a-z][a-z0-9_.]{0,63}")
BEARER_ENV = "plexd"
NSK_BYTES = 32


@dataclass(frozen=True)
class PlatformEnvelope(PayloadText):
    id: str
    type: str
    scope: str
    key_id: str
    issued_at: str  # as received; "" when absent
    payload_raw: str  # raw JSON text of the payload, "null" when absent
    signature: str
    # No nonce in this dialect: the ±5 minute window and the id bound a replay. "" under the spec envelope's name,
    # for what reads either envelope (the event stream, its clock hold, the ledger).
    nonce: ClassVar[str] = ""

    @property
    def event_id(self) -> str:
        return self.id

    @property
    def event_type(self) -> str:
        return self.type

    def canonical_bytes(self) -> bytes:
        return canonical_bytes(self.id, self.type, self.scope, self.key_id, self.issued_at, self.payload_raw)


def canonical_bytes(event_id: str, event_type: str, scope: str, key_id: str, issued_at: str,
                    payload_raw: str) -> bytes:
    """The bytes a platform event signature covers (Go's marshalling of the six fields, in order)."""
    payload = gojson.go_compact(payload_raw) if payload_raw.strip() else "null"
    return (
        '{"id":' + gojson.go_string(event_id)
        + ',"type":' + gojson.go_string(event_type)
        + ',"scope":' + gojson.go_string(scope)
        + ',"key_id":' + gojson.go_string(key_id)
        + ',"issued_at":"' + gojson.canonical_time(issued_at) + '"'
        + ',"payload":' + payload + "}"
    ).encode("utf-8")


def parse_envelope(data: str) -> PlatformEnvelope:
    """Parse an SSE ``data`` payload into a PlatformEnvelope. Raises WireFormatError naming what is wrong."""
    boundedjson.check_depth(data, "envelope")
    try:
        spans = top_level_spans(data)
    except ValueError as exc:
        raise WireFormatError("", f"invalid JSON: {exc}") from None

    def string_field(name: str) -> str:
        return top_level_string(data, spans, name)

    event_id, event_type = string_field("id"), string_field("type")
    if not event_id:
        raise WireFormatError("id", "missing")
    if not valid_event_id(event_id):
        raise WireFormatError("id", f"{event_id[:40]!r} is not 1-128 printable ASCII characters")
    if not event_type:
        raise WireFormatError("type", "missing")
    if not _EVENT_TYPE.fullmatch(event_type):
        raise WireFormatError("type", f"{event_type[:40]!r} is not a lower-case event name (a-z, 0-9, _, .)")
    issued_at = issued_at_field(data, spans)
    payload_raw = data[slice(*spans["payload"])] if "payload" in spans else "null"
    return PlatformEnvelope(id=event_id, type=event_type, scope=string_field("scope"),
                            key_id=string_field("key_id"), issued_at=issued_at, payload_raw=payload_raw,
                            signature=string_field("signature"))


def sign_event(signing_key: Any, event_id: str, event_type: str, payload: Any, *, key_id: str, scope: str = "",
               issued_at: str | None = None, payload_raw: str | None = None) -> str:
    """A signed platform envelope (JSON text); `signing_key` is a ``nacl.signing.SigningKey``."""
    raw = payload_raw if payload_raw is not None else gojson.go_marshal(payload)
    issued = issued_at or gojson.format_time(gojson.now_utc())
    signed = signing_key.sign(canonical_bytes(event_id, event_type, scope, key_id, issued, raw)).signature
    return (
        '{"id":' + gojson.go_string(event_id)
        + ',"type":' + gojson.go_string(event_type)
        + ',"scope":' + gojson.go_string(scope)
        + ',"key_id":' + gojson.go_string(key_id)
        + ',"issued_at":' + gojson.go_string(issued)
        + ',"payload":' + raw
        + ',"signature":"' + base64.b64encode(signed).decode() + '"}'
    )


# -- the bearer envelope ----------------------------------------------------------------------------------------

def decode_nsk(nsk_b64: str, what: str = "nsk") -> bytes:
    """The NSK's 32 bytes from its standard base64, or ValueError naming `what` (never quoting the value)."""
    try:
        raw = base64.b64decode(nsk_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not standard base64") from None
    if len(raw) != NSK_BYTES:
        raise ValueError(f"{what} decodes to {len(raw)} bytes, not {NSK_BYTES}")
    return raw


def bearer(node_id: str, nsk_b64: str, env: str = BEARER_ENV) -> str:
    """``nsk_<env>_<b64url(uuid16 ‖ nsk32)>``; ValueError when the node id is not a UUID or the NSK not 32 bytes."""
    try:
        node = uuid.UUID(node_id).bytes
    except (ValueError, AttributeError, TypeError):
        raise ValueError(f"node_id {str(node_id)[:60]!r} is not a UUID, which the platform's bearer needs") from None
    raw = node + decode_nsk(nsk_b64)
    return f"nsk_{env}_" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def parse_bearer(token: str) -> tuple[str, bytes]:
    """(node id, NSK bytes) of a bearer envelope; ValueError saying what is wrong (never quoting the token)."""
    parts = token.split("_", 2)  # base64url has "_" too: only the first two delimit
    if len(parts) != 3 or parts[0] != "nsk" or not parts[1]:
        raise ValueError("the bearer is not nsk_<env>_<payload>")
    payload = parts[2]
    try:
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("the bearer's payload is not base64url") from None
    if len(raw) != 16 + NSK_BYTES or "=" in payload:
        raise ValueError(f"the bearer's payload decodes to {len(raw)} bytes, not {16 + NSK_BYTES}")
    return str(uuid.UUID(bytes=raw[:16])), raw[16:]
