"""Ed25519 verification of signed events, with a bounded, persisted nonce store (docs/protocol.md §3).

Order of checks, as the Go agent does it: presence → ±5 min window → current key → previous key (only while
``now < transition_expires``) → nonce. The nonce is recorded only after a valid signature, so a forged event
can never burn a nonce that a genuine event will later need.

Better than the Go agent (docs/decisions.md, Verification): the nonce store is bounded and persisted (in
``data_dir/events.db``, see `plexd.controlplane.ledger`), so a replay after a restart is still refused; key updates
are length-checked (a bad key is refused with a reason instead of crashing the verifier) and persisted to
``data_dir/signing_public_key``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Protocol

from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from plexd.base import gojson
from plexd.base.atomicfile import write_atomic
from plexd.base.clock import Clock
from plexd.base.errors import PlexdError, WireFormatError
from plexd.base.wgkeys import decode_key
from plexd.config import datadir
from plexd.controlplane.envelope import Envelope
from plexd.controlplane.ledger import NONCE_TTL_SECONDS, EventLedger

log = logging.getLogger(__name__)

STALENESS_WINDOW = timedelta(minutes=5)
NONCE_TTL = timedelta(seconds=NONCE_TTL_SECONDS)
MAX_NONCES = 100_000  # unexpired at once: 333 events a second for the whole window
NONCE_STORE_FULL = "nonce_store_full"  # the EventRejected reason, logged rate-limited by the store itself
# The payload field naming the nodes an event is for (ours; the Go agent ignores unknown payload fields). Inside
# the signed payload, so an event captured from one node's stream cannot be replayed into another's.
TARGETS_FIELD = "target_node_ids"
SIGNING_KEY_FILE = datadir.SIGNING_KEY


class EventRejected(PlexdError):
    """An event failed verification. `reason` is a short stable code, the message says what was wrong."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class InvalidSigningKeys(PlexdError):
    """A signing-key update (event, state, registration) is unusable; the previous keys stay in force."""


class SigningKeysLike(Protocol):
    current: str
    previous: str
    transition_expires: str


def key_fingerprint(key_b64: str) -> str:
    """A short, non-reversible name for a key, for logs."""
    return hashlib.sha256(key_b64.encode()).hexdigest()[:12]


def decode_public_key(key_b64: str, what: str) -> VerifyKey:
    """Decode a std-base64 Ed25519 public key, refusing anything that is not exactly 32 bytes."""
    try:
        return VerifyKey(decode_key(key_b64, f"{what} signing key"))
    except ValueError as exc:
        raise InvalidSigningKeys(str(exc)) from None


def check_window(issued_at: str, now: datetime) -> datetime:
    """The issued_at of an event, when present and within 5 minutes of `now` either way (exactly 5 minutes is
    still accepted); EventRejected otherwise. Both dialects' window."""
    if not issued_at or gojson.canonical_time(issued_at) == gojson.GO_ZERO_TIME:
        raise EventRejected("missing_issued_at", "event has no issued_at")
    issued = gojson.parse_time(issued_at)
    if now - issued > STALENESS_WINDOW:
        raise EventRejected("stale", f"issued_at {issued_at} is more than 5 minutes old")
    if issued - now > STALENESS_WINDOW:
        raise EventRejected("future", f"issued_at {issued_at} is more than 5 minutes in the future")
    return issued


def decode_signature(signature_b64: str) -> bytes:
    try:
        return base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        raise EventRejected("bad_signature_encoding", "signature is not valid standard base64") from None


def signed_by(key: VerifyKey | None, message: bytes, signature: bytes) -> bool:
    if key is None:
        return False
    try:
        key.verify(message, signature)
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True


def persist_signing_key(data_dir: Path, key_b64: str) -> None:
    """Write the current signing key to ``data_dir/signing_public_key`` (raw base64, no newline, 0600)."""
    decode_public_key(key_b64, "current")  # never persist a key we could not use
    write_atomic(Path(data_dir) / SIGNING_KEY_FILE, key_b64.strip().encode())


