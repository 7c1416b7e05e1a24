"""Signed event envelopes: parsing with the raw payload kept, and the exact bytes that are signed (§3).

The signature covers Go's re-marshalling of ``{event_type, event_id, issued_at, nonce, payload}``: compact, in
that key order, ``issued_at`` re-printed as RFC3339Nano and the payload's own key order kept. So we never
re-serialise a parsed payload; we cut the raw payload text out of the envelope and compact it Go-style.
Used by both the verifier in the agent and the signer in the reference control plane.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from plexd.base import boundedjson, gojson
from plexd.base.errors import WireFormatError
from plexd.controlplane.sse import valid_event_id

_DECODER = json.JSONDecoder()
_EVENT_TYPE = re.compile(r"[a-z][a-z0-9_]{0,63}")
MAX_FIELD = 4096  # issued_at, nonce, signature: a few dozen characters on the wire
_WS = " \t\n\r"


class PayloadText:
    """An envelope's payload kept as the raw text it came as (what the signature covers), parsed once on demand."""

    payload_raw: str

    def payload(self) -> Any:
        """The parsed payload (parsed once: the verifier's target check and the handler both ask)."""
        value, error = self._parsed
        if error is not None:
            raise error
        return value

    @functools.cached_property
    def _parsed(self) -> tuple[Any, WireFormatError | None]:
        try:
            return boundedjson.loads(self.payload_raw, "payload"), None
        except WireFormatError as e:
            return None, e


@dataclass(frozen=True)
class Envelope(PayloadText):
    event_type: str
    event_id: str
    issued_at: str  # as received; "" when absent
    nonce: str
    payload_raw: str  # raw JSON text of the payload, "null" when absent
    signature: str

    def canonical_bytes(self) -> bytes:
        return canonical_bytes(self.event_type, self.event_id, self.issued_at, self.nonce, self.payload_raw)


def canonical_bytes(event_type: str, event_id: str, issued_at: str, nonce: str, payload_raw: str) -> bytes:
    """The bytes an event signature covers, identical to the Go agent's ``json.Marshal(canonicalEnvelope)``."""
    payload = gojson.go_compact(payload_raw) if payload_raw.strip() else "null"
    text = (
        '{"event_type":' + gojson.go_string(event_type)
        + ',"event_id":' + gojson.go_string(event_id)
        + ',"issued_at":"' + gojson.canonical_time(issued_at) + '"'
        + ',"nonce":' + gojson.go_string(nonce)
        + ',"payload":' + payload + "}"
    )
    return text.encode("utf-8")


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def top_level_spans(text: str) -> dict[str, tuple[int, int]]:
    """Map each top-level key of a JSON object (lower-cased, last one wins, like Go) to its value's span."""
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "{":
        raise WireFormatError("", "envelope is not a JSON object")
    spans: dict[str, tuple[int, int]] = {}
    pos = _skip_ws(text, pos + 1)
    if pos < len(text) and text[pos] == "}":
        end = pos + 1
    else:
        while True:
            if pos >= len(text) or text[pos] != '"':
                raise WireFormatError("", f"invalid JSON at offset {pos}: expected a key")
            key, pos = json.decoder.scanstring(text, pos + 1)
            pos = _skip_ws(text, pos)
            if pos >= len(text) or text[pos] != ":":
                raise WireFormatError("", f"invalid JSON at offset {pos}: expected ':'")
            pos = _skip_ws(text, pos + 1)
            _, value_end = _DECODER.raw_decode(text, pos)
            spans[key.lower()] = (pos, value_end)
            pos = _skip_ws(text, value_end)
            if pos < len(text) and text[pos] == ",":
                pos = _skip_ws(text, pos + 1)
                continue
            if pos < len(text) and text[pos] == "}":
                end = pos + 1
                break
            raise WireFormatError("", f"invalid JSON at offset {pos}: expected ',' or '}}'")
    if _skip_ws(text, end) != len(text):
        raise WireFormatError("", f"invalid JSON: trailing data at offset {end}")
    return spans


