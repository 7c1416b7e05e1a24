"""The node secret and the two keys derived from it: the bearer token of every call to the control plane, and the
AES-256-GCM key of the node's secrets (docs/protocol.md §5.5, §8.5).

The Go agent uses the one `node_secret_key` string as both: whoever sees the bearer (a proxy log, a control-plane
access log, a TLS-terminating load balancer) can decrypt every secret of the node. Here the two are derived
separately with HKDF-SHA256 (RFC 5869: no salt, the node secret's UTF-8 bytes as input keying material, a
different `info` each, 32 bytes out), so neither gives away the other or the node secret.

Negotiated at registration, so a control plane built for the Go agent keeps working unchanged:

- the node offers it: the register request carries ``"node_secret_kdf": "hkdf-sha256"`` (a Go control plane
  ignores a field it does not know);
- the control plane accepts it by answering the same field in the register response (the reference control plane,
  plexd-devplane, does); the node stores the answer in ``data_dir/node_secret_kdf`` (0600) and from then on sends
  the derived bearer and decrypts with the derived key;
- a response without the field is today's behaviour (compatibility mode, logged once): the node secret itself is
  the bearer and, per §5.5, the AES key. A value the node does not know fails the registration with one line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging

log = logging.getLogger(__name__)

FIELD = "node_secret_kdf"  # in the register request (offered) and response (accepted), and the data_dir file
HKDF_SHA256 = "hkdf-sha256"
COMPATIBLE = ""  # no derivation: the Go agent's behaviour
KNOWN = (COMPATIBLE, HKDF_SHA256)
BEARER_INFO = b"plexd node secret v1: bearer token"
SECRETS_INFO = b"plexd node secret v1: AES-256-GCM key for node secrets"

_compat_logged = False


def _hkdf(node_secret: str, info: bytes) -> bytes:
    return hkdf_sha256(node_secret.encode("utf-8"), info)


def hkdf_sha256(ikm: bytes, info: bytes, salt: bytes = b"", length: int = 32) -> bytes:
    """RFC 5869 with SHA-256, from the standard library: the daemon needs no more of `cryptography` than this,
    and importing it cost ~7 MiB of memory."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"HKDF-SHA256 cannot make {length} bytes")
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()  # no salt: a string of HashLen zeros
    okm, block = b"", b""
    for counter in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def bearer(node_secret: str, kdf: str) -> str:
    """What goes after ``Authorization: Bearer`` for a node with this secret."""
    if kdf == HKDF_SHA256:
        return base64.urlsafe_b64encode(_hkdf(node_secret, BEARER_INFO)).rstrip(b"=").decode("ascii")
    return node_secret


def secrets_key(node_secret: str, kdf: str) -> bytes | None:
    """The AES-256 key of the node's secrets, or None when the node secret stands for none (compatibility mode
    with a secret that is neither 32 bytes nor the base64 of 32)."""
    if kdf == HKDF_SHA256:
        return _hkdf(node_secret, SECRETS_INFO)
    raw = node_secret.encode("utf-8")
    if len(raw) == 32:
        return raw
    try:
        decoded = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return None
    return decoded if len(decoded) == 32 else None


def check(kdf: object, what: str) -> str:
    """The derivation a register response announced, or ValueError naming what it said."""
    if kdf is None:
        return COMPATIBLE
    if not isinstance(kdf, str) or kdf not in KNOWN:
        raise ValueError(f"{what}: {FIELD} {kdf!r} is not one this plexd knows ({HKDF_SHA256!r} or absent)")
    return kdf


def note_mode(kdf: str) -> None:
    """Say once per process that the control plane did not take the derivation."""
    global _compat_logged
    if kdf == COMPATIBLE and not _compat_logged:
        _compat_logged = True
        log.info("the control plane did not announce %s: the node secret is both the bearer token and the key of "
                 "the node's secrets (compatibility mode, as the Go agent)", FIELD)
