"""The platform contract's side of each control-plane call (docs/platform-dialect.md).

`ControlPlaneClient` hands every call to these functions when it speaks the platform dialect; they take the
same arguments as the spec calls and give back the same types, so nothing above the wire layer knows which
contract is spoken. Where the platform has no such call (drift reports, deregistration, tunnel reports,
artifacts) the function says what happens instead.
"""

from __future__ import annotations

import base64
import binascii
import logging
import uuid
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from plexd import __version__
from plexd.base.errors import WireFormatError
from plexd.base.gojson import format_time, go_marshal
from plexd.controlplane.answers import HeartbeatResponse, SecretResponse, path_escape
from plexd.controlplane.client_errors import BadResponseError, ControlPlaneError, PermanentError
from plexd.controlplane.platform_snapshot import reachability, state_from_snapshot
from plexd.state.model import Peer, RegisterResponse, State, _fields


class ControlPlaneClient(Protocol):
    """What these calls use of `plexd.controlplane.client.ControlPlaneClient` (which hands itself in)."""

    async def _json(self, method: str, path: str, body: JSON = None, *, has_body: bool = False,
                    token: str | None = None, what: str = "") -> JSON: ...

    async def _call(self, method: str, path: str, body: JSON = None, *, has_body: bool = False,
                    token: str | None = None, what: str = "") -> bytes: ...

    async def _exchange(self, method: str, path: str, body: JSON = None, *, has_body: bool = False,
                        token: str | None = None, what: str = "", extra_headers: Mapping[str, str] | None = None,
                        also_ok: Collection[int] = ()) -> tuple[int, Any, bytes]: ...


class RegisterRequest(Protocol):
    confirms: RegisterResponse | None
    project_id: str
    resource_handle: str
    nonce: str
    public_key: str

log = logging.getLogger(__name__)

JSON = Any
# The local NAT verdict → the platform's enum (it has no "none": an unfiltered public address maps like a full cone).
NAT_TYPES = {"none": "full_cone", "full_cone": "full_cone", "restricted": "restricted",
             "port_restricted": "port_restricted", "symmetric": "symmetric"}
# The heartbeat's status blocks are the platform's per-key state reports.
STATUS_REPORTS = {"mesh": "status.mesh", "bridge": "status.bridge", "user_access": "status.user-access",
                  "ingress": "status.ingress", "site_to_site": "status.site-to-site"}


def _node(node_id: str) -> str:
    return f"/v1/nodes/{path_escape(node_id)}"


def _b64_digest(checksum: str) -> str:
    """A SHA-256 as the platform wants it (std base64 of the 32 bytes) from the hex the node computes."""
    try:
        raw = bytes.fromhex(checksum)
    except ValueError:
        raw = b""
    if len(raw) == 32:
        return base64.b64encode(raw).decode("ascii")
    try:
        if len(base64.b64decode(checksum, validate=True)) == 32:
            return checksum
    except (binascii.Error, ValueError):
        pass
    return ""


# -- registration --------------------------------------------------------------------------------------------------

def register_body(request: RegisterRequest, token: str) -> dict[str, JSON]:
    body: dict[str, JSON] = {"project_id": request.project_id, "resource_handle": request.resource_handle,
                             "bootstrap_token": token, "nonce": request.nonce, "public_key": request.public_key}
    return body


def register_answer(doc: JSON) -> RegisterResponse:
    """``{node_id, mesh_ip, signing_public_key, signing_key_id, nsk, peer_snapshot, domain_mesh_cidr}``: the node
    secret is the NSK, the peers are the snapshot's."""
    f = _fields(doc, "register response")
    spec_shaped = {"node_id": f.get("node_id"), "mesh_ip": f.get("mesh_ip"),
                   "signing_public_key": f.get("signing_public_key"), "node_secret_key": f.get("nsk")}
    resp = RegisterResponse.from_wire(spec_shaped)
    from plexd.controlplane.platform_envelope import bearer

    try:
        bearer(resp.node_id, resp.node_secret_key)
    except ValueError as exc:
        raise WireFormatError("nsk" if "nsk" in str(exc) else "node_id", str(exc)) from None
    snapshot = state_from_snapshot({"peers": f.get("peer_snapshot"), "policy": None})
    key_id, cidr = f.get("signing_key_id"), f.get("domain_mesh_cidr")
    for name, value in (("signing_key_id", key_id), ("domain_mesh_cidr", cidr)):
        if not isinstance(value, str) or not value:
            raise WireFormatError(name, "missing from the register response")
    return RegisterResponse(node_id=resp.node_id, mesh_ip=resp.mesh_ip, signing_public_key=resp.signing_public_key,
                            node_secret_key=resp.node_secret_key, peers=snapshot.peers, signing_key_id=key_id,
                            domain_mesh_cidr=cidr)