def top_level_string(data: str, spans: dict[str, tuple[int, int]], name: str) -> str:
    """The string at `name` of an envelope cut into `spans` (`top_level_spans`): "" when absent or null, a
    WireFormatError naming the field when it is not a bounded, encodable string. The caller ran
    boundedjson.check_depth on the whole text."""
    if name not in spans:
        return ""
    start, end = spans[name]
    value = json.loads(data[start:end])
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WireFormatError(name, f"must be a string, got {type(value).__name__}")
    if len(value) > MAX_FIELD:
        raise WireFormatError(name, f"longer than {MAX_FIELD} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise WireFormatError(name, "not valid UTF-8 (a lone surrogate escape)") from None
    return value


def issued_at_field(data: str, spans: dict[str, tuple[int, int]]) -> str:
    """An envelope's ``issued_at`` as sent ("" when absent), or a WireFormatError when it is not RFC 3339."""
    issued_at = top_level_string(data, spans, "issued_at")
    if issued_at:
        try:
            gojson.canonical_time(issued_at)
        except ValueError as exc:
            raise WireFormatError("issued_at", str(exc)) from None
    return issued_at


def parse_envelope(data: str) -> Envelope:
    """Parse an SSE ``data`` payload into an Envelope. Raises WireFormatError naming what is wrong."""
    boundedjson.check_depth(data, "envelope")
    try:
        spans = top_level_spans(data)
    except ValueError as exc:  # json.JSONDecodeError from a malformed value inside the object
        raise WireFormatError("", f"invalid JSON: {exc}") from None

    def string_field(name: str) -> str:
        return top_level_string(data, spans, name)

    event_type = string_field("event_type")
    event_id = string_field("event_id")
    if not event_type:
        raise WireFormatError("event_type", "missing")
    if not _EVENT_TYPE.fullmatch(event_type):
        raise WireFormatError("event_type", f"{event_type[:40]!r} is not a lower-case event name (a-z, 0-9, _)")
    if not event_id:
        raise WireFormatError("event_id", "missing")
    if not valid_event_id(event_id):
        raise WireFormatError("event_id", f"{event_id[:40]!r} is not 1-128 printable ASCII characters")
    issued_at = issued_at_field(data, spans)
    if "payload" in spans:
        start, end = spans["payload"]
        payload_raw = data[start:end]
    else:
        payload_raw = "null"
    return Envelope(
        event_type=event_type,
        event_id=event_id,
        issued_at=issued_at,
        nonce=string_field("nonce"),
        payload_raw=payload_raw,
        signature=string_field("signature"),
    )


def sign_event(
    signing_key: Any,
    event_type: str,
    event_id: str,
    payload: Any,
    *,
    issued_at: str | None = None,
    nonce: str | None = None,
    payload_raw: str | None = None,
) -> str:
    """Build a signed envelope (JSON text). `signing_key` is a ``nacl.signing.SigningKey``.

    `payload_raw` lets a caller (tests, the devplane's publish API) sign payload text with its own key order,
    whitespace and characters; otherwise `payload` is marshalled compactly.
    """
    raw = payload_raw if payload_raw is not None else gojson.go_marshal(payload)
    issued = issued_at or gojson.format_time(gojson.now_utc())
    nonce = nonce or secrets.token_urlsafe(16)
    signed = signing_key.sign(canonical_bytes(event_type, event_id, issued, nonce, raw)).signature
    return (
        '{"event_type":' + gojson.go_string(event_type)
        + ',"event_id":' + gojson.go_string(event_id)
        + ',"issued_at":' + gojson.go_string(issued)
        + ',"nonce":' + gojson.go_string(nonce)
        + ',"payload":' + raw
        + ',"signature":"' + base64.b64encode(signed).decode() + '"}'
    )
