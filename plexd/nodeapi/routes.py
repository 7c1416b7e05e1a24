"""The §8.2 endpoints, on the daemon's socket and (when enabled) the TCP listener.

    GET    /v1/state                     summary: metadata, data keys, secret keys (secrets group only), report keys
    GET    /v1/state/metadata[/{key}]
    GET    /v1/state/data[/{key}]
    GET    /v1/state/secrets[/{key}]     uid 0 or a member of node_api.secrets_group (socket); the token (TCP)
    GET    /v1/state/report[/{key}]
    PUT    /v1/state/report/{key}        {"content_type", "payload"}; If-Match: <version> → 200 entry; 507 store
                                         full, 413 entry too large (ReportStore's caps)
    DELETE /v1/state/report/{key}        → 204

Metadata, data and the secret index are read from the desired model, which the reconciler and the
`node_state_updated` / `node_secrets_updated` events keep current (the cache files are its copy on disk). Secret
values are fetched from the control plane for each request and decrypted in memory: never cached, never logged.
Errors are `{"error": "..."}` with the Go agent's messages, followed by what exactly was wrong.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from plexd.base.errors import PlexdError
from plexd.controlplane.client_errors import ControlPlaneError
from plexd.nodeapi import crypto
from plexd.nodeapi.keys import BadKey, path_key, report_key_problem
from plexd.nodeapi.local_api import LocalAPI, LocalAPIError, Request, Response
from plexd.nodeapi.reports import EntryTooLarge, ReportStore, StoreFull, StoreUnwritable, VersionConflict

if TYPE_CHECKING:
    from plexd.controlplane.client import SecretResponse
    from plexd.state.desired import DesiredState

log = logging.getLogger(__name__)

PREFIX = "/v1/state"
SECRETS_GROUP = "plexd-secrets"


@dataclass
class NodeApi:
    """What the routes serve from."""

    desired: Callable[[], DesiredState]
    reports: ReportStore
    fetch_secret: Callable[[str], Awaitable[SecretResponse]]
    node_secret: Callable[[], str]
    secrets_group: str = SECRETS_GROUP
    node_secret_kdf: Callable[[], str] = lambda: ""  # plexd.identity.node_secret: how the secrets' key is derived


def secret_access(group: str) -> Callable[[Request], str | None]:
    """Secrets on the socket: uid 0, or the group as primary or supplementary group of the calling process."""

    def check(req: Request) -> str | None:
        if req.via == "tcp":  # the bearer token was checked: it grants secrets too (§8.1)
            return None
        cred = req.cred
        if cred is not None and (cred.uid == 0 or cred.in_group(group)):
            return None
        return "forbidden: insufficient privileges for secret access"

    return check


def add_node_api_routes(api: LocalAPI, node: NodeApi) -> None:
    routes = NodeApiRoutes(node)
    access = routes.access
    for method, path, handler, gated in (
        ("GET", PREFIX, routes.summary, False),
        ("GET", PREFIX + "/metadata", routes.metadata, False),
        ("GET", PREFIX + "/metadata/", routes.metadata_key, False),
        ("GET", PREFIX + "/data", routes.data, False),
        ("GET", PREFIX + "/data/", routes.data_key, False),
        ("GET", PREFIX + "/secrets", routes.secrets, True),
        ("GET", PREFIX + "/secrets/", routes.secret_key, True),
        ("GET", PREFIX + "/report", routes.reports, False),
        ("GET", PREFIX + "/report/", routes.report_get, False),
        ("PUT", PREFIX + "/report/", routes.report_put, False),
        ("DELETE", PREFIX + "/report/", routes.report_delete, False),
    ):
        api.add(method, path, handler, tcp=True, **({"authorize": access} if gated else {}))


class NodeApiRoutes:
    """The node API's handlers (§8): metadata, data, secrets (gated by the secrets group) and reports."""

    def __init__(self, node: NodeApi) -> None:
        self.node = node
        self.access = secret_access(node.secrets_group)
        self._refused_logged = -60.0

    async def summary(self, req: Request) -> Response:
        d = self.node.desired()
        # The secret index is secret too (§8.1 gates the list): callers outside the secrets group get none of it.
        # An empty list, not a missing key, keeps the Go agent's shape for clients that expect the field.
        secret_keys = [r.to_wire() for r in d.secret_refs] if self.access(req) is None else []
        return Response(200, {
            "metadata": d.metadata,
            "data_keys": [{"key": e.key, "version": e.version, "content_type": e.content_type} for e in d.data],
            "secret_keys": secret_keys,
            "report_keys": self.node.reports.index(),
        })

    async def metadata(self, req: Request) -> Response:
        return Response(200, self.node.desired().metadata)

    async def metadata_key(self, req: Request) -> Response:
        key = _key(req, "/metadata/")
        meta = self.node.desired().metadata or {}
        if key not in meta:
            raise LocalAPIError(404, "not found")
        return Response(200, {"key": key, "value": meta[key]})

    async def data(self, req: Request) -> Response:
        return Response(200, [{"key": e.key, "version": e.version, "content_type": e.content_type}
                              for e in self.node.desired().data])

    async def data_key(self, req: Request) -> Response:
        key = _key(req, "/data/")
        entry = next((e for e in reversed(self.node.desired().data) if e.key == key), None)
        if entry is None:
            raise LocalAPIError(404, "not found")
        return Response(200, entry.to_wire())

    async def secrets(self, req: Request) -> Response:
        return Response(200, [r.to_wire() for r in self.node.desired().secret_refs])

    async def secret_key(self, req: Request) -> Response:
        key = _key(req, "/secrets/")
        try:
            sealed = await self.node.fetch_secret(key)
        except ControlPlaneError as exc:
            if exc.status == 404:
                raise LocalAPIError(404, "not found") from None
            log.warning("secret %r not served: %s", key[:100], exc)
            raise LocalAPIError(503, "control plane unavailable") from None
        except PlexdError as exc:
            log.warning("secret %r not served: %s", key[:100], exc)
            raise LocalAPIError(503, "control plane unavailable") from None
        try:
            value = crypto.decrypt(sealed.ciphertext, sealed.nonce, self.node.node_secret(),
                                   self.node.node_secret_kdf())
        except crypto.SecretDecryptError:
            log.error("secret %r: the control plane's answer cannot be decrypted with this node's key", key[:100])
            raise LocalAPIError(500, "internal error") from None
        return Response(200, {"key": sealed.key, "value": value, "version": sealed.version})

    async def reports(self, req: Request) -> Response:
        return Response(200, self.node.reports.index())

    async def report_get(self, req: Request) -> Response:
        entry = self.node.reports.get(_report_key(req))
        if entry is None:
            raise LocalAPIError(404, "not found")
        return Response(200, entry.to_wire())


    async def report_put(self, req: Request) -> Response:
        key = _report_key(req)
        if_match = _if_match(req)
        body = _json_object(req)
        content_type = body.get("content_type")
        if not isinstance(content_type, str) or not content_type:
            raise LocalAPIError(400, "content_type is required")
        if "payload" not in body:
            raise LocalAPIError(400, "payload must be valid JSON: the body has no payload")
        try:
            entry = await self.node.reports.put(key, content_type, body["payload"], if_match)
        except VersionConflict:
            current = self.node.reports.get(key)
            have = f"the entry is at version {current.version}" if current else "the entry does not exist"
            raise LocalAPIError(409, f"version conflict: If-Match {if_match}, {have}") from None
        except EntryTooLarge as exc:
            raise LocalAPIError(413, str(exc)) from None
        except UnicodeEncodeError:  # JSON may escape half a surrogate pair; no file can hold it as text
            raise LocalAPIError(400, "invalid JSON body: a lone surrogate (a \\ud800-\\udfff escape without its "
                                 "pair) is not Unicode text") from None
        except (StoreFull, StoreUnwritable) as exc:
            self._refused(key, exc)
        return Response(200, entry.to_wire())

    def _refused(self, key: str, exc: Exception) -> NoReturn:
        now = time.monotonic()
        if now - self._refused_logged >= 60:  # a workload that keeps trying is one line a minute
            self._refused_logged = now
            log.warning("report %r refused: %s", key[:100], exc)
        raise LocalAPIError(507, str(exc)) from None

    async def report_delete(self, req: Request) -> Response:
        key = _report_key(req)
        try:
            if not await self.node.reports.delete(key):
                raise LocalAPIError(404, "not found")
        except StoreUnwritable as exc:
            self._refused(key, exc)
        return Response(204)


