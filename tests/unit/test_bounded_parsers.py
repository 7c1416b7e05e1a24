"""Parsers of outside input are total: any input gives a value or the project's own error, never a crash.

The two found by a hostile control plane: a deeply nested SSE payload (RecursionError in the envelope parser)
and an absurdly large Retry-After (OverflowError)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import nacl.signing
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexd.base import boundedjson
from plexd.base.errors import WireFormatError
from plexd.controlplane.client import RETRY_AFTER_CAP, parse_retry_after
from plexd.controlplane.envelope import Envelope, parse_envelope, sign_event

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
SIGNER = nacl.signing.SigningKey.generate()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [65, 5000, 200_000])
def test_deeply_nested_payload_is_refused_by_name(depth):
    frame = sign_event(SIGNER, "peer_added", "evt_deep", None, payload_raw=nested(depth))
    with pytest.raises(WireFormatError, match="envelope: JSON nested deeper than 64 levels"):
        parse_envelope(frame)
    env = Envelope("peer_added", "evt_deep", "", "", nested(depth), "")
    with pytest.raises(WireFormatError, match="payload: JSON nested deeper than 64 levels"):
        env.payload()  # a handler reading a raw payload is bounded too


def test_deeply_nested_envelope_is_refused():
    with pytest.raises(WireFormatError, match="envelope: JSON nested deeper"):
        parse_envelope('{"event_type": "x", "payload": ' + nested(10_000) + "}")


def test_nesting_inside_strings_does_not_count():
    text = json.dumps({"s": "[" * 1000, "a": [[[1]]]})
    assert boundedjson.loads(text) == {"s": "[" * 1000, "a": [[[1]]]}


def test_nesting_at_the_limit_is_accepted():
    assert boundedjson.loads(nested(64)) is not None


def exact_too_deep_at(text: str, limit: int) -> int | None:
    """The token scan alone (what `too_deep_at` falls back to), as the reference for its fast path."""
    depth = 0
    for m in boundedjson._TOKEN.finditer(text):
        depth += 1 if m.group() in "[{" else -1 if m.group() in "]}" else 0
        if depth > limit:
            return m.start()
    return None


_JSONISH = st.text(alphabet='[]{}"\\n:,1ab ', max_size=200)
_VALUES = st.recursive(st.none() | st.integers() | st.text(alphabet='[]{}"\\\n\tab', max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                           st.text(alphabet='[]{}"\\ab', max_size=4), inner, max_size=3), max_leaves=40)


@settings(max_examples=400)
@given(st.one_of(_JSONISH, _VALUES.map(json.dumps)), st.integers(min_value=1, max_value=8))
def test_the_fast_depth_check_agrees_with_the_token_scan(text, limit):
    """Brackets in strings, escaped quotes and backslashes, unpaired brackets: the C path says "within" only when
    the exact scan finds nothing too deep, or when JSON itself refuses the text (a backslash outside any string,
    as in `[\\{]`: the C path drops it with the character it escapes, the scan counts that character; the parser
    stops at the backslash, so no nesting past it is ever reached)."""
    fast, exact = boundedjson.too_deep_at(text, limit), exact_too_deep_at(text, limit)
    if fast is None and exact is not None:
        with pytest.raises(ValueError):
            json.loads(text)
    else:
        assert fast == exact


def test_a_backslash_outside_strings_is_the_one_place_the_two_checks_differ_and_json_refuses_it():
    assert boundedjson.too_deep_at("[\\{]", 1) is None and exact_too_deep_at("[\\{]", 1) == 2
    with pytest.raises(ValueError):
        json.loads("[\\{]")


def test_an_escape_before_a_closing_quote_hides_no_bracket():
    text = '["\\n", ' + nested(10) + "]"  # after the escapes go, the quote must still close the string
    assert boundedjson.too_deep_at(text, 10) == len('["\\n", ') + 9  # the nested run's tenth bracket: level 11


@pytest.mark.parametrize("value, expected", [
    ("9" * 400, RETRY_AFTER_CAP),  # an int too large for a float: OverflowError before
    ("9" * 5000, RETRY_AFTER_CAP),  # longer than Python's int-from-str digit limit
    ("86401", RETRY_AFTER_CAP),
    ("120", 120.0),
    ("Fri, 31 Dec 9999 23:59:59 GMT", RETRY_AFTER_CAP),
    ("Mon, 01 Jan 0001 00:00:00 GMT", 0.0),
    ("١٢٣", None),  # Unicode digits are not HTTP digits
])
def test_retry_after_extremes(value, expected):
    assert parse_retry_after(value, NOW) == expected


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_retry_after_is_total(value):
    got = parse_retry_after(value, NOW)
    assert got is None or 0.0 <= got <= RETRY_AFTER_CAP


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='[]{}",:0123456789 \\a', max_size=300))
def test_boundedjson_raises_only_its_own_error(text):
    try:
        boundedjson.loads(text, "doc")
    except WireFormatError as exc:
        assert str(exc).startswith("doc: ")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_parse_envelope_raises_only_its_own_error(text):
    try:
        parse_envelope(text)
    except WireFormatError:
        pass