async def register(client: ControlPlaneClient, request: RegisterRequest, token: str,
                   bearer: str | None = None) -> RegisterResponse:
    what = "registration (POST /v1/register)"
    if not token:
        # The platform has no re-registration with the node secret: the node's own state, pulled with its bearer,
        # confirms the identity (a 401 says the platform no longer knows it: a new token is needed).
        if request.confirms is None:
            raise PermanentError(what, 401, "the platform contract has no re-registration with the node secret")
        await client._call("GET", f"{_node(request.confirms.node_id)}/state", token=bearer,
                           what="identity confirmation (GET state)")
        return request.confirms
    if not request.project_id:
        raise PermanentError(what, 0, "the platform contract needs the project to register in: set "
                                      "registration.project_id (the bootstrap token does not name one)")
    doc = await client._json("POST", "/v1/register", register_body(request, token), has_body=True, token="",
                             what=what)
    if isinstance(doc, dict) and "node_secret_key" in doc and "nsk" not in doc:
        raise PermanentError(what, 200, "the answer is the spec contract's (node_secret_key, no nsk); set "
                                        "api.dialect: spec")
    try:
        return register_answer(doc)
    except WireFormatError as exc:
        raise BadResponseError(what, 201, str(exc)) from None


def project_from_token(token: str) -> str:
    """The project a bootstrap token ``psb_<env>_<project>_<kind>_<random>`` belongs to (the project segment is the
    base32 of the project UUID's 16 bytes), "" when the token is not of that form."""
    parts = token.split("_")
    if len(parts) != 5 or parts[0] != "psb" or parts[3] not in ("node", "bridge"):
        return ""
    segment = parts[2].upper()
    try:
        raw = base64.b32decode(segment + "=" * (-len(segment) % 8))
    except (binascii.Error, ValueError):
        return ""
    return str(uuid.UUID(bytes=raw)) if len(raw) == 16 else ""


def new_nonce() -> str:
    """One per logical registration, the same on each of its retries (the server refuses a nonce seen before)."""
    return str(uuid.uuid4())


# -- heartbeat -----------------------------------------------------------------------------------------------------

def heartbeat_body(spec: Mapping[str, JSON], now: datetime) -> dict[str, JSON]:
    nat = spec.get("nat") or {}
    endpoint = nat.get("public_endpoint") or ""
    summary = {"endpoint": endpoint, "nat_type": NAT_TYPES.get(nat.get("type") or "", "unknown")} if endpoint else {}
    return {"client_now": format_time(now), "binary_checksum": _b64_digest(str(spec.get("binary_checksum") or "")),
            "binary_version": __version__ or "dev", "nat_summary": summary}


async def heartbeat(client: ControlPlaneClient, node_id: str, spec: Mapping[str, JSON],
                    published: dict[str, str]) -> HeartbeatResponse:
    """The beat, then each status block whose value changed since it was last published (`published`: key →
    value sent), as a state report."""
    what = "heartbeat"
    doc = await client._json("POST", f"{_node(node_id)}/heartbeat", heartbeat_body(spec, datetime.now(UTC)),
                             has_body=True, what=what)
    f = _fields(doc, "heartbeat response") if isinstance(doc, dict) else {}
    for key in ("reconcile", "rotate_keys"):
        if f.get(key) is not None and not isinstance(f[key], bool):
            raise BadResponseError(what, 200, f"{key} must be a boolean")
    for block, key in STATUS_REPORTS.items():
        value = spec.get(block)
        if value is None:
            continue
        text = go_marshal(value)
        if published.get(key) != text:
            try:
                await put_report(client, node_id, key, text)
            except ControlPlaneError as exc:  # the beat was taken: its answer counts; this key goes next beat
                log.warning("status report %s not published: %s", key, exc)
                continue
            published[key] = text
    return HeartbeatResponse(reconcile=bool(f.get("reconcile")), rotate_keys=bool(f.get("rotate_keys")))


