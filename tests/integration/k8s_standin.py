"""A stand-in for a Kubernetes API server: the one part of the Kubernetes-session tests that cannot run here (no
API server on these machines). Real HTTP (uvicorn) and real WebSocket: it answers the discovery and pod requests
`kubectl get pods` and `kubectl exec` make, speaks the exec stream protocol (`v5.channel.k8s.io`: one channel
byte per message, the status as JSON on channel 3), and records every request's credentials and impersonation
headers so a test can check what the proxy sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

POD = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "web-0", "namespace": "default", "uid": "0f0f", "resourceVersion": "7",
                    "creationTimestamp": "2026-11-24T00:00:00Z"},
       "spec": {"containers": [{"name": "web", "image": "nginx"}]},
       "status": {"phase": "Running",
                  "containerStatuses": [{"name": "web", "ready": True, "restartCount": 0, "image": "nginx",
                                         "imageID": "", "state": {"running": {}}}]}}


@dataclass
class Seen:
    path: str
    authorization: str
    impersonate_user: str
    impersonate_groups: list[str] = field(default_factory=list)


class ApiServerStandIn:
    def __init__(self, node_token: str) -> None:
        self.node_token = node_token
        self.seen: list[Seen] = []
        self.exec_commands: list[list[str]] = []
        http = self._recorded
        routes = [Route("/api", http(self.api_versions)), Route("/apis", http(self.api_groups)),
                  Route("/api/v1", http(self.resources)), Route("/api/v1/namespaces/{ns}/pods", http(self.pods)),
                  Route("/api/v1/namespaces/{ns}/pods/{name}", http(self.pod)),
                  WebSocketRoute("/api/v1/namespaces/{ns}/pods/{name}/exec", self.exec)]
        self.app = Starlette(routes=routes)

    def _record(self, scope_headers, path: str) -> bool:
        headers = [(k.decode().lower(), v.decode()) for k, v in scope_headers]
        get = lambda n: next((v for k, v in headers if k == n), "")  # noqa: E731
        self.seen.append(Seen(path, get("authorization"), get("impersonate-user"),
                              [v for k, v in headers if k == "impersonate-group"]))
        return get("authorization") == f"Bearer {self.node_token}"

    def _recorded(self, handler):
        async def endpoint(request: Request) -> JSONResponse:
            if not self._record(request.scope["headers"], request.url.path):
                return JSONResponse({"kind": "Status", "code": 401}, status_code=401)
            return await handler(request)
        return endpoint

    async def api_versions(self, request: Request) -> JSONResponse:
        return JSONResponse({"kind": "APIVersions", "versions": ["v1"],
                             "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}]})

    async def api_groups(self, request: Request) -> JSONResponse:
        return JSONResponse({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})

    async def resources(self, request: Request) -> JSONResponse:
        return JSONResponse({"kind": "APIResourceList", "groupVersion": "v1", "resources": [
            {"name": "pods", "singularName": "pod", "namespaced": True, "kind": "Pod",
             "verbs": ["get", "list", "watch", "create", "delete"], "shortNames": ["po"]},
            {"name": "pods/exec", "singularName": "", "namespaced": True, "kind": "PodExecOptions",
             "verbs": ["create", "get"]}]})

    async def pods(self, request: Request) -> JSONResponse:
        return JSONResponse({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"},
                             "items": [POD]})

    async def pod(self, request: Request) -> JSONResponse:
        return JSONResponse(POD)

    async def exec(self, ws: WebSocket) -> None:
        if not self._record(ws.scope["headers"], ws.url.path):
            await ws.close(code=1008)
            return
        offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",")]
        proto = next((p for p in ("v5.channel.k8s.io", "v4.channel.k8s.io") if p in offered), None)
        await ws.accept(subprotocol=proto)
        command = ws.query_params.getlist("command")
        self.exec_commands.append(command)
        await ws.send_bytes(b"\x01" + " ".join(command[1:]).encode() + b"\n")  # `echo ...` on stdout
        await ws.send_bytes(b"\x03" + json.dumps({"metadata": {}, "status": "Success"}).encode())
        await ws.close()


@contextlib.asynccontextmanager
async def running(standin: ApiServerStandIn):
    """The stand-in on 127.0.0.1 at a free port; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(standin.app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off", ws="websockets-sansio"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
