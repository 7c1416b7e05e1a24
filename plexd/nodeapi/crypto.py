"""Secret decryption (§8.5): AES-256-GCM, 12-byte nonce, the 16-byte tag after the ciphertext, no AAD.

The key is derived from the node secret with HKDF when the control plane took that at registration
(`plexd.identity.node_secret`). Otherwise (compatibility mode) it is the node secret key (NSK, §5.5) itself:
its raw bytes when they are 32 long (what the Go agent does), else its base64 decoding when that is 32 bytes (a
compatibility shim for a control plane that hands out a base64 AES key). Every failure is one generic
`SecretDecryptError`: which step failed says nothing useful to a workload and something to an attacker.
"""

from __future__ import annotations

import base64
import binascii

from plexd.base.errors import PlexdError
from plexd.identity import node_secret as derive

NONCE_BYTES = 12


class SecretDecryptError(PlexdError):
    pass


def decrypt(ciphertext_b64: str, nonce_b64: str, node_secret: str, kdf: str = "") -> str:
    # Lazily: `cryptography` is ~7 MiB of memory a daemon that never reads a secret need not carry.
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = derive.secrets_key(node_secret, kdf)
    if key is None:
        raise SecretDecryptError("secret decryption failed")
    try:
        nonce = base64.b64decode(nonce_b64, validate=True)
        sealed = base64.b64decode(ciphertext_b64, validate=True)
        if len(nonce) != NONCE_BYTES:
            raise ValueError
        return AESGCM(key).decrypt(nonce, sealed, None).decode("utf-8")
    except (binascii.Error, ValueError, InvalidTag, UnicodeDecodeError):
        raise SecretDecryptError("secret decryption failed") from None
