"""How schemathesis meets the devplane: the checks run, the few set aside per operation where the platform (and so
the devplane, its stand-in) has moved on from the vendored cut of the OpenAPI, and the NDJSON bodies of the logs
and audit routes."""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]

# operation id -> (checks set aside, why)
SET_ASIDE = {
    "PostRegister": ([status_code_conformance], "the platform answers a registration 201 since this cut (200 here)"),
    "PostNodeIntegrityViolations": ([status_code_conformance],
                                    "the platform answers an integrity report 200 since this cut (202 here)"),
}


def checks_for(operation_id: str) -> list:
    excluded = SET_ASIDE.get(operation_id, ([], ""))[0]
    return [check for check in CHECKS if check not in excluded]


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: Any, value: Any) -> bytes:
    """One JSON document a line (the OpenAPI's schema for these bodies is the array of the lines)."""
    items = value if isinstance(value, list) else [value]
    return "".join(json.dumps(item) + "\n" for item in items).encode()