def load_signing_key(data_dir: Path) -> str | None:
    """The persisted signing key (whitespace-trimmed), or None when the file is absent."""
    try:
        return (Path(data_dir) / SIGNING_KEY_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


class NonceStoreFull(PlexdError):
    """The store holds `max_entries` unexpired nonces: the event is refused rather than one of them forgotten."""


class NonceStore:
    """Seen nonces → issued_at, expiring ``NONCE_TTL`` after issued_at; in memory. Seeded at start from the event
    ledger (`plexd.controlplane.ledger`), which the event stream keeps (a nonce is committed there with the cursor,
    once its event's effect is durable).

    Only nonces still inside the staleness window matter: an older event is refused by the window check before
    the nonce is ever looked at, so expiring by issued_at loses nothing. A nonce is never forgotten before then:
    forgetting one would let its event be replayed. When `max_entries` unexpired nonces are held, a new event is
    refused (NonceStoreFull) until some expire, at most five minutes later. Kept in arrival order, which is
    issued_at order but for clock skew between events, so expiry takes from the front: O(1) per event; a full
    store is swept whole once before it refuses (a skewed early entry cannot hold expired ones behind it).
    """

    FULL_LOG_INTERVAL = 60.0  # seconds between two "store full" warnings: one line, not one per event

    def __init__(self, clock: Clock, ledger: EventLedger | None = None, max_entries: int = MAX_NONCES) -> None:
        self._clock = clock
        self._max = max_entries
        self._seen: dict[str, float] = {}  # nonce -> issued_at (unix seconds), oldest first
        self.refused_full = 0  # events refused because the store was full (for status)
        self._refused_since_log = 0
        self._last_full_log: float | None = None
        if ledger is not None:
            self._seen.update(ledger.take_loaded_nonces())
            self._expire()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, nonce: str) -> bool:
        return nonce in self._seen

    @property
    def max_entries(self) -> int:
        return self._max

    def _cutoff(self) -> float:
        return (self._clock.now() - NONCE_TTL).timestamp()

    def _expire(self) -> None:
        cutoff = self._cutoff()
        seen = self._seen
        while seen:
            oldest = next(iter(seen))
            if seen[oldest] >= cutoff:
                break
            del seen[oldest]

    def _sweep(self) -> None:
        cutoff = self._cutoff()
        self._seen = {n: t for n, t in self._seen.items() if t >= cutoff}

    def add(self, nonce: str, issued_at: datetime) -> bool:
        """Record `nonce`. Returns False (and records nothing) if it was already seen; raises NonceStoreFull (and
        records nothing) when `max_entries` unexpired nonces are held."""
        self._expire()
        if nonce in self._seen:
            return False
        if len(self._seen) >= self._max:
            self._sweep()
            if len(self._seen) >= self._max:
                self._note_full()
                raise NonceStoreFull(f"nonce store full ({self._max} unexpired nonces)")
        self._seen[nonce] = issued_at.timestamp()
        return True

    def _note_full(self) -> None:
        self.refused_full += 1
        self._refused_since_log += 1
        now = self._clock.monotonic()
        if self._last_full_log is None or now - self._last_full_log >= self.FULL_LOG_INTERVAL:
            log.warning("nonce store full (%d unexpired nonces): refusing new events until nonces expire "
                        "(%d refused since the last warning); unexpired nonces are never dropped, so no event "
                        "can be replayed", self._max, self._refused_since_log)
            self._last_full_log, self._refused_since_log = now, 0


