"""schemathesis against a real `plexd-devplane serve --dialect platform`, driven by the platform's OpenAPI (the
node-facing part vendored in platform/openapi-node.yaml): for every node-facing operation, generated requests
with a registered node's bearer envelope and its id in the path; the devplane must never answer 5xx, and what it
answers must be a status, media type, headers and body the OpenAPI documents for the operation.

Bounded: MAX_EXAMPLES per operation (positive and negative), one devplane for the module. Where the devplane
answers what the platform answers now rather than what this cut of the OpenAPI says, that check is set aside for
that operation alone, with the reason (devplane_checks.SET_ASIDE).
"""

from __future__ import annotations

import os

import schemathesis
from devplane_checks import checks_for
from hypothesis import HealthCheck, settings
from openapi_contract import OPENAPI

MAX_EXAMPLES = int(os.environ.get("PLEXD_CONFORMANCE_EXAMPLES", "8"))

schema = schemathesis.openapi.from_path(OPENAPI).exclude(
    # An open event stream never ends, and schemathesis reads an answer whole; tests/devplane/test_platform_events.py
    # and the conformance documents cover the stream.
    operation_id="GetNodeEvents",
)


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_devplane_answers_as_the_openapi_says(case, platform_devplane) -> None:
    node = platform_devplane.node
    if "id" in (case.path_parameters or {}):
        case.path_parameters["id"] = node.id
    case.call_and_validate(base_url=platform_devplane.url, headers=node.headers,
                           checks=checks_for(case.operation.definition.raw["operationId"]))
