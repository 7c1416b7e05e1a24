"""Signed event log and fan-out to open SSE streams.

Every event gets a global sequence number (`evt_<seq>`), is signed once with the deployment key (§3), written
to SQLite with the list of nodes it targets (so `Last-Event-ID` replay works across restarts), then pushed
into the asyncio.Queue of every open stream of those nodes. One signature and one row per event no matter how
many nodes receive it; delivery to an open stream never touches the database.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import nacl.signing

from plexd.base import gojson
from plexd.controlplane.envelope import sign_event
from plexd.controlplane.event_signing import TARGETS_FIELD
from plexd.devplane.store import Store

log = logging.getLogger(__name__)

SUBSCRIBER_QUEUE_LIMIT = 10_000  # a stream this far behind is closed; the client reconnects and replays from disk
_EVENT_ID = re.compile(r"^evt_(\d+)$")


def event_id(seq: int) -> str:
    return f"evt_{seq}"


def parse_event_id(text: str) -> int | None:
    m = _EVENT_ID.match(text.strip())
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StreamEvent:
    seq: int
    event_type: str
    data: str  # the SSE data text (a signed envelope, or raw test data)


class Signer:
    """The deployment's Ed25519 signing key, with the previous key during a rotation window."""

    def __init__(self, store: Store) -> None:
        self.store = store
        seed = store.get_meta("signing_seed")
        if seed is None:
            key = nacl.signing.SigningKey.generate()
            store.set_meta("signing_seed", base64.b64encode(bytes(key)).decode())
        else:
            key = nacl.signing.SigningKey(base64.b64decode(seed))
        self.key = key
        self.previous = store.get_meta("signing_previous") or ""
        self.transition_expires = store.get_meta("signing_transition_expires") or ""

    @property
    def public_key(self) -> str:
        return base64.b64encode(bytes(self.key.verify_key)).decode()

    def keys(self, now: datetime) -> dict[str, str]:
        """`signing_keys` of the state (§4.1): the previous key only while its transition is still open."""
        out = {"current": self.public_key}
        if self.previous and self.transition_expires and gojson.parse_time(self.transition_expires) > now:
            out["previous"] = self.previous
            out["transition_expires"] = self.transition_expires
        return out

    def next_keys(self, now: datetime, transition_seconds: float) -> tuple[nacl.signing.SigningKey, dict[str, str]]:
        """A fresh key and the `signing_key_rotated` payload announcing it (not installed yet)."""
        new = nacl.signing.SigningKey.generate()
        expires = gojson.format_time(now + timedelta(seconds=transition_seconds))
        return new, {"current": base64.b64encode(bytes(new.verify_key)).decode(), "previous": self.public_key,
                     "transition_expires": expires}

    def install(self, new: nacl.signing.SigningKey, keys: dict[str, str]) -> None:
        with self.store.transaction():
            self.store.set_meta("signing_seed", base64.b64encode(bytes(new)).decode())
            self.store.set_meta("signing_previous", keys["previous"])
            self.store.set_meta("signing_transition_expires", keys["transition_expires"])
        self.key, self.previous, self.transition_expires = new, keys["previous"], keys["transition_expires"]


