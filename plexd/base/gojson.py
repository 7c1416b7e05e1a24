"""JSON conventions of the Go agent that we must reproduce byte for byte.

The control-plane protocol was defined by a Go program, so a few of Go's `encoding/json` and `time` habits are
part of the wire contract (see docs/protocol.md §0.2 and §3):

- times are RFC 3339 with nanoseconds, trailing fractional zeros trimmed, a zero offset printed as ``Z``;
- durations are ``time.Duration.String()`` strings (``1h2m3.5s``, ``150ms``, ``0s``) and are parsed with
  ``time.ParseDuration`` rules;
- when Go re-marshals a raw JSON value it compacts it, keeps key order, and escapes ``<``, ``>``, ``&``, U+2028
  and U+2029 as ``\\u003c``-style sequences. Event signatures are computed over those bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

# ---------------------------------------------------------------------------------------------------------------
# Times

_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(?:([Zz])|([+-])(\d{2}):(\d{2}))$"
)


def parse_time(text: str) -> datetime:
    """Parse an RFC 3339 timestamp into an aware datetime (sub-microsecond digits are dropped)."""
    if not isinstance(text, str):
        raise ValueError(f"expected an RFC 3339 time string, got {type(text).__name__}")
    m = _RFC3339.match(text)
    if not m:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
    frac = m.group(7) or ""
    micro = int((frac + "000000")[:6]) if frac else 0
    if m.group(8):
        tz = UTC
    else:
        sign = 1 if m.group(9) == "+" else -1
        hh, mm = int(m.group(10)), int(m.group(11))
        if hh > 23 or mm > 59:
            raise ValueError(f"bad zone offset in time {text!r}")
        tz = timezone(sign * timedelta(hours=hh, minutes=mm))
    try:
        return datetime(year, month, day, hour, minute, second, micro, tzinfo=tz)
    except ValueError as exc:
        raise ValueError(f"not a valid time {text!r}: {exc}") from None


def canonical_time(text: str) -> str:
    """Re-print an RFC 3339 string exactly as Go's ``time.Time.MarshalJSON`` would after parsing it.

    Works on the text, not on a datetime, so nanosecond digits survive (Python datetimes stop at microseconds).
    """
    m = _RFC3339.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    parse_time(text)  # range checks (month 13, hour 25, ...)
    date = f"{m.group(1)}-{m.group(2)}-{m.group(3)}T{m.group(4)}:{m.group(5)}:{m.group(6)}"
    frac = (m.group(7) or "")[:9].rstrip("0")
    if frac:
        date += "." + frac
    if m.group(8) or (m.group(10) == "00" and m.group(11) == "00"):
        return date + "Z"
    return f"{date}{m.group(9)}{m.group(10)}:{m.group(11)}"


def format_time(moment: datetime) -> str:
    """Format an aware datetime the way Go marshals a ``time.Time`` (RFC3339Nano, zeros trimmed)."""
    if moment.tzinfo is None:
        raise ValueError("format_time needs an aware datetime")
    text = moment.isoformat(timespec="microseconds")
    base, _, rest = text.partition(".")
    micro, offset = rest[:6], rest[6:]
    micro = micro.rstrip("0")
    if offset in ("+00:00", "-00:00"):
        offset = "Z"
    return f"{base}.{micro}{offset}" if micro else f"{base}{offset}"


def now_utc() -> datetime:
    return datetime.now(UTC)


GO_ZERO_TIME = "0001-01-01T00:00:00Z"  # a zero time.Time, as Go marshals it


def now_text() -> str:
    """The current time as Go marshals a ``time.Time`` (RFC3339Nano in UTC)."""
    return format_time(now_utc())


def format_unix(seconds: float) -> str:
    """Unix seconds as Go marshals the time (RFC3339Nano in UTC)."""
    return format_time(datetime.fromtimestamp(seconds, UTC))


# ---------------------------------------------------------------------------------------------------------------
# Durations

_UNITS_NS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_DURATION_PART = re.compile(r"(\d*)(?:\.(\d*))?([a-zµμ]+)")
_MAX_NS = (1 << 63) - 1


def parse_duration(text: str) -> float:
    """Parse a Go duration string (``30s``, ``1m30s``, ``150ms``, ``-1.5h``) and return seconds."""
    return parse_duration_ns(text) / 1e9


def parse_duration_ns(text: str) -> int:
    if not isinstance(text, str):
        raise ValueError(f"expected a duration string like '30s', got {type(text).__name__} {text!r}")
    orig = text
    sign = 1
    if text[:1] in "+-" and text:
        sign = -1 if text[0] == "-" else 1
        text = text[1:]
    if text == "0":
        return 0
    if not text:
        raise ValueError(f"invalid duration {orig!r}: empty")
    total = 0
    pos = 0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if not m or (not m.group(1) and not m.group(2)):
            raise ValueError(f"invalid duration {orig!r}: expected a number followed by a unit (ns, us, ms, s, m, h)")
        whole, frac, unit = m.group(1), m.group(2) or "", m.group(3)
        if unit not in _UNITS_NS:
            raise ValueError(f"invalid duration {orig!r}: unknown unit {unit!r} (use ns, us, ms, s, m, h)")
        scale = _UNITS_NS[unit]
        value = int(whole or "0") * scale
        if frac:
            value += int(frac) * scale // (10 ** len(frac))
        total += value
        if total > _MAX_NS:
            raise ValueError(f"invalid duration {orig!r}: out of range")
        pos = m.end()
    return sign * total


def format_duration(seconds: float) -> str:
    """Format seconds as Go's ``time.Duration.String()`` (``1h2m3.5s``, ``1.5ms``, ``0s``)."""
    return format_duration_ns(round(seconds * 1e9))


