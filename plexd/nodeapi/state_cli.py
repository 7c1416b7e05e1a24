"""`plexd state`: paths for the node API, the payload of `report put`, and the text the command prints."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import quote

from plexd.base import boundedjson
from plexd.base.errors import PlexdError
from plexd.nodeapi.keys import report_key_problem

MAX_PAYLOAD = 1 << 20
_PATHS = {"metadata": "metadata", "data": "data", "secret": "secrets", "report": "report"}


def get_path(kind: str, key: str | None) -> str:
    path = f"/v1/state/{_PATHS[kind]}"
    return f"{path}/{quote(key, safe='')}" if key is not None else path


def report_path(key: str) -> str:
    problem = report_key_problem(key)
    if problem:
        raise PlexdError(f"report key {key[:80]!r}: {problem}")
    return f"/v1/state/report/{quote(key, safe='')}"


def read_payload(source: str, content_type: str) -> Any:
    """The payload of `report put`: JSON for a JSON content type, else the text as a JSON string."""
    where = "stdin" if source == "-" else source
    try:
        raw = sys.stdin.buffer.read(MAX_PAYLOAD + 1) if source == "-" else _read_file(source)
    except OSError as exc:
        raise PlexdError(f"--file {where}: {exc.strerror or exc}") from None
    if len(raw) > MAX_PAYLOAD:
        raise PlexdError(f"--file {where}: larger than 1 MiB, the node API's limit")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PlexdError(f"--file {where}: not UTF-8 text") from None
    if not _is_json(content_type):
        return text
    try:
        return boundedjson.parse(text)
    except ValueError as exc:
        raise PlexdError(f"--file {where}: not valid JSON ({exc}); use --content-type for other payloads") from None


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(MAX_PAYLOAD + 1)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def format_answer(args: argparse.Namespace, doc: Any) -> str:
    action = args.state_action
    if action == "summary":
        return format_summary(doc)
    if action == "report":
        if args.report_action == "delete":
            return f"report {args.key} deleted (the control plane is told within a few seconds)"
        return f"report {doc['key']} written: version {doc['version']}"
    if args.key is None:
        if args.kind == "metadata":
            return "\n".join(f"{k}={v}" for k, v in sorted((doc or {}).items())) or "(no metadata)"
        return "\n".join(f"{e['key']}  v{e['version']}" + (f"  {e['content_type']}" if "content_type" in e else "")
                         for e in doc) or f"(no {args.kind} entries)"
    if args.kind == "metadata":
        return str(doc["value"])
    if args.kind == "secret":
        return str(doc["value"])
    payload = doc.get("payload")
    return payload if isinstance(payload, str) else json.dumps(payload, indent=2, ensure_ascii=False)


def format_summary(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata") or {}
    lines = [f"metadata: {', '.join(f'{k}={v}' for k, v in sorted(meta.items())) or '-'}"]
    for title, field in (("data", "data_keys"), ("secrets", "secret_keys"), ("reports", "report_keys")):
        items = doc.get(field) or []
        lines.append(f"{title}: " + (", ".join(f"{e['key']} v{e['version']}" for e in items) or "-"))
    return "\n".join(lines)
