"""Attack: reach the devplane's admin API (/admin/...) without the admin token, or with a wrong one.

The route table is walked, not listed by hand: every route under the admin mount of the REAL app
(plexd.devplane.server.create_app) is called over HTTP on a real `plexd-devplane serve` with no token and with
a wrong one, and must answer 401 and change nothing. The guard is one Mount-level middleware, so a route added
later is covered without a line of its own; the last test proves that by adding one.
"""

from __future__ import annotations

import re

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from plexd.devplane import admin
from plexd.devplane.deployment import Deployment
from plexd.devplane.server import create_app
from plexd.devplane.store import Store

WRONG = {"Authorization": "Bearer not-the-admin-token"}


def _app(tmp_path, token: str = "the-admin-token"):
    store = Store(str(tmp_path / "walk.db"))
    return create_app(Deployment(store), admin_token=token, artifacts_dir=tmp_path / "artifacts"), store


def admin_calls(app) -> list[tuple[str, str]]:
    """(method, concrete path) for every route under the admin mount, path parameters filled in."""
    mounts = [r for r in app.routes if isinstance(r, Mount) and r.path == admin.PREFIX]
    assert len(mounts) == 1, f"the admin API must be exactly one mount at {admin.PREFIX}: {app.routes}"
    calls = []
    for route in mounts[0].routes:
        assert isinstance(route, Route), route
        path = admin.PREFIX + re.sub(r"\{[^}]+\}", "x1", route.path)
        calls += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    # no admin route anywhere else in the table (outside the guarded mount)
    stray = [r.path for r in app.routes if isinstance(r, Route) and r.path.startswith(admin.PREFIX)]
    assert stray == [], f"admin routes outside the guarded mount: {stray}"
    return calls


def test_the_route_table_has_the_admin_routes_under_one_guarded_mount(tmp_path):
    app, store = _app(tmp_path)
    try:
        calls = admin_calls(app)
        assert ("PUT", "/admin/v1/artifacts/x1/x1/x1") in calls and len(calls) >= 20, calls
    finally:
        store.close()


@pytest.mark.parametrize("headers", [{}, WRONG], ids=["no token", "wrong token"])
def test_every_admin_route_refuses_a_caller_without_the_admin_token(devplane, tmp_path, headers):
    app, store = _app(tmp_path)
    store.close()
    accepted = []
    with httpx.Client(base_url=devplane.url, timeout=10) as http:
        for method, path in admin_calls(app):
            resp = http.request(method, path, headers=headers, content=b'{"version": "9.9.9"}')
            if resp.status_code != 401 or "admin token" not in resp.text:
                accepted.append(f"{method} {path} -> {resp.status_code} {resp.text[:120]}")
        # an admin path with no route is refused too (nothing to enumerate without the token)
        resp = http.get("/admin/v1/no-such-route", headers=headers)
        assert resp.status_code == 401, resp.text
    assert accepted == [], "admin routes that did not refuse:\n" + "\n".join(accepted)


def test_an_artifact_upload_without_the_token_stores_nothing(devplane):
    evil = b"import os; open('/tmp/pwned', 'w')\n"
    with httpx.Client(base_url=devplane.url, timeout=10) as http:
        for headers in ({}, WRONG):
            resp = http.put("/admin/v1/artifacts/6.6.6/linux/amd64", content=evil, headers=headers)
            assert resp.status_code == 401, resp.text
    stored = devplane.dir / "devplane.db.artifacts"
    assert not any(stored.rglob("*")) if stored.exists() else True, sorted(stored.rglob("*"))
    # the token holder can still upload (the guard lets the right caller through)
    assert devplane.admin.put_artifact("6.6.7", b"fine", arch="amd64")["size"] == 4


def test_an_admin_route_added_later_is_guarded_without_code_of_its_own(tmp_path, monkeypatch):
    # In-process (starlette's TestClient): the added route exists only in this test's copy of the app.
    async def open_door(request: Request) -> JSONResponse:
        return JSONResponse({"door": "open"})

    original = admin.routes
    monkeypatch.setattr(admin, "routes", lambda: [*original(), Route("/v1/new-door", open_door, methods=["GET"])])
    app, store = _app(tmp_path)
    try:
        assert ("GET", "/admin/v1/new-door") in admin_calls(app)
        with TestClient(app) as client:
            assert client.get("/admin/v1/new-door").status_code == 401
            assert client.get("/admin/v1/new-door", headers=WRONG).status_code == 401
            ok = client.get("/admin/v1/new-door", headers={"Authorization": "Bearer the-admin-token"})
            assert ok.status_code == 200 and ok.json() == {"door": "open"}
    finally:
        store.close()
