"""Release signatures: who published a release, checked before the release is ever run.

A release is signed with an Ed25519 release key (pynacl). What is signed is a small manifest naming the version
and the SHA-256 of the zipapp, not the zipapp itself: the node checks the signature before it downloads anything,
and the checksum pins the bytes. The signature travels as a small JSON file beside the artifact
(``plexd-0.2.0.pyz.sig``; the control plane serves it at the artifact's path + ``.sig``, and the node keeps it beside
the release, where the launcher checks it again before every start)::

    {"format": "plexd-release-sig-v1", "version": "0.2.0", "sha256": "<64 hex>", "key": "<base64 public key>",
     "signature": "<base64, 64 bytes>"}

The node pins the public halves in ``upgrade.release_keys``; "key" only says which one signed, the signature
must verify under a pinned key whatever it says.

    python -m plexd.upgrade.signing keygen KEYFILE           # writes the private seed (0600), prints the public key
    python -m plexd.upgrade.signing public KEYFILE           # prints the public key
    python -m plexd.upgrade.signing sign KEYFILE ARTIFACT VERSION   # writes ARTIFACT.sig
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from plexd.base import boundedjson
from plexd.base.errors import PlexdError

FORMAT = "plexd-release-sig-v1"
SUFFIX = ".sig"
MAX_SIG_BYTES = 4096
_LEADING_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)*")


class SignatureError(PlexdError):
    """A release's signature is missing, malformed, or not by a pinned key, or does not name this release."""


def manifest(version: str, sha256: str) -> bytes:
    """The signed bytes: a domain tag (no other Ed25519 signature of ours can be replayed as a release's), the
    version and the checksum."""
    return f"{FORMAT}\nversion={version}\nsha256={sha256}\n".encode()


def public_key(key: SigningKey) -> str:
    return base64.b64encode(bytes(key.verify_key)).decode()


def load_signing_key(path: str | os.PathLike[str]) -> SigningKey:
    """The private release key from its file (base64 of the 32-byte seed)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SignatureError(f"cannot read the release key {path}: {exc.strerror}") from None
    try:
        seed = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        seed = b""
    if len(seed) != 32:
        raise SignatureError(f"{path} is not a release key (base64 of a 32-byte Ed25519 seed)")
    return SigningKey(seed)


def write_signing_key(path: str | os.PathLike[str]) -> SigningKey:
    """A new release key, written 0600 (never over an existing file)."""
    key = SigningKey.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(base64.b64encode(bytes(key)).decode() + "\n")
    return key


def sign(key: SigningKey, version: str, sha256: str) -> bytes:
    """The signature file's bytes for the release `version` with checksum `sha256`."""
    signature = key.sign(manifest(version, sha256)).signature
    doc = {"format": FORMAT, "version": version, "sha256": sha256, "key": public_key(key),
           "signature": base64.b64encode(signature).decode()}
    return json.dumps(doc, indent=1).encode() + b"\n"


def sign_file(key: SigningKey, artifact: str | os.PathLike[str], version: str) -> Path:
    """Write ARTIFACT.sig for `artifact` as release `version`; returns its path."""
    digest = hashlib.sha256(Path(artifact).read_bytes()).hexdigest()
    out = Path(f"{artifact}{SUFFIX}")
    out.write_bytes(sign(key, version, digest))
    return out


def verify(data: bytes, keys: Iterable[str], version: str, sha256: str) -> str:
    """Check that `data` (a signature file) signs release `version` with checksum `sha256` under one of the pinned
    `keys`; returns the public key that signed. Raises SignatureError saying what is wrong."""
    pinned = [k.strip() for k in keys]
    if not pinned:
        raise SignatureError("upgrade.release_keys is empty: this node trusts no release key")
    if len(data) > MAX_SIG_BYTES:
        raise SignatureError(f"the signature file is {len(data)} bytes, more than {MAX_SIG_BYTES}")
    try:
        doc = boundedjson.parse(data)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SignatureError(f"the signature file is not a {FORMAT} document")
    if doc.get("version") != version:
        raise SignatureError(f"the signature is for version {str(doc.get('version'))[:80]!r}, not {version!r}")
    if doc.get("sha256") != sha256:
        raise SignatureError(f"the signature is for SHA-256 {str(doc.get('sha256'))[:80]!r}, not {sha256}")
    try:
        signature = base64.b64decode(str(doc.get("signature", "")), validate=True)
    except (binascii.Error, ValueError):
        signature = b""
    if len(signature) != 64:
        raise SignatureError("the signature file's signature is not 64 bytes of base64")
    message = manifest(version, sha256)
    for text in pinned:
        try:
            VerifyKey(base64.b64decode(text)).verify(message, signature)
        except (BadSignatureError, ValueError, binascii.Error):
            continue
        return text
    raise SignatureError(f"the signature is by no key in upgrade.release_keys (it names key "
                         f"{str(doc.get('key'))[:60]!r})")


