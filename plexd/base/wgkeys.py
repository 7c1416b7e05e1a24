"""Keys of 32 bytes (WireGuard's, Ed25519 public keys): std base64 on the wire and in files (docs/protocol.md §5.2)."""

from __future__ import annotations

import base64
import binascii
import os


def generate_private_key() -> bytes:
    """32 CSPRNG bytes, clamped as WireGuard does."""
    key = bytearray(os.urandom(32))
    key[0] &= 0xF8
    key[31] &= 0x7F
    key[31] |= 0x40
    return bytes(key)


def public_key_of(private_key: bytes) -> bytes:
    from nacl.public import PrivateKey  # lazily: PyNaCl costs start-up time the CLI's read commands don't need

    return bytes(PrivateKey(private_key).public_key)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode_key(text: str, what: str) -> bytes:
    """Std base64 of exactly 32 bytes, or ValueError naming `what`."""
    raw = _decoded(text)
    if raw is None:
        raise ValueError(f"{what} is not valid base64")
    if len(raw) != 32:
        raise ValueError(f"{what} decodes to {len(raw)} bytes, expected 32")
    return raw


def key_problem(text: str) -> str:
    """Why `text` is not a base64 Ed25519 public key, or ""."""
    raw = _decoded(text)
    if raw is None:
        return "is not base64"
    if len(raw) != 32:
        return f"is {len(raw)} bytes; an Ed25519 public key is 32"
    return ""


def _decoded(text: str) -> bytes | None:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