class Verifier:
    """Verifies event envelopes against the current (and, during a transition, previous) signing key."""

    def __init__(
        self,
        keys: SigningKeysLike | None,
        nonce_store: NonceStore,
        clock: Clock,
        on_keys_changed: Callable[[SigningKeysLike], None] | None = None,
        node_id: Callable[[], str] | None = None,
    ) -> None:
        # this node's id, asked per event (a re-registration may change it): an event whose signed payload is
        # bound to other nodes is refused
        self._node_id = node_id
        self._clock = clock
        self._nonces = nonce_store
        self._on_keys_changed = on_keys_changed
        self._current: VerifyKey | None = None
        self._previous: VerifyKey | None = None
        self._transition_expires: datetime | None = None
        self._keys: SigningKeysLike | None = None
        if keys is not None:
            self.set_keys(keys)

    @property
    def keys(self) -> SigningKeysLike | None:
        return self._keys

    @property
    def clock(self) -> Clock:
        return self._clock

    def trusted_keys(self) -> list[VerifyKey]:
        """The keys that sign for the control plane now: the current one, and the previous one while the
        transition lasts (session tokens are checked against these, as events are)."""
        return [key for key in (self._current, self.previous_key(self._clock.now())) if key is not None]

    @property
    def current_key(self) -> VerifyKey | None:
        return self._current

    def previous_key(self, now: datetime) -> VerifyKey | None:
        """The previous key, while its transition lasts (`now < transition_expires`); None after it."""
        if self._transition_expires is not None and now < self._transition_expires:
            return self._previous
        return None

    def set_keys(self, keys: SigningKeysLike) -> bool:
        """Replace the keys after checking them all; raise InvalidSigningKeys and keep the old ones otherwise.

        Returns True when the keys actually changed (a repeated update is a no-op).
        """
        current = decode_public_key(keys.current or "", "current")
        previous = decode_public_key(keys.previous, "previous") if keys.previous else None
        expires = None
        if keys.transition_expires:
            try:
                expires = gojson.parse_time(keys.transition_expires)
            except ValueError as exc:
                raise InvalidSigningKeys(f"signing keys transition_expires: {exc}") from None
        old = self._keys
        changed = old is None or (old.current, old.previous, old.transition_expires) != (
            keys.current, keys.previous, keys.transition_expires)
        self._current, self._previous, self._transition_expires = current, previous, expires
        self._keys = keys
        if changed:
            log.info(
                "signing keys set: current %s%s",
                key_fingerprint(keys.current),
                f", previous {key_fingerprint(keys.previous)} until {keys.transition_expires}" if previous else "",
            )
            if self._on_keys_changed is not None:
                self._on_keys_changed(keys)
        return changed

    def verify(self, env: Envelope) -> None:
        """Return if `env` is authentic, fresh and not a replay; raise EventRejected otherwise."""
        # 1. presence
        if not env.signature:
            raise EventRejected("missing_signature", "event has no signature")
        if not env.nonce:
            raise EventRejected("missing_nonce", "event has no nonce")
        # 2. issued_at, and the staleness window both ways
        now = self._clock.now()
        issued = check_window(env.issued_at, now)
        self._check_authentic(env, now)
        # 7. nonce, only now that the event is known to be genuine and ours
        try:
            fresh = self._nonces.add(env.nonce, issued)
        except NonceStoreFull as exc:
            raise EventRejected(NONCE_STORE_FULL, f"{exc}: event refused rather than forget one") from None
        if not fresh:
            raise EventRejected("duplicate_nonce", f"duplicate nonce {env.nonce!r} (replayed event)")

    def authentic(self, env: Envelope) -> bool:
        """Whether `env` is signed by a key trusted now and addressed to this node, whatever its time: an event
        refused only by the window may be held until this node's clock agrees (`plexd.controlplane.clock_hold`)."""
        if not env.signature or not env.nonce or not env.issued_at:
            return False
        try:
            self._check_authentic(env, self._clock.now())
        except EventRejected:
            return False
        return True

    def _check_authentic(self, env: Envelope, now: datetime) -> None:
        # 3. signature encoding
        signature = decode_signature(env.signature)
        if self._current is None:
            raise EventRejected("no_signing_key", "no signing key is known yet")
        # 4./5. current key, then previous key while the transition lasts
        message = env.canonical_bytes()
        if not (signed_by(self._current, message, signature)
                or signed_by(self.previous_key(now), message, signature)):
            raise EventRejected("bad_signature", "signature verification failed")
        # 6. for this node: the control plane's signed payload may name the nodes it addressed (the envelope
        # itself cannot: its signed bytes are fixed by the wire format); an event for others is a replay
        self._check_target(env)

    def _check_target(self, env: Envelope) -> None:
        if self._node_id is None or TARGETS_FIELD not in env.payload_raw:  # the Go control plane never binds
            return
        own = self._node_id()
        try:
            payload = env.payload()
        except WireFormatError:
            return  # not this check's business: the handler names what is wrong with the payload
        targets = payload.get(TARGETS_FIELD) if isinstance(payload, dict) else None
        if targets is None:
            return
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise EventRejected("bad_target", f"payload {TARGETS_FIELD} is not a list of node ids")
        if own not in targets:
            shown = ", ".join(t[:40].encode("unicode_escape").decode() for t in targets[:3])
            shown += " ..." if len(targets) > 3 else ""
            raise EventRejected("wrong_node", f"event is addressed to {shown or 'no node'}, not to this node "
                                              f"{own} (replayed from another node's stream?)")


def install_signing_keys(verifier: Verifier, data_dir: Path | None, keys: SigningKeysLike) -> bool:
    """Length-check and install new signing keys, persisting the current one before the event that brought them
    is acknowledged (a crash in between must not lose a rotation). Raises InvalidSigningKeys."""
    changed = verifier.set_keys(keys)
    if changed and data_dir is not None:
        persist_signing_key(Path(data_dir), keys.current)
    return changed
