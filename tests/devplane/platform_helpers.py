"""Helpers for the platform-dialect devplane tests: registering nodes, calling them with their bearer envelope,
and checking problem+json answers. Everything goes over real HTTP to a real `plexd-devplane serve
--dialect platform`."""

from __future__ import annotations

import base64
import os
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from plexd.base import gojson
from plexd.controlplane.platform_envelope import bearer
from plexd.devplane.harness import Devplane


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def digest() -> str:
    """A SHA-256 as the platform wants it: standard base64 of 32 bytes."""
    return base64.b64encode(os.urandom(32)).decode()


@dataclass
class PlatformNode:
    url: str
    id: str
    nsk: str
    mesh_ip: str
    public_key: str
    response: dict[str, Any]

    @property
    def bearer(self) -> str:
        return bearer(self.id, self.nsk)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.bearer}"}

    def path(self, suffix: str) -> str:
        return f"{self.url}/v1/nodes/{self.id}/{suffix}"

    def request(self, method: str, suffix: str, body: Any = None, **kw: Any) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        if body is not None:
            kw["json"] = body
        return httpx.request(method, self.path(suffix), headers=headers, timeout=10, **kw)

    def get(self, suffix: str, **kw: Any) -> httpx.Response:
        return self.request("GET", suffix, **kw)

    def post(self, suffix: str, body: Any = None, **kw: Any) -> httpx.Response:
        return self.request("POST", suffix, body, **kw)

    def put(self, suffix: str, body: Any = None, **kw: Any) -> httpx.Response:
        return self.request("PUT", suffix, body, **kw)

    def delete(self, suffix: str, **kw: Any) -> httpx.Response:
        return self.request("DELETE", suffix, **kw)

    def state(self) -> dict[str, Any]:
        resp = self.get("state")
        assert resp.status_code == 200, resp.text
        return resp.json()

    def heartbeat(self, **fields: Any) -> httpx.Response:
        return self.post("heartbeat", heartbeat_body(**fields))


def heartbeat_body(**fields: Any) -> dict[str, Any]:
    return {"client_now": gojson.now_text(), "binary_checksum": digest(), "binary_version": "1.2.3",
            "nat_summary": {}, **fields}


def register_body(dp: Devplane, **fields: Any) -> dict[str, Any]:
    """A valid registration body with a fresh token, key and nonce (`fields` override)."""
    info = dp.admin.create_token_info()
    return {"project_id": info["project_id"], "resource_handle": f"edge-{uuid.uuid4().hex[:8]}",
            "bootstrap_token": info["token"], "nonce": str(uuid.uuid4()), "public_key": new_key(), **fields}


def register(dp: Devplane, **fields: Any) -> PlatformNode:
    body = register_body(dp, **fields)
    resp = httpx.post(f"{dp.url}/v1/register", json=body, timeout=10)
    assert resp.status_code == 201, resp.text
    doc = resp.json()
    return PlatformNode(dp.url, doc["node_id"], doc["nsk"], doc["mesh_ip"], body["public_key"], doc)


def assert_problem(resp: httpx.Response, status: int, code: str | None) -> dict[str, Any]:
    """A problem+json answer with `status` and `code` (None: the contract gives this error no code)."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/problem+json"), resp.headers
    doc = resp.json()
    expected = {"type", "title", "status", "detail", "instance", "correlation_id"} | ({"code"} if code else set())
    assert set(doc) == expected, doc
    assert doc["status"] == status and doc["title"] and doc["detail"]
    assert doc["instance"] == resp.request.url.path
    assert resp.headers["x-correlation-id"] == doc["correlation_id"]
    if code:
        assert doc["code"] == code, doc
        assert doc["type"] == f"https://api.plexsphere.com/problems/{code}"
    else:
        assert doc["type"] == "about:blank", doc
    return doc
