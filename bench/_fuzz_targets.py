"""Fuzz targets: every parser of outside input, each with a hypothesis strategy and the property it must keep.

Shared by the test suite (tests/unit/test_fuzz_parsers.py, a few hundred cases each) and the long run
(`python -m bench fuzz_parsers`, 100,000 cases each). The property is the same everywhere: any input gives a
value or the project's own error type (WireFormatError, ConfigError, ...), never another exception, and what
is accepted stays within its bounds.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from hypothesis import strategies as st

from plexd.base import boundedjson
from plexd.base.errors import PlexdError, WireFormatError
from plexd.controlplane.client import RETRY_AFTER_CAP, _error_message, parse_retry_after
from plexd.controlplane.envelope import parse_envelope
from plexd.controlplane.sse import read_events, valid_event_id
from plexd.node.metrics import bearer_matches
from plexd.state.desired import DesiredState, split_endpoint
from plexd.state.model import Peer, RegisterResponse, State
from plexd.telemetry.auditd import AuditFormatError, audit_entry, local_action_entry, parse_record
from plexd.telemetry.logs import SEVERITIES, journal_entry
from plexd.telemetry.tail import MAX_LINE, TRUNCATED

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
_KEY = "x" * 43 + "="

# JSON-ish values, with the characters that break parsers: control characters, lone surrogates, big numbers.
_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                     st.floats(allow_nan=False, allow_infinity=False), _text)
json_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(_text, inner, max_size=5)), max_leaves=20)
_peer_keys = st.sampled_from(["id", "public_key", "mesh_ip", "endpoint", "allowed_ips", "psk", "ID", "Endpoint"])
peer_like = st.dictionaries(_peer_keys, st.one_of(json_values, st.lists(_text, max_size=3),
                                                 st.sampled_from(["10.100.0.2", "10.0.0.0/8", "0.0.0.0/0",
                                                                  "[::1]:51820", "1.2.3.4:51820", _KEY]))
                            , max_size=7)
json_texts = st.one_of(json_values.map(lambda v: json.dumps(v, ensure_ascii=False)), st.text(max_size=200),
                       st.sampled_from(["NaN", "[Infinity]", "1e999", "[" * 100 + "]" * 100, '{"a":"\\ud800"}',
                                        '{"a":' * 100_000 + "1" + "}" * 100_000, '"[[[' + "[" * 200 + '"']))


@dataclass(frozen=True)
class Target:
    name: str
    strategy: st.SearchStrategy[Any]
    check: Callable[[Any], None]  # raises AssertionError when the property is broken


def _only(errors: tuple[type[BaseException], ...], fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except errors:
        return None


def check_json(text: str) -> None:
    _only((WireFormatError,), lambda: boundedjson.loads(text, "doc"))


def check_json_parse(text: str) -> None:
    """The json.loads-shaped entry: every refusal, excessive nesting included, is a ValueError."""
    _only((ValueError,), lambda: boundedjson.parse(text))


def check_error_message(text: str) -> None:
    assert isinstance(_error_message(text.encode("utf-8", "surrogatepass")), str)


def check_metrics_auth(head: bytes) -> None:
    """Any request head: a bool, and True only when it carries exactly the token."""
    if bearer_matches(head, b"tok"):
        assert b"tok" in head


def check_envelope(text: str) -> None:
    env = _only((WireFormatError,), lambda: parse_envelope(text))
    if env is not None:
        assert valid_event_id(env.event_id)
        if env.issued_at:  # the verifier refuses a missing issued_at before it builds the signed bytes
            env.canonical_bytes()  # which must always encode
        _only((WireFormatError,), env.payload)


def check_sse(chunks: list[bytes]) -> None:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def read() -> None:
        async for event in read_events(source(), max_event_bytes=4096):
            assert event.oversize or len(event.data.encode("utf-8", "surrogatepass")) <= 4096 * 4
            assert event.retry is None or 0 <= event.retry < 10**10

    asyncio.run(read())


def check_retry_after(value: str) -> None:
    got = parse_retry_after(value, NOW)
    assert got is None or 0.0 <= got <= RETRY_AFTER_CAP


def check_peer(obj: Any) -> None:
    peer = _only((WireFormatError,), lambda: Peer.from_wire(obj, "peer"))
    if peer is not None:
        d = _MODEL.with_peer(peer)  # the model refuses what it cannot use, it never raises
        for p in d.peers.values():
            split_endpoint(p.endpoint) if p.endpoint else None
            p.public_key.encode("ascii")


def check_state(obj: Any) -> None:
    state = _only((WireFormatError,), lambda: State.from_wire(obj, "state"))
    if state is not None:
        _MODEL.with_state(state)


def check_register(obj: Any) -> None:
    _only((WireFormatError,), lambda: RegisterResponse.from_wire(obj))


def check_endpoint(text: str) -> None:
    _only((ValueError,), lambda: split_endpoint(text))


def check_config(text: str) -> None:
    from plexd.config import settings as config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        _only((PlexdError,), lambda: config.load(f.name, env={}))
    finally:
        os.unlink(f.name)


def _model() -> DesiredState:
    import base64

    return DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, mesh_ip="10.100.0.1",
                                private_key=base64.b64encode(bytes(range(32))).decode())


_MODEL = _model()
_yaml_texts = st.one_of(
    st.text(max_size=200),
    st.dictionaries(st.sampled_from(["api", "mesh", "data_dir", "log_level", "reconcile", "node_api", "x"]),
                    json_values, max_size=4).map(lambda d: json.dumps(d)),
    st.sampled_from(["mesh: {listen_port: 99999999999999999999}", "reconcile: {interval: 1e999h}",
                     "mesh: [1, 2]", "!!python/object:os.system {}", "a: &a [*a]", "{" * 200]),
)

_TXID = bytes(range(12))


def _stun_like(body: bytes, msg_type: int, cookie: bool, txid: bool, fix_length: bool) -> bytes:
    """A STUN header that passes the cheap checks more often than random bytes would, then fuzzed attributes."""
    length = len(body) if fix_length else len(body) // 2
    head = msg_type.to_bytes(2, "big") + (length & 0xFFFF).to_bytes(2, "big")
    head += (0x2112A442 if cookie else 0x21120000).to_bytes(4, "big") + (_TXID if txid else bytes(12))
    return head + body


def check_stun(data: bytes) -> None:
    from plexd.nat.stun import StunError, parse_binding_response

    mapped = _only((StunError,), lambda: parse_binding_response(data, _TXID))
    if mapped is not None:
        assert 0 < mapped.port < 65536 and mapped.ip.count(".") == 3


def check_stun_server(text: str) -> None:
    from plexd.nat.servers import parse_server

    server = _only((ValueError,), lambda: parse_server(text))
    if server is not None:
        assert 0 < server.port < 65536 and server.host and ":" not in server.host


def check_report_file(obj: Any) -> None:
    """A report entry file read back at start (someone may have edited it): an entry with a usable key, or
    ValueError (the file is skipped with a warning)."""
    from plexd.nodeapi.keys import report_key_problem
    from plexd.nodeapi.reports import entry_from_file

    entry = _only((ValueError,), lambda: entry_from_file(obj))
    if entry is not None:
        assert not report_key_problem(entry.key) and entry.version >= 1 and entry.content_type


def check_node_api_key(segment: str) -> None:
    """A URL path segment naming a report key: a key that stays inside its directory, or the 400's reason."""
    from plexd.nodeapi.keys import BadKey, file_name, path_key, report_key_problem

    key = _only((BadKey,), lambda: path_key(segment))
    if key is not None and not report_key_problem(key):
        name = file_name(key)
        assert "/" not in name and "\\" not in name and not name.startswith(".") and len(name.encode()) <= 255


