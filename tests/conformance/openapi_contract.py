"""The platform's OpenAPI (the node-facing part vendored in platform/openapi-node.yaml) as JSON Schema validators:
a request body plexd sends checked against its operation's request schema, an example answer against the response
schema of its status.

The vendored copy is an older cut of the platform's contract than the one plexd speaks; where the platform has
moved on since, the difference is listed in REQUEST_DEVIATIONS / ANSWER_STATUS_DEVIATIONS with its reason, and
only that difference is set aside.
"""

from __future__ import annotations

import base64
import binascii
import functools
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from plexd.base.gojson import parse_time

OPENAPI = Path(__file__).parent / "platform" / "openapi-node.yaml"
BASE = "urn:plexsphere:openapi-node"

# operation id -> (what the vendored OpenAPI says, what the platform says now) for request bodies
REQUEST_DEVIATIONS = {
    # The platform renamed RegisterRequest.resource_id to resource_handle after this cut; plexd sends the new name.
    "PostRegister": ("resource_id", "resource_handle"),
}
# operation id -> (status in the vendored OpenAPI, status the platform answers now)
ANSWER_STATUS_DEVIATIONS = {
    "PostRegister": ("200", "201"),  # the platform answers a registration 201 Created since this cut
    "PostNodeIntegrityViolations": ("202", "200"),  # and an integrity report 200, not 202
}


@functools.cache
def spec() -> dict[str, Any]:
    return yaml.load(OPENAPI.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def operations() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """operation id -> (method, path, operation)."""
    out = {}
    for path, item in spec()["paths"].items():
        for method, operation in item.items():
            if isinstance(operation, dict) and "operationId" in operation:
                out[operation["operationId"]] = (method.upper(), path, operation)
    return out


def _pointer(*parts: str) -> str:
    return "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


@functools.cache
def _registry() -> Registry:
    return Registry().with_resource(BASE, Resource.from_contents(spec(), default_specification=DRAFT202012))


def _byte(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        parse_time(value)
    except ValueError:
        return False
    return True


def _uuid(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


FORMATS = jsonschema.FormatChecker(formats=())
FORMATS.checks("byte")(_byte)
FORMATS.checks("date-time")(_date_time)
FORMATS.checks("uuid")(_uuid)


def _errors(pointer: str, value: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator({"$ref": f"{BASE}#/{pointer}"}, registry=_registry(),
                                                format_checker=FORMATS)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or 'body'}: {e.message}"
            for e in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))]


def request_problems(operation_id: str, media_type: str, body: Any) -> list[str]:
    """How `body` breaks the operation's request schema (the listed deviation set aside)."""
    method, path, operation = operations()[operation_id]
    content = operation.get("requestBody", {}).get("content", {})
    if media_type not in content:
        return [f"Content-Type {media_type}: the OpenAPI's {operation_id} takes {', '.join(content) or 'no body'}"]
    if operation_id in REQUEST_DEVIATIONS and isinstance(body, dict):
        old, new = REQUEST_DEVIATIONS[operation_id]
        body = {(old if k == new else k): v for k, v in body.items()}
    # NDJSON: `body` is the list of its lines, which the OpenAPI's schema describes as an array
    return _errors(_pointer("paths", path, method.lower(), "requestBody", "content", media_type, "schema"), body)


def answer_problems(operation_id: str, status: int, media_type: str, body: Any) -> list[str]:
    """How an example answer breaks the response schema the OpenAPI gives its status."""
    method, path, operation = operations()[operation_id]
    code = str(status)
    if operation_id in ANSWER_STATUS_DEVIATIONS and code == ANSWER_STATUS_DEVIATIONS[operation_id][1]:
        code = ANSWER_STATUS_DEVIATIONS[operation_id][0]
    responses = operation.get("responses", {})
    if code not in responses:
        return [f"status {status}: the OpenAPI's {operation_id} answers {', '.join(responses)}"]
    if body is None:  # a stream, raw bytes or no body: the status and media type only
        content = responses[code].get("content") or {"": None}
        return [] if media_type in content else [f"{media_type or 'no body'}: the OpenAPI's {operation_id} {code} "
                                                 f"answers {', '.join(content)}"]
    content = responses[code].get("content", {})
    if media_type not in content or "schema" not in content[media_type]:
        return [f"{media_type}: the OpenAPI gives no schema for {operation_id} {code}"]
    pointer = _pointer("paths", path, method.lower(), "responses", code, "content", media_type, "schema")
    return _errors(pointer, body)
