"""The platform dialect's event signatures (docs/platform-dialect.md, the event stream): an envelope names its key.

Checks in the contract's order: signature present → issued_at present → not older than 5 minutes → not more than 5
minutes ahead → the key its `key_id` names (the current key always, the previous one only until its
transition_expires; an empty or unknown key_id is refused) → Ed25519 over the canonical bytes. No nonce and no
nonce store: the window and the stream's id dedupe bound a replay, and these events only ask for a state pull.

The keys are the spec verifier's (`plexd.controlplane.event_signing.Verifier`): one key state for all that trusts
them (session tokens, the key file's domain, a registration that answers with another key). This dialect adds
their ids, kept by public key so a key installed from anywhere keeps its name: the registration names its key, a
`signing_key_rotated` event the new one, and the current key's id is persisted beside the key file
(``data_dir/signing_key_id``), bound to the key, so a restart keeps it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from nacl.signing import VerifyKey

from plexd.base import boundedjson, gojson
from plexd.base.atomicfile import write_atomic
from plexd.base.errors import WireFormatError
from plexd.controlplane.envelope import MAX_FIELD
from plexd.controlplane.event_signing import (
    EventRejected,
    InvalidSigningKeys,
    Verifier,
    check_window,
    decode_public_key,
    decode_signature,
    install_signing_keys,
    key_fingerprint,
    signed_by,
)
from plexd.controlplane.platform_envelope import PlatformEnvelope
from plexd.state.fields import text
from plexd.state.model import SigningKeys
from plexd.state.model import _fields as _object  # Go's lenient decoding: case-insensitive keys

log = logging.getLogger(__name__)

KEY_ID_FILE = "signing_key_id"  # beside datadir.SIGNING_KEY: {public key: key id} of the keys held
MAX_KEY_ID_FILE = 16 * 1024


class KeyIds:
    """The platform's key ids, by the public key each names."""

    def __init__(self, data_dir: Path | str | None = None,
                 registered: Callable[[], tuple[str, str]] | None = None) -> None:
        self._file = Path(data_dir) / KEY_ID_FILE if data_dir is not None else None
        # (public key, key id) of the registration: asked each time, a re-registration may bring another
        self._registered = registered or (lambda: ("", ""))
        self._ids = self._load()

    def id_of(self, key_b64: str) -> str:
        """The id naming `key_b64`, "" when none is known."""
        if not key_b64:
            return ""
        if key_b64 in self._ids:
            return self._ids[key_b64]
        registered_key, registered_id = self._registered()
        return registered_id if registered_key == key_b64 else ""

    def name(self, key_b64: str, key_id: str, keep: tuple[str, ...]) -> None:
        """Name `key_b64` `key_id`; of the other names only those of `keep` stay. Persisted first: written before
        the key file, so a crash in between leaves the key in force named too."""
        ids = {key: self.id_of(key) for key in keep if key and self.id_of(key)}
        ids[key_b64] = key_id
        if self._file is not None:
            write_atomic(self._file, gojson.go_marshal(ids).encode())
        self._ids = ids

    def _load(self) -> dict[str, str]:
        if self._file is None or not self._file.exists():
            return {}
        try:
            with self._file.open("rb") as f:
                doc = boundedjson.loads(f.read(MAX_KEY_ID_FILE), KEY_ID_FILE)
            if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
                raise WireFormatError(KEY_ID_FILE, "not an object of key ids by public key")
        except (OSError, WireFormatError) as exc:
            log.warning("ignoring %s: %s; the signing key's id comes from the registration", self._file, exc)
            return {}
        return doc


class PlatformVerifier:
    """Verifies platform envelopes with the verifier's keys, chosen by key_id, and installs rotated keys."""

    def __init__(self, verifier: Verifier, key_ids: KeyIds, data_dir: Path | str | None = None) -> None:
        self._verifier = verifier
        self.key_ids = key_ids
        self._data_dir = Path(data_dir) if data_dir is not None else None

    def verify(self, env: PlatformEnvelope) -> None:
        """Return if `env` is authentic and fresh; raise EventRejected otherwise."""
        if not env.signature:
            raise EventRejected("missing_signature", "event has no signature")
        now = self._verifier.clock.now()
        check_window(env.issued_at, now)
        self._check_authentic(env)

    def authentic(self, env: PlatformEnvelope) -> bool:
        """Whether `env` is signed by the key its key_id names, whatever its time (for the clock hold)."""
        if not env.signature or not env.issued_at:
            return False
        try:
            self._check_authentic(env)
        except EventRejected:
            return False
        return True

    def _check_authentic(self, env: PlatformEnvelope) -> None:
        key = self._key_named(env.key_id)
        if not signed_by(key, env.canonical_bytes(), decode_signature(env.signature)):
            raise EventRejected("bad_signature", f"signature verification failed (key_id {env.key_id[:80]!r})")

    def _key_named(self, key_id: str) -> VerifyKey:
        if not key_id:
            raise EventRejected("missing_key_id", "event names no key_id")
        keys, current = self._verifier.keys, self._verifier.current_key
        if keys is None or current is None:
            raise EventRejected("no_signing_key", "no signing key is known yet")
        if key_id == self.key_ids.id_of(keys.current):
            return current
        if keys.previous and key_id == self.key_ids.id_of(keys.previous):
            previous = self._verifier.previous_key(self._verifier.clock.now())
            if previous is None:
                raise EventRejected("key_expired", f"key_id {key_id[:80]!r} is the previous signing key, trusted "
                                                   f"only until {keys.transition_expires}")
            return previous
        raise EventRejected("unknown_key_id", f"key_id {key_id[:80]!r} names no signing key this node holds")

    def rotate(self, env: PlatformEnvelope) -> None:
        """A verified `signing_key_rotated`: its key becomes the current one; the one it replaces stays trusted
        only when the event names it (a key id this node holds) and when its trust ends. Anything unusable raises
        WireFormatError or InvalidSigningKeys and leaves the keys as they were."""
        f = _object(env.payload(), "payload")
        key_id = text(f, "key_id", "payload", limit=MAX_FIELD)
        public_key = text(f, "public_key", "payload", limit=MAX_FIELD)
        previous_id = text(f, "previous_key_id", "payload", limit=MAX_FIELD)
        expires = text(f, "transition_expires", "payload", limit=MAX_FIELD)
        if not key_id:
            raise InvalidSigningKeys("signing_key_rotated: key_id is empty")
        decode_public_key(public_key, "rotated")
        previous = self._held_key(previous_id) if previous_id and _nonzero_time(expires) else ""
        keys = SigningKeys(current=public_key, previous=previous, transition_expires=expires if previous else "")
        held = self._verifier.keys
        self.key_ids.name(public_key, key_id, keep=(held.current if held is not None else "", previous))
        install_signing_keys(self._verifier, self._data_dir, keys)  # persisted like the spec's key
        log.info("event %s: signing key rotated to %s (%s)%s", env.id, key_id[:80], key_fingerprint(public_key),
                 f", {previous_id[:80]} trusted until {expires}" if previous else "")

    def _held_key(self, key_id: str) -> str:
        keys = self._verifier.keys
        held = (keys.current, keys.previous) if keys is not None else ()
        return next((key for key in held if key and self.key_ids.id_of(key) == key_id), "")


def _nonzero_time(value: str) -> bool:
    if not value:
        return False
    try:
        return gojson.canonical_time(value) != gojson.GO_ZERO_TIME
    except ValueError:
        raise WireFormatError("payload.transition_expires", f"{value[:40]!r} is not an RFC 3339 time") from None
