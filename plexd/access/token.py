"""Session tokens (docs/protocol.md §A1.2): a compact EdDSA JWS the control plane signs for one session.

A token is a grant for one session of the desired `sessions` block, checked in the reference's order; the first
failure wins and names its reason (never the token):

    1. well-formed     at most 8,192 bytes; three non-empty raw base64url segments (alphabet checked before
                       decoding); header and claims JSON objects without duplicate keys; nbf/exp numbers within
                       ±2^53                                                                   malformed
    2. alg             "EdDSA", nothing else ("none", "HS256", ...)                            algorithm
    3. signature       Ed25519 over `header.payload` with one of the control plane's current signing keys
                                                                                               signature
    4. kind            claims `kind` and `target.kind` are the session's kind                  kind
    5. jti             equals the session being entered                                        session
    6. time            nbf <= now + 30 s (clock skew: the Go agent allows none), now < exp; no exp = expired
                                                                                               not_yet_valid | expired
    7. user            `target.user` is the login user (SSH), and every target field the token names agrees
                       with the session's own target (a token cannot widen what the control plane granted)
                                                                                               target

`iss`, `aud`, `sub`, `iat` and `kid` are not consulted (as in Go). Whether the session is still in the desired
block (revocation) is the caller's check: a token alone is never enough.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from plexd.base.boundedjson import nesting_depth_exceeds
from plexd.base.errors import PlexdError

MAX_TOKEN_BYTES = 8192
NBF_SKEW = 30.0
_MAX_TIME = float(2**53)
_SEGMENT = re.compile(r"[A-Za-z0-9_-]+")
KINDS = ("ssh", "tcp", "k8s")


class TokenRefused(PlexdError):
    """A session token was refused. `reason` is one word from the module's table; the message never holds the
    token, only what was wrong with it."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"session token refused ({reason}): {detail}")


@dataclass(frozen=True)
class SessionClaims:
    """The claims of a token that passed every check."""

    jti: str
    kind: str
    target: Mapping[str, Any] = field(repr=False)
    nbf: float
    exp: float


def _b64url(segment: str, what: str) -> bytes:
    if not _SEGMENT.fullmatch(segment):
        raise TokenRefused("malformed", f"{what} is not raw base64url")
    try:
        return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    except (binascii.Error, ValueError):
        raise TokenRefused("malformed", f"{what} is not raw base64url") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise TokenRefused("malformed", f"duplicate JSON key {key[:40]!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise TokenRefused("malformed", f"{name} is not JSON")


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenRefused("malformed", f"{what} is not UTF-8") from None
    if nesting_depth_exceeds(text, 8):
        raise TokenRefused("malformed", f"{what} nests too deep")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except ValueError:
        raise TokenRefused("malformed", f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise TokenRefused("malformed", f"{what} is not a JSON object")
    return value


def _time(claims: Mapping[str, Any], name: str) -> float | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TokenRefused("malformed", f"{name} is not a number")
    if abs(value) > _MAX_TIME:
        raise TokenRefused("malformed", f"{name} is out of range")
    return float(value)


def _parse(token: str) -> tuple[bytes, dict[str, Any], dict[str, Any], bytes]:
    if not isinstance(token, str) or len(token) > MAX_TOKEN_BYTES or not token.isascii():
        raise TokenRefused("malformed", f"not an ASCII token of at most {MAX_TOKEN_BYTES} bytes")
    parts = token.split(".")
    if len(parts) != 3 or not all(parts):
        raise TokenRefused("malformed", "not three non-empty segments")
    header = _json_object(_b64url(parts[0], "header"), "header")
    claims = _json_object(_b64url(parts[1], "claims"), "claims")
    signature = _b64url(parts[2], "signature")
    _time(claims, "nbf")
    _time(claims, "exp")
    return f"{parts[0]}.{parts[1]}".encode("ascii"), header, claims, signature


def _signed_by(message: bytes, signature: bytes, keys: Iterable[VerifyKey]) -> bool:
    if len(signature) != 64:
        return False
    for key in keys:
        try:
            key.verify(message, signature)
            return True
        except BadSignatureError:
            continue
    return False


def _target_agrees(claimed: Mapping[str, Any], granted: Mapping[str, Any], kind: str) -> str | None:
    """Why the token's target disagrees with the session's, or None. The token may name fewer fields than the
    session; every field it names must be the session's value."""
    for name, value in claimed.items():
        if name == "kind":
            continue
        if name not in granted:
            return f"the token names target.{name[:40]}, which the {kind} session does not"
        if value != granted[name]:
            return f"target.{name[:40]} is not the session's"
    return None


def verify_session_token(token: str, *, keys: Iterable[VerifyKey], session_id: str, kind: str,
                         target: Mapping[str, Any], now: float, user: str | None = None) -> SessionClaims:
    """The token's claims when it admits a connection to session `session_id` of `kind` whose desired target is
    `target` (the session's `target.<kind>` object), with login `user` (SSH); else TokenRefused."""
    message, header, claims, signature = _parse(token)  # 1. well-formed
    if header.get("alg") != "EdDSA":  # 2. algorithm
        alg = header.get("alg")
        shown = alg[:20] if isinstance(alg, str) else type(alg).__name__
        raise TokenRefused("algorithm", f"alg {shown!r} is not EdDSA")
    if not _signed_by(message, signature, keys):  # 3. signature
        raise TokenRefused("signature", "not signed by a current control-plane signing key")
    claimed_target = claims.get("target")
    if not isinstance(claimed_target, dict):
        raise TokenRefused("kind", "the token has no target object")
    if claims.get("kind") != kind or claimed_target.get("kind") != kind:  # 4. kind
        raise TokenRefused("kind", f"the token is not for a {kind} session")
    jti = claims.get("jti")
    if jti != session_id:  # 5. session
        raise TokenRefused("session", "the token is for another session")
    nbf, exp = _time(claims, "nbf") or 0.0, _time(claims, "exp")  # 6. time
    if nbf > now + NBF_SKEW:
        raise TokenRefused("not_yet_valid", f"valid only from {nbf:.0f} (now {now:.0f})")
    if exp is None or now >= exp:
        raise TokenRefused("expired", "no exp" if exp is None else f"expired at {exp:.0f} (now {now:.0f})")
    if user is not None and claimed_target.get("user") != user:  # 7. user and target
        raise TokenRefused("target", "the token is for another user")
    disagreement = _target_agrees(claimed_target, target, kind)
    if disagreement is not None:
        raise TokenRefused("target", disagreement)
    return SessionClaims(jti=str(jti), kind=kind, target=claimed_target, nbf=nbf, exp=float(exp))


def sign_session_token(signing_key: Any, claims: Mapping[str, Any]) -> str:
    """A compact EdDSA JWS of `claims` (the control plane's side: the devplane mints session tokens with it).
    `signing_key`: a nacl.signing.SigningKey."""

    def seg(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    head = seg(json.dumps({"alg": "EdDSA"}, separators=(",", ":")).encode())
    body = seg(json.dumps(dict(claims), separators=(",", ":")).encode())
    signature = signing_key.sign(f"{head}.{body}".encode("ascii")).signature
    return f"{head}.{body}.{seg(signature)}"