def _key(req: Request, under: str) -> str:
    """The key after PREFIX + `under` (one path segment, percent-decoded)."""
    segment = req.path[len(PREFIX + under):]
    if not segment:
        raise LocalAPIError(404, "not found")
    try:
        return path_key(segment)
    except BadKey as exc:
        raise LocalAPIError(400, f"invalid key: {exc}") from None


def _report_key(req: Request) -> str:
    segment = req.path[len(PREFIX + "/report/"):]
    try:
        key = path_key(segment)
    except BadKey as exc:
        raise LocalAPIError(400, f"invalid report key: {exc}") from None
    problem = report_key_problem(key)
    if problem:
        raise LocalAPIError(400, f"invalid report key: {problem}")
    return key


def _if_match(req: Request) -> int | None:
    raw = req.headers.get("if-match")
    if raw is None:
        return None
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        shown = text[:40].encode("ascii", "backslashreplace").decode()
        raise LocalAPIError(400, f"If-Match must be an integer (a bare version such as 3, not {shown!r})")
    return int(text)


def _json_object(req: Request) -> dict[str, Any]:
    from plexd.base import boundedjson

    try:
        body = boundedjson.loads(req.body, "body")
    except PlexdError as exc:
        raise LocalAPIError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise LocalAPIError(400, "invalid JSON body: must be a JSON object")
    return body