def check_action_request(obj: Any) -> None:
    """An action_request payload: a request whose every field is bounded and whose parameters are strings that
    fit in a hook's environment, or one of the two refusals (acked invalid_request, or unackable)."""
    from plexd.actions.request import (
        MAX_PARAMETER_BYTES,
        InvalidRequest,
        MissingExecutionId,
        env_name,
        hook_environment,
        name_problem,
        parse_request,
    )

    request = _only((InvalidRequest, MissingExecutionId), lambda: parse_request(obj))
    if request is not None:
        assert request.execution_id and not name_problem(request.action)
        assert all(isinstance(v, str) and len(v.encode()) <= MAX_PARAMETER_BYTES for v in request.parameters.values())
        env = hook_environment("n_1", request)
        assert all(env[env_name(k)] == v for k, v in request.parameters.items())
        assert request.timeout is None or request.timeout > 0


def check_hook_sidecar(text: str) -> None:
    """A hook's sidecar file: its fields, or a warning and none of them; never an exception."""
    from pathlib import Path

    from plexd.trust.integrity import _read_sidecar

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "hook.json")
        path.write_bytes(text.encode("utf-8", "surrogatepass"))  # lone surrogates: bytes that are not UTF-8
        fields, warning = _read_sidecar(path)
    assert (warning == "") == bool(fields)  # all of it, or a warning and nothing
    for p in fields.get("parameters") or ():
        assert isinstance(p["name"], str) and p["name"]


