"""The recorded wire documents (tests/conformance/<dialect>/*.json) and the check of a captured request against one.

A document pins one endpoint of one contract: the request plexd must send (method, path template, query, the
headers that matter, whether the body may be gzipped, and each body field's JSON type and presence) and an example
answer plexd must accept (status, headers, body) with what it must make of it (`result`). Presence is one of:

- ``always``: the key is sent every time (``null`` only where the field's type allows it);
- ``omitted_when_empty``: left out when there is nothing to say, never sent as ``null``, ``""``, ``[]`` or ``{}``;
- ``null_when_empty``: sent every time, ``null`` when it has no items (never ``[]``);
- ``optional``: may be left out; when sent, of its type.

`problems` answers one line per difference, naming the dialect, the endpoint and the field:
``platform heartbeat: nat_summary: sent null, contract says an object``.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from plexd.base.gojson import parse_time

HERE = Path(__file__).parent
DIALECTS = ("spec", "platform")
PRESENCES = ("always", "omitted_when_empty", "null_when_empty", "optional")
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
              "array": list, "null": type(None)}
ARTICLE = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
           "object": "an object", "array": "an array", "null": "null"}
HEX_SHA256 = re.compile(r"[0-9a-f]{64}")
GO_DURATION = re.compile(r"(0|-?([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)")
HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):[0-9]{1,5}")


@dataclass(frozen=True)
class Captured:
    """One request as the recording server saw it."""

    method: str
    target: str  # the raw request target: path and query, escapes kept
    headers: dict[str, str]  # lower-case names
    body: bytes  # as received (maybe gzipped)

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(urlsplit(self.target).query, keep_blank_values=True))

    def decoded_body(self) -> bytes:
        return gzip.decompress(self.body) if self.headers.get("content-encoding") == "gzip" else self.body


@dataclass(frozen=True)
class WireDocument:
    dialect: str
    endpoint: str
    doc: dict[str, Any]

    @property
    def request(self) -> dict[str, Any]:
        return self.doc["request"]

    @property
    def answer(self) -> dict[str, Any]:
        return self.doc["answer"]

    @property
    def method(self) -> str:
        return self.request["method"]

    @property
    def template(self) -> str:
        return self.request["path"]

    def matches(self, captured: Captured) -> bool:
        return captured.method == self.method and path_pattern(self.template).fullmatch(captured.path) is not None

    def path_params(self, captured: Captured) -> dict[str, str]:
        found = path_pattern(self.template).fullmatch(captured.path)
        return {} if found is None else {k: unquote(v) for k, v in found.groupdict().items()}

    def answer_bytes(self) -> bytes:
        if "json" in self.answer:
            return json.dumps(self.answer["json"]).encode()
        if "base64" in self.answer:
            return base64.b64decode(self.answer["base64"])
        if "sse" in self.answer:
            return "".join(sse_frame(f) for f in self.answer["sse"]).encode()
        return self.answer.get("text", "").encode()


def sse_frame(frame: dict[str, Any]) -> str:
    """One recorded event-stream frame as the server writes it (a comment, or id/event/data lines)."""
    if "comment" in frame:
        return f": {frame['comment']}\n\n"
    data = json.dumps(frame["data"], separators=(",", ":"), ensure_ascii=False)
    return f"id: {frame['id']}\nevent: {frame['event']}\ndata: {data}\n\n"


def path_pattern(template: str) -> re.Pattern[str]:
    """`/v1/nodes/{node_id}/state` → a pattern with one named group per parameter (one escaped path segment)."""
    parts = re.split(r"\{(\w+)\}", template)
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^/]+)" for i, p in enumerate(parts))
    return re.compile(regex)


def load(dialect: str) -> dict[str, WireDocument]:
    docs = {}
    for path in sorted((HERE / dialect).glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("endpoint") != path.stem:
            raise ValueError(f"{path}: endpoint {doc.get('endpoint')!r} is not the file's name")
        docs[path.stem] = WireDocument(dialect, path.stem, doc)
    return docs


def document_for(docs: dict[str, WireDocument], captured: Captured) -> WireDocument | None:
    return next((d for d in docs.values() if d.matches(captured)), None)


# -- the check --------------------------------------------------------------------------------------------------

def problems(document: WireDocument, captured: Captured) -> list[str]:
    """How `captured` differs from what `document` pins, one line each (empty: it conforms)."""
    where = f"{document.dialect} {document.endpoint}"
    out = [f"{where}: {line}" for line in _request_problems(document.request, captured)]
    return out


def _request_problems(rule: dict[str, Any], captured: Captured) -> list[str]:
    out: list[str] = []
    if captured.method != rule["method"]:
        out.append(f"method: sent {captured.method}, contract says {rule['method']}")
    if path_pattern(rule["path"]).fullmatch(captured.path) is None:
        out.append(f"path: sent {captured.path}, contract says {rule['path']}")
    found = path_pattern(rule["path"]).fullmatch(captured.path)
    for name, pattern in rule.get("path_params", {}).items():
        value = unquote(found.group(name)) if found is not None else ""
        if found is not None and not re.fullmatch(pattern, value):
            out.append(f"path {{{name}}}: sent {value[:60]!r}, contract says it matches {pattern}")
    out += _query_problems(rule.get("query", {}), captured.query)
    out += _header_problems(rule, captured)
    body_rule = rule.get("body")
    if body_rule is None:
        if captured.body:
            out.append(f"body: sent {len(captured.body)} bytes, contract says none")
        return out
    try:
        text = captured.decoded_body()
        if rule.get("body_format") == "ndjson":
            value = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            value = json.loads(text)
    except (ValueError, OSError) as exc:
        return [*out, f"body: sent something that is not JSON ({exc}), contract says {_want(body_rule)}"]
    out += _value_problems("body", value, body_rule)
    return out


def _query_problems(rule: dict[str, str], query: dict[str, str]) -> list[str]:
    out = [f"query {name}: sent {query[name]!r}, contract says it matches {pattern}"
           for name, pattern in rule.items() if name in query and not re.fullmatch(pattern, query[name])]
    out += [f"query {name}: sent, contract has no such parameter" for name in query if name not in rule]
    return out


def _header_problems(rule: dict[str, Any], captured: Captured) -> list[str]:
    out = []
    for name, pattern in rule.get("headers", {}).items():
        value = captured.headers.get(name.lower())
        if value is None:
            out.append(f"header {name}: not sent, contract says it matches {pattern}")
        elif not re.fullmatch(pattern, value):
            out.append(f"header {name}: sent {_redacted(name, value)!r}, contract says it matches {pattern}")
    for name, pattern in rule.get("optional_headers", {}).items():
        value = captured.headers.get(name.lower())
        if value is not None and not re.fullmatch(pattern, value):
            out.append(f"header {name}: sent {value[:40]!r}, contract says it matches {pattern} when sent")
    for name in rule.get("absent_headers", []):
        if name.lower() in captured.headers:
            out.append(f"header {name}: sent {_redacted(name, captured.headers[name.lower()])!r}, "
                       "contract says it is not sent")
    gzipped = captured.headers.get("content-encoding") == "gzip"
    encoding = rule.get("gzip", "never")
    if encoding == "never" and gzipped:
        out.append("header Content-Encoding: sent gzip, contract says the body is never compressed "
                   "(the control plane reads it as it comes)")
    elif encoding == "allowed":
        pass
    elif isinstance(encoding, dict):
        size = len(captured.decoded_body())
        if gzipped != (size > encoding["above_bytes"]):
            out.append(f"header Content-Encoding: {'sent gzip' if gzipped else 'not sent'} for a {size}-byte "
                       f"body, contract says gzip exactly above {encoding['above_bytes']} bytes")
    return out


def _redacted(name: str, value: str) -> str:
    return value[:16] + "…" if name.lower() == "authorization" and len(value) > 16 else value


# -- JSON values ------------------------------------------------------------------------------------------------

def _types(rule: dict[str, Any]) -> list[str]:
    kinds = rule["type"]
    return [kinds] if isinstance(kinds, str) else list(kinds)


def _want(rule: dict[str, Any]) -> str:
    return " or ".join(ARTICLE[k] for k in _types(rule))


def kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    for name in ("number", "string", "object", "array", "null"):
        if isinstance(value, JSON_TYPES[name]):
            return name
    return type(value).__name__


def _sent(value: Any) -> str:
    kind = kind_of(value)
    if kind == "null":
        return "null"
    if kind in ("array", "object") and not value:
        return "[]" if kind == "array" else "{}"
    if kind == "string" and not value:
        return '""'
    return ARTICLE[kind]


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, str | list | dict) and not value)


def _value_problems(path: str, value: Any, rule: dict[str, Any]) -> list[str]:
    kinds = _types(rule)
    sent = kind_of(value)
    if sent not in kinds and not (sent == "integer" and "number" in kinds):
        return [f"{path}: sent {_sent(value)}, contract says {_want(rule)}"]
    out: list[str] = []
    if isinstance(value, str):
        out += _string_problems(path, value, rule)
    elif isinstance(value, dict) and "fields" in rule:
        out += _object_problems(path, value, rule)
    elif isinstance(value, list) and "items" in rule:
        for i, item in enumerate(value):
            out += _value_problems(f"{path}[{i}]", item, rule["items"])
    return out


def _object_problems(path: str, value: dict[str, Any], rule: dict[str, Any]) -> list[str]:
    out: list[str] = []
    fields: dict[str, Any] = rule["fields"]
    prefix = "" if path == "body" else f"{path}."
    for name, field_rule in fields.items():
        where = prefix + name
        presence = field_rule.get("presence", "always")
        if name not in value:
            if presence in ("always", "null_when_empty"):
                out.append(f"{where}: not sent, contract says {_want(field_rule)}, always sent")
            continue
        item = value[name]
        if presence == "omitted_when_empty" and _is_empty(item):
            out.append(f"{where}: sent {_sent(item)}, contract says it is left out when empty")
            continue
        if presence == "null_when_empty" and isinstance(item, list | dict) and not item:
            out.append(f"{where}: sent {_sent(item)}, contract says null when empty")
            continue
        if presence == "null_when_empty" and item is None:
            continue
        out += _value_problems(where, item, field_rule)
    one_of = rule.get("exactly_one_of")
    if one_of and sum(name in value for name in one_of) != 1:
        sent = [name for name in one_of if name in value] or ["none"]
        out.append(f"{path}: sent {' and '.join(sent)}, contract says exactly one of {', '.join(one_of)}")
    if not rule.get("other_fields", False):
        out += [f"{prefix}{name}: sent, contract has no such field" for name in value if name not in fields]
    return out


def _string_problems(path: str, value: str, rule: dict[str, Any]) -> list[str]:
    if "enum" in rule and value not in rule["enum"]:
        return [f"{path}: sent {value[:40]!r}, contract says one of {', '.join(rule['enum'])}"]
    if "equals" in rule and value != rule["equals"]:
        return [f"{path}: sent {value[:40]!r}, contract says {rule['equals']!r}"]
    if "pattern" in rule and not re.fullmatch(rule["pattern"], value):
        return [f"{path}: sent {value[:40]!r}, contract says it matches {rule['pattern']}"]
    fmt = rule.get("format")
    if fmt and value and not FORMATS[fmt](value):
        return [f"{path}: sent {value[:40]!r}, contract says {FORMAT_NAMES[fmt]}"]
    return []


def _rfc3339(value: str) -> bool:
    try:
        parse_time(value)
    except ValueError:
        return False
    return True


def _rfc3339_utc(value: str) -> bool:
    return _rfc3339(value) and value.endswith("Z")


def _b64_32(value: str) -> bool:
    try:
        return len(base64.b64decode(value, validate=True)) == 32
    except (binascii.Error, ValueError):
        return False


def _uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


FORMATS = {
    "date-time": _rfc3339, "date-time-utc": _rfc3339_utc, "base64-32": _b64_32, "uuid": _uuid,
    "hex-sha256": lambda v: HEX_SHA256.fullmatch(v) is not None,
    "go-duration": lambda v: GO_DURATION.fullmatch(v) is not None,
    "host-port": lambda v: HOST_PORT.fullmatch(v) is not None,
}
FORMAT_NAMES = {
    "date-time": "an RFC 3339 time", "date-time-utc": "an RFC 3339 time in UTC (Z)",
    "base64-32": "standard base64 of 32 bytes", "uuid": "a canonical UUID", "hex-sha256": "bare lower-case hex SHA-256",
    "go-duration": "a Go duration string", "host-port": "host:port",
}


def check_document_shape(document: WireDocument) -> list[str]:
    """Mistakes in a document itself (an unknown presence, type or format), so a typo never passes silently."""
    out: list[str] = []

    def walk(path: str, rule: dict[str, Any]) -> None:
        for kind in _types(rule):
            if kind not in JSON_TYPES:
                out.append(f"{path}: unknown type {kind!r}")
        if rule.get("presence", "always") not in PRESENCES:
            out.append(f"{path}: unknown presence {rule['presence']!r}")
        if rule.get("format") and rule["format"] not in FORMATS:
            out.append(f"{path}: unknown format {rule['format']!r}")
        for name, sub in rule.get("fields", {}).items():
            walk(f"{path}.{name}", sub)
        if "items" in rule:
            walk(f"{path}[]", rule["items"])

    if document.request.get("body") is not None:
        walk(f"{document.dialect} {document.endpoint} body", document.request["body"])
    return out
