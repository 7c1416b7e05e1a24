"""Go wire conventions: durations, RFC3339Nano times, HTML-safe compact JSON (docs/protocol.md §0.2)."""

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plexd.base import gojson


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("1m30s", 90), ("150ms", 0.15), ("1h", 3600), ("0", 0), ("1.5s", 1.5), ("2h45m", 9900),
     ("-1.5h", -5400), ("100us", 0.0001), ("100µs", 0.0001), ("1h0m0.5s", 3600.5), (".5s", 0.5)],
)
def test_parse_duration(text, seconds):
    assert gojson.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "30", "1x", "s", "1h-5m", "abc", "1.5", "--1s", "."])
def test_parse_duration_rejects_with_value_in_message(bad):
    with pytest.raises(ValueError, match="duration"):
        gojson.parse_duration(bad)


@pytest.mark.parametrize(
    ("ns", "text"),
    [(0, "0s"), (1, "1ns"), (1500, "1.5µs"), (1_500_000, "1.5ms"), (1_500_000_000, "1.5s"),
     (90 * 10**9, "1m30s"), (3600 * 10**9, "1h0m0s"), ((72 * 3600 + 15 * 60) * 10**9, "72h15m0s"),
     (123 * 10**9 + 1, "2m3.000000001s"), (-1_500_000_000, "-1.5s")],
)
def test_format_duration_matches_go(ns, text):
    assert gojson.format_duration_ns(ns) == text


@given(st.integers(min_value=-(10**15), max_value=10**15))
def test_duration_round_trip(ns):
    assert gojson.parse_duration_ns(gojson.format_duration_ns(ns)) == ns


@pytest.mark.parametrize(
    ("given_text", "canonical"),
    [("2025-01-15T10:30:00Z", "2025-01-15T10:30:00Z"), ("2025-01-15T10:30:00.500Z", "2025-01-15T10:30:00.5Z"),
     ("2025-01-15T10:30:00.000Z", "2025-01-15T10:30:00Z"), ("2025-01-15T10:30:00+00:00", "2025-01-15T10:30:00Z"),
     ("2025-01-15T10:30:00.123456789+02:00", "2025-01-15T10:30:00.123456789+02:00"),
     ("2025-01-15t10:30:00.1200z", "2025-01-15T10:30:00.12Z")],
)
def test_canonical_time(given_text, canonical):
    assert gojson.canonical_time(given_text) == canonical


@pytest.mark.parametrize("bad", ["2025-01-15", "2025-13-01T00:00:00Z", "2025-01-15T10:30:00", "yesterday", ""])
def test_bad_times_are_refused(bad):
    with pytest.raises(ValueError):
        gojson.canonical_time(bad)


def test_format_time():
    assert gojson.format_time(datetime(2025, 1, 15, 10, 30, tzinfo=UTC)) == "2025-01-15T10:30:00Z"
    assert gojson.format_time(datetime(2025, 1, 15, 10, 30, 0, 120000, tzinfo=UTC)) == "2025-01-15T10:30:00.12Z"
    plus1 = timezone(timedelta(hours=1))
    assert gojson.format_time(datetime(2025, 1, 15, 10, 30, tzinfo=plus1)) == "2025-01-15T10:30:00+01:00"
    assert gojson.parse_time("2025-01-15T10:30:00.12Z") == datetime(2025, 1, 15, 10, 30, 0, 120000, tzinfo=UTC)


def test_go_marshal_escapes_like_go():
    assert gojson.go_marshal({"b": "<a&b>", "a": "\u2028"}) == '{"b":"\\u003ca\\u0026b\\u003e","a":"\\u2028"}'
    assert gojson.go_marshal("é") == '"é"'
    # stored telemetry goes out as its text: each of the five characters alone is still escaped
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                         ("\u2029", "\\u2029")):
        assert gojson.go_marshal(gojson.EncodedJSON.array([f'"a{raw}b"'])) == f'["a{escaped}b"]'
    assert gojson.go_marshal(gojson.EncodedJSON.array(['"plain"'])) == '["plain"]'


def test_go_compact_keeps_order_and_string_contents():
    raw = '{ "z" : [1, 2 ,{"y": "a b\\" <"}],\n "a":null }'
    assert gojson.go_compact(raw) == '{"z":[1,2,{"y":"a b\\" \\u003c"}],"a":null}'


def _compact_by_walk(raw: str) -> str:
    """The definition: drop whitespace outside strings, HTML-escape inside them, one character at a time."""
    out, in_string, escaped = [], False, False
    for ch in raw:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            out.append(gojson._HTML_ESCAPES.get(ch, ch))
        elif ch not in " \t\n\r":
            in_string = ch == '"'
            out.append(ch)
    return "".join(out)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab <>&"\\ \n\u2028é')),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8)


@given(_json_values, st.sampled_from([None, 0, 2]), st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_go_compact_is_the_walk_whatever_the_spacing(value, indent, separators, ascii_only):
    raw = json.dumps(value, indent=indent, separators=separators, ensure_ascii=ascii_only)
    assert gojson.go_compact(raw) == _compact_by_walk(raw)
