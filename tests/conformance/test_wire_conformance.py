"""The real client, in each dialect, against the recorded wire documents (tests/conformance/<dialect>/*.json).

A recording server on loopback (tests/integration/agentcore_recorder.py, real sockets) answers every request with
the example answer of the document whose method and path it matches, and keeps what plexd sent. Each scenario
drives the client as the daemon does; then every request it sent is checked against its document (and, in the
platform dialect, its body against the platform's OpenAPI), and what the call returned against the document's
`result`. A failure names the dialect, the endpoint and the field.
"""

from __future__ import annotations

import json
from typing import Any

import openapi_contract
import platform_scenarios
import pytest
import spec_scenarios
from integration.agentcore_recorder import Recorded, Recorder, Reply
from scenarios import Scenario
from wire_documents import DIALECTS, Captured, WireDocument, check_document_shape, document_for, load, problems

from plexd.controlplane.client import ControlPlaneClient
from plexd.identity.identity_store import Identity

SCENARIOS = {"spec": spec_scenarios.SCENARIOS, "platform": platform_scenarios.SCENARIOS}
REGISTER = {"spec": spec_scenarios.register_bare, "platform": platform_scenarios.register}
BOOTSTRAP_TOKENS = {"spec": spec_scenarios.BOOTSTRAP_TOKEN, "platform": platform_scenarios.BOOTSTRAP_TOKEN}
DOCS = {dialect: load(dialect) for dialect in DIALECTS}


def scenario_params() -> list[Any]:
    out = []
    for dialect, scenarios in SCENARIOS.items():
        for s in scenarios:
            marks = [pytest.mark.xfail(strict=True, reason=s.known_defect)] if s.known_defect else []
            out.append(pytest.param(dialect, s, id=f"{dialect}-{s.id}", marks=marks))
    return out


def answering(docs: dict[str, WireDocument]) -> Any:
    def handler(recorded: Recorded) -> Reply:
        doc = document_for(docs, captured(recorded))
        if doc is None:
            return Reply(404, '{"error":"no recorded document for this request"}')
        return Reply(doc.answer["status"], doc.answer_bytes(), dict(doc.answer.get("headers", {})))

    return handler


def captured(recorded: Recorded) -> Captured:
    return Captured(recorded.method, recorded.path, recorded.headers, recorded.body)


async def registered(client: ControlPlaneClient, dialect: str) -> str:
    """Register as the daemon does and take the bearer its identity gives (the node secret, or the platform's
    nsk_ envelope); answers the node id."""
    answer = await REGISTER[dialect](client, "")
    identity = Identity(node_id=answer.node_id, mesh_ip=answer.mesh_ip, signing_public_key=answer.signing_public_key,
                        node_secret_key=answer.node_secret_key, private_key=bytes(32),
                        node_secret_kdf=answer.node_secret_kdf, dialect=client.dialect,
                        signing_key_id=answer.signing_key_id, domain_mesh_cidr=answer.domain_mesh_cidr)
    client.set_token(identity.bearer)
    return answer.node_id


def lookup(value: Any, path: str) -> Any:
    for part in path.split("."):
        if part == "length":
            value = len(value)
        elif isinstance(value, dict):
            value = value[part]
        elif isinstance(value, list | tuple):
            value = value[int(part)]
        else:
            value = getattr(value, part)
    return value