_action_keys = st.sampled_from(["execution_id", "EXECUTION_ID", "action", "parameters", "timeout", "checksum",
                                "triggered_by"])

_stun_attrs = st.lists(st.tuples(st.sampled_from([0x0001, 0x0020, 0x0009, 0x8022, 0xFFFF]),
                                 st.binary(max_size=24)), max_size=5).map(
    lambda attrs: b"".join(t.to_bytes(2, "big") + len(v).to_bytes(2, "big") + v + b"\0" * (-len(v) % 4)
                           for t, v in attrs))

def check_audit_record(text: str) -> None:
    try:
        record = parse_record(text)
    except AuditFormatError:
        return
    entry = audit_entry([record], "h")
    assert isinstance(json.loads(entry["object"]), str) and entry["result"] in ("success", "failure")
    assert len(entry["raw"].encode()) <= MAX_LINE + len(TRUNCATED) + 3


def check_journal_entry(doc: Any) -> None:
    entry = journal_entry(doc, "h")
    assert entry["severity"] in SEVERITIES and isinstance(entry["message"], str)
    assert len(entry["message"].encode("utf-8", "surrogatepass")) <= 3 * MAX_LINE + len(TRUNCATED)
    json.dumps(entry)


def check_local_action(text: str) -> None:
    entry = local_action_entry(text, "h")
    assert entry is None or (entry["result"] in ("success", "failure") and isinstance(entry["subject"], dict))


_journal_keys = st.sampled_from(["MESSAGE", "PRIORITY", "__REALTIME_TIMESTAMP", "_SYSTEMD_UNIT", "SYSLOG_IDENTIFIER",
                                 "_HOSTNAME", "__CURSOR", "_COMM"])
_audit_lines = st.one_of(st.text(max_size=300), st.from_regex(
    r"(node=\S+ )?type=[A-Z_]{1,12} msg=audit\([0-9]{1,14}\.[0-9]{1,7}:[0-9]{1,22}\): [ -~\x1d]{0,200}",
    fullmatch=True))

