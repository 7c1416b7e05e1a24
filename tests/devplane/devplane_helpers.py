"""Helpers for the devplane tests: registering nodes over HTTP and reading real event streams.

Everything goes over real HTTP on loopback. `SSEReader` reads a real event stream in a thread and parses it
with its own minimal SSE parser (not the agent's), so these tests do not depend on the code they serve.
"""

from __future__ import annotations

import base64
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from plexd.devplane.harness import Devplane


def new_public_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


@dataclass
class RegisteredNode:
    url: str
    id: str
    secret: str
    mesh_ip: str
    public_key: str
    hostname: str
    response: dict[str, Any]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    def path(self, suffix: str) -> str:
        return f"{self.url}/v1/nodes/{self.id}/{suffix}"

    def get(self, suffix: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.path(suffix), headers=self.headers, timeout=10, **kw)

    def post(self, suffix: str, body: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(self.path(suffix), headers=self.headers, json=body, timeout=10, **kw)

    def put(self, suffix: str, body: Any = None, **kw: Any) -> httpx.Response:
        return httpx.put(self.path(suffix), headers=self.headers, json=body, timeout=10, **kw)


_counter = iter(range(1, 1_000_000))


def register(dp: Devplane, hostname: str | None = None, public_key: str | None = None) -> RegisteredNode:
    token = dp.admin.create_token()
    hostname = hostname or f"host-{next(_counter)}-{os.getpid()}"
    public_key = public_key or new_public_key()
    resp = httpx.post(f"{dp.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                      json={"token": token, "public_key": public_key, "hostname": hostname}, timeout=10)
    assert resp.status_code == 201, resp.text
    body = resp.json()
    return RegisteredNode(dp.url, body["node_id"], body["node_secret_key"], body["mesh_ip"], public_key, hostname,
                          body)


@dataclass
class SSEEvent:
    id: str | None
    event: str | None
    data: str


@dataclass
class SSEReader:
    """Reads `GET /events` in a thread; `.events` fills as blocks arrive, `.comments` counts keepalives."""

    node: RegisteredNode
    last_event_id: str | None = None
    events: queue.Queue[SSEEvent] = field(default_factory=queue.Queue)
    comments: list[tuple[float, str]] = field(default_factory=list)
    status: int | None = None
    closed: threading.Event = field(default_factory=threading.Event)
    connected: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._stop = False
        self._client = httpx.Client(timeout=httpx.Timeout(10, read=30))
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SSEReader:
        self._thread.start()
        assert self.connected.wait(10), "stream did not connect"
        return self

    def _run(self) -> None:
        headers = dict(self.node.headers, Accept="text/event-stream")
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        try:
            with self._client.stream("GET", self.node.path("events"), headers=headers) as resp:
                self.status = resp.status_code
                self.connected.set()
                if resp.status_code != 200:
                    resp.read()
                    self.body = resp.text
                    return
                block: dict[str, list[str]] = {}
                for line in resp.iter_lines():
                    if self._stop:
                        return
                    if line == "":
                        if "data" in block:
                            self.events.put(SSEEvent((block.get("id") or [None])[-1],
                                                     (block.get("event") or [None])[-1], "\n".join(block["data"])))
                        block = {}
                    elif line.startswith(":"):
                        self.comments.append((time.monotonic(), line))
                    else:
                        name, _, value = line.partition(":")
                        block.setdefault(name, []).append(value[1:] if value.startswith(" ") else value)
        except httpx.HTTPError:
            pass
        finally:
            self.connected.set()
            self.closed.set()

    def next(self, timeout: float = 5.0) -> SSEEvent:
        return self.events.get(timeout=timeout)

    def take(self, n: int, timeout: float = 5.0) -> list[SSEEvent]:
        return [self.next(timeout) for _ in range(n)]

    def wait_for(self, event_type: str, timeout: float = 5.0) -> SSEEvent:
        deadline = time.monotonic() + timeout
        while True:
            ev = self.next(max(0.01, deadline - time.monotonic()))
            if ev.event == event_type:
                return ev

    def drain(self, settle: float = 0.3) -> list[SSEEvent]:
        out = []
        while True:
            try:
                out.append(self.events.get(timeout=settle))
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop = True
        self._client.close()
        self._thread.join(0.5)  # a silent stream blocks in read; the daemon thread ends with the server


def wait_streams(dp: Devplane, node_id: str, count: int = 1, timeout: float = 5.0) -> None:
    """Wait until the server has `count` open streams for a node (so a published event goes live, not replay)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dp.admin.node(node_id)["streams"] == count:
            return
        time.sleep(0.02)
    raise AssertionError(f"node {node_id} never had {count} open streams")




def addressed(payload: Any, node_id: str) -> Any:
    """An event payload without the devplane's binding to the nodes it addressed, after checking that the
    binding names `node_id` (plexd.devplane.events: `target_node_ids`, inside the signature)."""
    assert isinstance(payload, dict), payload
    targets = payload.pop("target_node_ids")
    assert node_id in targets, (node_id, targets)
    return payload