def normalised(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [normalised(v) for v in value]
    return value


def result_problems(doc: WireDocument, result: Any) -> list[str]:
    out = []
    for path, expected in (doc.doc.get("result") or {}).items():
        try:
            got = normalised(lookup(result, path))
        except (KeyError, IndexError, AttributeError, TypeError) as exc:
            out.append(f"{doc.dialect} {doc.endpoint} answer: {path}: not in what plexd made of it ({exc!r})")
            continue
        if got != expected:
            out.append(f"{doc.dialect} {doc.endpoint} answer: {path}: plexd read {got!r}, the example says "
                       f"{expected!r}")
    return out


def openapi_problems(doc: WireDocument, request: Captured) -> list[str]:
    """The body plexd sent, against the platform OpenAPI's request schema for the document's operation."""
    if doc.request.get("body") is None or not request.body:
        return []
    media_type = request.headers.get("content-type", "").split(";")[0].strip()
    text = request.decoded_body()
    if doc.request.get("body_format") == "ndjson":
        body: Any = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        body = json.loads(text)
    return [f"platform {doc.endpoint} (OpenAPI {doc.doc['operation_id']}): {p}"
            for p in openapi_contract.request_problems(doc.doc["operation_id"], media_type, body)]


@pytest.mark.parametrize(("dialect", "scenario"), scenario_params())
async def test_plexd_sends_what_the_contract_pins(dialect: str, scenario: Scenario) -> None:
    docs = DOCS[dialect]
    async with (Recorder(answering(docs)) as server,
                ControlPlaneClient(server.url, token=BOOTSTRAP_TOKENS[dialect], dialect=dialect) as client):
        node_id = await registered(client, dialect) if scenario.registered else ""
        server.requests.clear()
        result = await scenario.run(client, node_id)
    sent = [captured(r) for r in server.requests]
    found: list[str] = []
    for request in sent:
        doc = document_for(docs, request)
        if doc is None:
            found.append(f"{dialect} {scenario.endpoint or 'nothing'}: plexd sent {request.method} {request.path}, "
                         f"which the {dialect} contract does not have")
            continue
        found += problems(doc, request)
        if dialect == "platform":
            found += openapi_problems(doc, request)
    if scenario.endpoint is None:
        assert not sent, f"{dialect}: {scenario.name} sent {[f'{r.method} {r.path}' for r in sent]}, expected nothing"
    elif not any(docs[scenario.endpoint].matches(r) for r in sent):
        found.append(f"{dialect} {scenario.endpoint}: never called (sent {[f'{r.method} {r.path}' for r in sent]})")
    if scenario.result:
        found += result_problems(docs[scenario.endpoint], result)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_document_is_exercised_and_well_formed(dialect: str) -> None:
    exercised = {s.endpoint for s in SCENARIOS[dialect]}
    missing = sorted(set(DOCS[dialect]) - exercised)
    assert not missing, f"{dialect}: documents no scenario drives: {missing}"
    unknown = sorted(e for e in exercised - set(DOCS[dialect]) if e is not None)
    assert not unknown, f"{dialect}: scenarios for endpoints without a document: {unknown}"
    shape = [p for doc in DOCS[dialect].values() for p in check_document_shape(doc)]
    assert not shape, "\n".join(shape)


def openapi_path(template: str) -> str:
    """The platform names the node {id} and an execution {exec_id}; the documents say {node_id}."""
    return template.replace("{node_id}", "{id}")


@pytest.mark.parametrize("endpoint", sorted(DOCS["platform"]))
def test_platform_documents_agree_with_the_openapi(endpoint: str) -> None:
    """Each platform document names an operation of the OpenAPI with its method and path, and its example answer
    fits the OpenAPI's response schema (the statuses the platform has changed since that cut set aside)."""
    doc = DOCS["platform"][endpoint]
    method, path, _ = openapi_contract.operations()[doc.doc["operation_id"]]
    assert (method, path) == (doc.method, openapi_path(doc.template))
    media_type = doc.answer.get("headers", {}).get("Content-Type", "")
    body = doc.answer.get("json")
    if media_type == "application/json":
        assert not openapi_contract.answer_problems(doc.doc["operation_id"], doc.answer["status"], media_type, body)
    else:  # a stream, the sealed secret, or no body: the status at least is the OpenAPI's
        assert not openapi_contract.answer_problems(doc.doc["operation_id"], doc.answer["status"], media_type, None)