class Subscriber:
    """One open SSE stream."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue(SUBSCRIBER_QUEUE_LIMIT)
        self.overflowed = False

    def push(self, event: StreamEvent) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            # Too slow: end the stream rather than buffer without bound; the replay brings it back.
            log.warning("event stream of %s fell %d events behind; closing it", self.node_id, SUBSCRIBER_QUEUE_LIMIT)
            self.close()

    def close(self) -> None:
        """End the stream after what is queued (None marks the end); a full queue is dropped to make room."""
        self.overflowed = True
        if self.queue.full():
            self.queue._queue.clear()  # type: ignore[attr-defined]
        self.queue.put_nowait(None)


# An object payload names the nodes it is for, inside the signature, when they are few: every event addressed to
# one node (its state, secrets, actions, sessions, key rotation) and the peer events of small meshes. A fan-out to
# more nodes is not bound (the list would grow every event with the mesh); those carry what every watcher may see.
MAX_BOUND_TARGETS = 64


class EventHub:
    def __init__(self, store: Store, signer: Signer, node_num: Callable[[str], int], clock_now: Any = None) -> None:
        self.store = store
        self.signer = signer
        self.node_num = node_num  # node id -> the small number events are addressed with
        self._now = clock_now or gojson.now_utc
        self.seq = store.last_event_seq()
        self.subscribers: dict[str, set[Subscriber]] = {}

    # -- publishing ---------------------------------------------------------------------------------------------

    def publish(
        self,
        targets: Iterable[str],
        event_type: str,
        payload: Any = None,
        *,
        payload_raw: str | None = None,
        issued_at: str | None = None,
        nonce: str | None = None,
        signature: str | None = None,
        raw_data: str | None = None,
        raw_frame: str | None = None,
    ) -> str:
        """Sign, persist and deliver one event to every node in `targets`. Returns its event id.

        `signature="forge"` replaces the signature with random bytes; `raw_data` is sent verbatim as the SSE
        data, unsigned; `raw_frame` is sent verbatim as a whole SSE block (lines and blank line included), so a
        test can send any id, event or retry line (all for the agent's fault tests).
        """
        targets = list(dict.fromkeys(targets))
        self.seq += 1
        seq = self.seq
        eid = event_id(seq)
        if payload_raw is not None:
            payload_raw = one_line(payload_raw)
        if raw_data is not None:
            data = raw_data
        elif raw_frame is not None:
            data, event_type = raw_frame, RAW_FRAME  # the whole SSE block, its own id/retry/event lines included
        else:
            issued = issued_at or gojson.format_time(self._now())
            if isinstance(payload, dict) and payload_raw is None and 0 < len(targets) <= MAX_BOUND_TARGETS:
                payload = {**payload, TARGETS_FIELD: targets}  # signed: another node refuses it (replay)
            data = sign_event(self.signer.key, event_type, eid, payload, issued_at=issued, nonce=nonce,
                              payload_raw=payload_raw)
            if signature is not None:
                forged = signature
                if signature == "forge":
                    forged = base64.b64encode(os.urandom(64)).decode()
                data = replace_signature(data, forged)
            data = split_long_lines(data)
        self.store.add_event(seq, event_type, data, time.time(), [self.node_num(t) for t in targets])
        event = StreamEvent(seq, event_type, data)
        for node_id in targets:
            for sub in self.subscribers.get(node_id, ()):
                sub.push(event)
        log.debug("event %s %s -> %d nodes", eid, event_type, len(targets))
        return eid

    # -- streams ------------------------------------------------------------------------------------------------

    def subscribe(self, node_id: str) -> Subscriber:
        sub = Subscriber(node_id)
        self.subscribers.setdefault(node_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        subs = self.subscribers.get(sub.node_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self.subscribers[sub.node_id]

    def close_streams(self, node_id: str) -> None:
        """End every open stream of a node (it was removed)."""
        for sub in list(self.subscribers.get(node_id, ())):
            sub.close()

    def stream_count(self, node_id: str | None = None) -> int:
        if node_id is not None:
            return len(self.subscribers.get(node_id, ()))
        return sum(len(s) for s in self.subscribers.values())

    def backlog(self, node_id: str, after_seq: int | None, replay_window: float) -> list[StreamEvent]:
        """Events to replay on connect: everything after `after_seq`, or (no Last-Event-ID) the recent ones."""
        if after_seq is None:
            rows = self.store.events_after(self.node_num(node_id), 0, since=time.time() - replay_window)
        else:
            rows = self.store.events_after(self.node_num(node_id), after_seq)
        return [StreamEvent(seq, etype, data) for seq, etype, data in rows]


MAX_LINE = 60 * 1024  # Go's bufio.Scanner gives up at 64 KiB per line (§2.1), so signed events stay below


def split_long_lines(data: str, limit: int = MAX_LINE) -> str:
    """Break a long envelope into lines of at most `limit` characters, only between JSON tokens.

    The SSE client joins `data:` lines with newlines, which JSON reads as whitespace, and the signature covers
    the compacted payload, so the event means and verifies exactly the same. A single string token longer than
    the limit cannot be split and is left as it is.
    """
    if not data.isascii():
        limit //= 4  # the limit is in bytes; a character takes at most 4 in UTF-8
    if len(data) <= limit:
        return data
    lines: list[str] = []
    start = 0
    last_cut = -1  # a position outside strings where a newline may go
    in_string = escaped = False
    for i, ch in enumerate(data):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                last_cut = i + 1
        elif ch == '"':
            in_string = True
            last_cut = i
        elif ch in ",:[]{}":
            last_cut = i + 1
        if i + 1 - start > limit and last_cut > start:
            lines.append(data[start:last_cut])
            start = last_cut
    lines.append(data[start:])
    return "\n".join(lines)


def one_line(raw: str) -> str:
    """Keep caller-supplied payload text on one SSE line without changing what it means or its signature.

    Newlines can only be whitespace between tokens (JSON forbids them raw inside strings), and U+2028/U+2029
    can only sit inside strings, where their escaped form is equivalent; both compact to the same Go bytes.
    Line-splitting SSE parsers (Python's str.splitlines splits on U+2028) would otherwise cut the event.
    """
    return (raw.replace("\r", " ").replace("\n", " ").replace("\u2028", "\\u2028")
            .replace("\u2029", "\\u2029"))


def replace_signature(envelope: str, signature: str) -> str:
    head, sep, _ = envelope.rpartition(',"signature":"')
    return head + sep + signature + '"}'


RAW_FRAME = "__raw_frame__"  # event type of a verbatim SSE block (hostile-input tests): sent as it is


def format_sse(event: StreamEvent) -> bytes:
    """One SSE block: `id:`, `event:`, then the data (split on newlines into several `data:` lines)."""
    if event.event_type == RAW_FRAME:
        return event.data.encode("utf-8", "surrogateescape")
    lines = [f"id: {event_id(event.seq)}", f"event: {event.event_type}"]
    lines += [f"data: {part}" for part in event.data.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return ("\n".join(lines) + "\n\n").encode("utf-8")