def verify_release(path: Path, keys: Iterable[str]) -> tuple[str, str]:
    """Check a release file on disk against its `.sig` beside it: (version, sha256) it was signed as."""
    sig = Path(f"{path}{SUFFIX}")
    try:
        data = sig.read_bytes()[: MAX_SIG_BYTES + 1]
    except FileNotFoundError:
        raise SignatureError(f"{path.name} has no signature file {sig.name}") from None
    try:
        version = str(boundedjson.parse(data).get("version", ""))
    except (ValueError, AttributeError, RecursionError):
        version = ""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    verify(data, keys, version, digest.hexdigest())
    return version, digest.hexdigest()


def release_number(version: str) -> tuple[int, ...] | None:
    """The leading dotted number of a version ("0.9.1-test" → (0, 9, 1)); None when it has none."""
    match = _LEADING_NUMBER.match(version)
    return tuple(int(p) for p in match.group().split(".")) if match else None


def downgrade_problem(version: str, running: str) -> str:
    """Why installing `version` over `running` is (or may be) a downgrade, or "". Versions are ordered by their
    leading dotted number, then as semantic versions: a pre-release (`-rc1`) comes before its release, two
    pre-releases by their identifiers. Anything that cannot be ordered counts as a downgrade: a version without a
    number, or the same number with another suffix or build (`0.2.0` over `0.2.0-hotfix2`'s fix, `+build1` over
    `+build9`): rollback attacks hide behind odd version strings."""
    new, old = release_number(version), release_number(running)
    if new is None:
        return f"version {version!r} has no release number to order it against the running {running}"
    if old is None or new > old:
        return ""
    if new < old:
        return f"plexd {version} is older than the running {running}"
    if version == running:
        return ""
    new_pre, old_pre = _prerelease(version), _prerelease(running)
    if new_pre == () and old_pre not in ((), None):
        return ""  # the release after its pre-release
    if new_pre and old_pre and _semver_ids(new_pre) > _semver_ids(old_pre):
        return ""
    if new_pre and old_pre is not None:  # a pre-release over its release, or over a later pre-release
        return f"plexd {version} is older than the running {running}"
    return f"plexd {version} cannot be ordered against the running {running} (the same release number)"


def _prerelease(version: str) -> tuple[str, ...] | None:
    """The semantic-version pre-release identifiers after the release number: () for a plain release (build
    metadata aside), None for a suffix that is not one (`.post1`, `_x`)."""
    match = _LEADING_NUMBER.match(version)
    tail = version[match.end():] if match else version
    tail = tail.split("+", 1)[0] if tail.startswith("-") else tail
    if tail == "":
        return ()
    if tail.startswith("-") and len(tail) > 1:
        return tuple(tail[1:].split("."))
    return None


def _semver_ids(ids: tuple[str, ...]) -> tuple[tuple[int, int, str], ...]:
    # numeric identifiers before alphanumeric ones, numbers by value (semver 2.0.0, 11.4)
    return tuple((0, int(i), "") if i.isdigit() else (1, 0, i) for i in ids)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) == 2 and args[0] == "keygen":
            print(public_key(write_signing_key(args[1])))
        elif len(args) == 2 and args[0] == "public":
            print(public_key(load_signing_key(args[1])))
        elif len(args) == 4 and args[0] == "sign":
            out = sign_file(load_signing_key(args[1]), args[2], args[3])
            print(f"{out}: signed as plexd {args[3]}")
        else:
            print(__doc__.split("\n\n")[-1].rstrip(), file=sys.stderr)
            return 2
    except (SignatureError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