# -- state ---------------------------------------------------------------------------------------------------------

class Reachability:
    """The platform's view of this node, logged when it changes (a diagnostic: never stored, never diffed)."""

    def __init__(self) -> None:
        self.last = ""

    def note(self, doc: JSON) -> None:
        verdict = reachability(doc)
        if verdict and verdict != self.last:
            log.info("the control plane sees this node as %s", verdict, extra={"reachability": verdict})
            self.last = verdict


def parse_state(doc: JSON) -> State:
    return state_from_snapshot(doc)


# -- reports -------------------------------------------------------------------------------------------------------

async def put_report(client: ControlPlaneClient, node_id: str, key: str, value: str) -> None:
    await client._call("PUT", f"{_node(node_id)}/state/reports/{path_escape(key)}", {"value": value},
                       has_body=True, what=f"state report {key}")


async def sync_reports(client: ControlPlaneClient, node_id: str, entries: Sequence[Mapping[str, JSON]],
                       deleted: Sequence[str]) -> None:
    """One PUT per entry (its payload as compact JSON text), one DELETE per deleted key; a delete of a key the
    control plane does not have is done."""
    for entry in sorted(entries, key=lambda e: str(e.get("key"))):
        await put_report(client, node_id, str(entry.get("key")), go_marshal(entry.get("payload")))
    for key in sorted(deleted):
        try:
            await client._call("DELETE", f"{_node(node_id)}/state/reports/{path_escape(key)}",
                               what=f"state report {key} removal")
        except ControlPlaneError as exc:
            if exc.status != 404:
                raise


# -- capabilities, endpoint, integrity, keys -------------------------------------------------------------------

def capabilities_body(spec: Mapping[str, JSON]) -> dict[str, JSON]:
    """The flat manifest: version, checksum (base64), and the hooks whose digest converts."""
    binary = spec.get("binary") or {}
    body: dict[str, JSON] = {"binary_version": str(binary.get("version") or __version__ or "dev"),
                             "binary_checksum": _b64_digest(str(binary.get("checksum") or ""))}
    hooks = [{"name": h.get("name"), "checksum": _b64_digest(str(h.get("checksum") or ""))}
             for h in spec.get("hooks") or ()]
    hooks = [h for h in hooks if h["checksum"]][:128]
    if hooks:
        body["declared_hooks"] = hooks
    return body


async def put_capabilities(client: ControlPlaneClient, node_id: str, spec: Mapping[str, JSON]) -> None:
    await client._call("PUT", f"{_node(node_id)}/capabilities", capabilities_body(spec), has_body=True,
                       what="capabilities announcement")


async def report_endpoint(client: ControlPlaneClient, node_id: str, public_endpoint: str, nat_type: str) -> None:
    body = {"endpoint": public_endpoint, "nat_type": NAT_TYPES.get(nat_type, "unknown"),
            "reported_at": format_time(datetime.now(UTC))}
    await client._call("PUT", f"{_node(node_id)}/endpoint", body, has_body=True, what="endpoint report")


INTEGRITY_KINDS = {"binary": "binary_checksum", "hook": "hook_checksum"}


async def report_integrity_violation(client: ControlPlaneClient, node_id: str, *, kind: str, path: str,
                                     expected_checksum: str, actual_checksum: str) -> None:
    violation: dict[str, JSON] = {"kind": INTEGRITY_KINDS.get(kind, "hook_checksum"), "detected_by": "startup_scan",
                                  "artifact_id": path}
    observed, expected = _b64_digest(actual_checksum), _b64_digest(expected_checksum)
    if not observed:
        log.warning("integrity violation for %s not reported: its checksum is not a SHA-256", path[:200])
        return
    violation["observed_checksum"] = observed
    if expected:
        violation["expected_checksum"] = expected
    await client._call("POST", f"{_node(node_id)}/integrity-violations", {"violations": [violation]},
                       has_body=True, what="integrity violation report")


ROTATION_DISCARDS = {"keys_rotate_no_pending_rotation", "keys_rotate_public_key_invalid", "keys_rotate_peer_not_found",
                     "malformed_keys_rotate_request", "keys_rotate_body_too_large"}