TARGETS = [
    Target("audit_record", _audit_lines, check_audit_record),
    Target("journal_entry", st.dictionaries(_journal_keys, st.one_of(
        json_values, st.lists(st.integers(-5, 300), max_size=20), st.integers(-(2**70), 2**70).map(str))),
        check_journal_entry),
    Target("local_action", st.one_of(json_texts, st.dictionaries(st.sampled_from(
        ["time", "event", "action", "uid", "gid", "pid", "status"]), json_values).map(json.dumps)),
        check_local_action),
    Target("action_request", st.one_of(json_values, st.dictionaries(_action_keys, st.one_of(
        json_values, st.dictionaries(_text, json_values, max_size=4), st.sampled_from(
            ["30s", "-1s", "0", "1h", "x", "../x", "a/b", "ok.sh", "exec_1", "\x00"])), max_size=7)),
        check_action_request),
    Target("hook_sidecar", st.one_of(json_texts, st.dictionaries(st.sampled_from(
        ["description", "timeout", "sandbox", "parameters"]), st.one_of(json_values, st.lists(st.dictionaries(
            st.sampled_from(["name", "type", "required", "description"]), json_values), max_size=3))).map(
        lambda d: json.dumps(d))), check_hook_sidecar),
    Target("json", json_texts, check_json),
    Target("json_parse", json_texts, check_json_parse),
    Target("metrics_auth", st.one_of(st.binary(max_size=300), st.lists(st.sampled_from(
        [b"GET /metrics HTTP/1.1", b"Authorization: Bearer tok", b"authorization:bearer tok",
         b"Authorization: Basic tok", b"Authorization: Bearer tok2",
         b"Authorization:", b":", b"\x00", b"Authorization: Bearer  tok "]),
        max_size=5).map(b"\r\n".join)), check_metrics_auth),
    Target("error_message", st.one_of(json_texts, st.dictionaries(st.sampled_from(["error", "message"]),
                                                                  json_values).map(json.dumps)), check_error_message),
    Target("envelope", st.one_of(json_texts, st.builds(
        lambda t, i, p: json.dumps({"event_type": t, "event_id": i, "payload": p, "nonce": i}, ensure_ascii=False),
        _text, _text, json_values)), check_envelope),
    Target("sse", st.lists(st.binary(max_size=300) | st.sampled_from(
        [b"data: x\n\n", b"retry: 99999999999999999999\n", "retry: \u0661\u0662\n".encode(), b"id: a\x00b\n",
         b"\r\n", b":ping\n", b"data:" + b"x" * 5000 + b"\n\n"]), max_size=12), check_sse),
    Target("retry_after", st.one_of(st.text(max_size=60), st.integers(-(2**80), 2**80).map(str),
                                    st.sampled_from(["Fri, 31 Dec 9999 23:59:59 GMT", "9" * 5000])), check_retry_after),
    Target("peer", st.one_of(peer_like, json_values), check_peer),
    Target("state", st.one_of(st.fixed_dictionaries({"peers": st.lists(peer_like, max_size=6)}), json_values),
           check_state),
    Target("register_response", st.one_of(json_values, st.dictionaries(st.sampled_from(
        ["node_id", "mesh_ip", "signing_public_key", "node_secret_key", "peers"]), json_values)), check_register),
    Target("endpoint", st.one_of(st.text(max_size=60), st.sampled_from(["[fe80::1%eth0]:1", "[::1%\n]:5", "a:0"])),
           check_endpoint),
    Target("config", _yaml_texts, check_config),
    Target("stun_response", st.one_of(st.binary(max_size=200), st.builds(
        _stun_like, _stun_attrs, st.sampled_from([0x0101, 0x0111, 0x0001, 0xC101]), st.booleans(), st.booleans(),
        st.booleans())), check_stun),
    Target("stun_server", st.one_of(st.text(max_size=40), st.sampled_from(
        ["stun.example:3478", "[::1]:3478", "1.2.3.4:0", "h:99999", "h:", ":3478", "a b:1"])), check_stun_server),
    Target("report_file", st.one_of(json_values, st.dictionaries(st.sampled_from(
        ["key", "content_type", "payload", "version", "updated_at"]), json_values)), check_report_file),
    Target("node_api_key", st.one_of(st.text(max_size=300), st.sampled_from(
        ["%2F", "%2e%2e", "%00", "%ff%fe", "a%5Cb", "%", "%zz", "x" * 256])), check_node_api_key),
]