def format_duration_ns(ns: int) -> str:
    if ns == 0:
        return "0s"
    neg = ns < 0
    u = -ns if neg else ns
    if u < 1_000_000_000:
        if u < 1_000:
            text = f"{u}ns"
        elif u < 1_000_000:
            text = _frac(u, 1_000) + "\u00b5s"
        else:
            text = _frac(u, 1_000_000) + "ms"
    else:
        hours, rem = divmod(u, 3_600_000_000_000)
        minutes, rem = divmod(rem, 60_000_000_000)
        text = _frac(rem, 1_000_000_000) + "s"
        if hours:
            text = f"{hours}h{minutes}m{text}"
        elif minutes:
            text = f"{minutes}m{text}"
    return "-" + text if neg else text


def _frac(value: int, unit: int) -> str:
    whole, rest = divmod(value, unit)
    if not rest:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{str(rest).rjust(digits, '0').rstrip('0')}"


# ---------------------------------------------------------------------------------------------------------------
# Marshalling

_HTML_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_HTML_RE = re.compile("[<>&\u2028\u2029]")


def _html_escape(text: str) -> str:
    # Five substring scans (memchr) cost a hundredth of the regex pass, and most texts have none of these
    # characters (at 1,000 peers: four or five metrics batches of 219 KiB a minute).
    if not any(ch in text for ch in _HTML_ESCAPES):
        return text
    return _HTML_RE.sub(lambda m: _HTML_ESCAPES[m.group(0)], text)


def go_string(value: str) -> str:
    """A JSON string literal as Go's json.Marshal writes it (HTML-safe, non-ASCII raw)."""
    return _html_escape(json.dumps(value, ensure_ascii=False))


@dataclass(frozen=True)
class EncodedJSON:
    """A value already encoded as compact JSON (``json.dumps(v, ensure_ascii=False, separators=(",", ":"))``):
    queued telemetry is sent as the text it was stored as, not decoded and encoded again."""

    text: str

    @classmethod
    def array(cls, items: Iterable[str]) -> EncodedJSON:
        return cls("[" + ",".join(items) + "]")


def go_marshal(value: object) -> str:
    """Compact JSON as Go writes it for maps/slices/strings (keys in the given order)."""
    if isinstance(value, EncodedJSON):
        return _html_escape(value.text)
    return _html_escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def go_compact(raw: str) -> str:
    """Compact raw JSON text like Go's ``json.Compact`` with HTML escaping: key order and string contents kept.

    The input must already be valid JSON; whitespace outside strings is removed. Every event's signature is checked
    over this text: a payload with neither whitespace nor those five characters (what a control plane that writes
    compact JSON sends) is already its own compact form, found by seven substring scans instead of a walk.
    """
    if not any(ch in raw for ch in " \t\n\r") and not any(ch in raw for ch in _HTML_ESCAPES):
        return raw
    out: list[str] = []
    in_string = False
    escaped = False
    for ch in raw:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            out.append(_HTML_ESCAPES.get(ch, ch))
        elif ch in " \t\n\r":
            continue
        else:
            if ch == '"':
                in_string = True
            out.append(ch)
    return "".join(out)