async def rotate_keys(client: ControlPlaneClient, new_public_key: str) -> list[Peer]:
    """``POST /v1/keys/rotate {new_public_key}`` → a receipt; the peers learn the key from their next state pull,
    so no peers come back. The key already taken (a retry whose first answer was lost) is a success; a refusal
    that retrying cannot change is permanent (the staged key is dropped)."""
    what = "key rotation (POST /v1/keys/rotate)"
    try:
        await client._json("POST", "/v1/keys/rotate", {"new_public_key": new_public_key}, has_body=True, what=what)
    except ControlPlaneError as exc:
        if exc.code == "keys_rotate_public_key_unchanged":
            return []
        if exc.code in ROTATION_DISCARDS and not isinstance(exc, PermanentError):
            raise PermanentError(what, exc.status, exc.message, exc.code) from None
        raise
    return []


# -- secrets -------------------------------------------------------------------------------------------------------

NONCE_BYTES = 12


async def fetch_secret(client: ControlPlaneClient, node_id: str, key: str) -> SecretResponse:
    """The sealed secret, ``nonce(12) ‖ ciphertext ‖ tag(16)`` as octets, in the shape the node API opens."""
    what = f"secret fetch ({key})"
    _, headers, data = await client._exchange("GET", f"{_node(node_id)}/secrets/{path_escape(key)}", what=what)
    if len(data) < NONCE_BYTES + 16:
        raise BadResponseError(what, 200, f"the sealed secret is {len(data)} bytes, shorter than a nonce and a tag")
    version = headers.get("X-Plexsphere-Secret-Version", "0").strip()
    return SecretResponse(key=key, ciphertext=base64.b64encode(data[NONCE_BYTES:]).decode("ascii"),
                          nonce=base64.b64encode(data[:NONCE_BYTES]).decode("ascii"),
                          version=int(version) if version.isdigit() and len(version) < 19 else 0)


# -- telemetry -----------------------------------------------------------------------------------------------------

async def ingest(client: ControlPlaneClient, node_id: str, stream: str, batch: Any) -> None:
    """One batch of metrics (a JSON array of samples) or logs/audit (NDJSON) in the platform's shapes; a batch with
    nothing the platform can take is not sent."""
    from plexd.controlplane import platform_telemetry as shapes

    if stream == "metrics":
        # A tunnel point is 4 samples here: a batch the queue kept under 1 MiB can be twice that
        for body in split_bodies([go_marshal(x).encode() for x in shapes.metric_samples(batch)], b"[", b",", b"]"):
            await client._exchange("POST", f"{_node(node_id)}/metrics", body, has_body=True, what="metrics batch",
                                   extra_headers={"X-Plexsphere-Sent-At": format_time(datetime.now(UTC))})
        return
    lines = shapes.log_lines(batch) if stream == "logs" else shapes.audit_events(batch)
    for body in split_bodies([shapes.ndjson([line]) for line in lines], b"", b"", b""):
        await client._exchange("POST", f"{_node(node_id)}/{stream}", body, has_body=True, what=f"{stream} batch",
                               extra_headers={"X-Plexsphere-Sent-At": format_time(datetime.now(UTC)),
                                              "Content-Type": "application/x-ndjson"})


INGEST_MAX_BODY = 1 << 20  # the platform's ingest answers 413 past 1 MiB (decompressed): "split" [contract]


def split_bodies(items: Sequence[bytes], head: bytes, sep: bytes, tail: bytes,
                 limit: int = INGEST_MAX_BODY) -> list[bytes]:
    """`items` joined into as few bodies as fit `limit` each (an item larger than that alone is a body of its
    own, for the platform to refuse). A retry after a later body failed sends the earlier ones again: the ingest
    takes samples and lines, not a ledger."""
    bodies: list[bytes] = []
    chunk: list[bytes] = []
    size = len(head) + len(tail)
    for item in items:
        grown = size + len(item) + (len(sep) if chunk else 0)
        if chunk and grown > limit:
            bodies.append(head + sep.join(chunk) + tail)
            chunk, grown = [], len(head) + len(tail) + len(item)
        chunk.append(item)
        size = grown
    if chunk:
        bodies.append(head + sep.join(chunk) + tail)
    return bodies
