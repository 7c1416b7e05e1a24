"""Helpers for tests/security: the daemon's local API as `plexd up` builds it, and plain clients for it."""

from __future__ import annotations

import http.client
import json
import socket

from plexd.desired import DesiredState
from plexd.model import DataEntry, SecretRef
from plexd.node.local_api import LocalAPI
from plexd.nodeapi.reports import ReportStore

TCP_TOKEN = "tcp-token-5f1c0e9a"


class Served:
    """A started node API: its socket, TCP address, report store and base directory."""

    def __init__(self, api: LocalAPI, base: str, reports: ReportStore) -> None:
        self.api, self.base, self.reports = api, base, reports

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        return unix_call(self.api.socket_path, method, path, body, headers)


def unix_call(sock_path: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
              timeout: float = 30):
    conn = http.client.HTTPConnection("localhost", timeout=timeout)
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock_path)
    conn.sock = s
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data) if data else None
    except ValueError:
        return resp.status, data.decode()


def model() -> DesiredState:
    state = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, private_key="",
                                 mesh_ip="10.100.0.9")
    state = state.with_node_state({"env": "prod"}, [DataEntry("db", "application/json", {"host": "db"}, 1,
                                                              "2025-01-15T10:30:00Z")])
    return state.with_secret_refs([SecretRef("tls-key", 1), SecretRef("db-password", 4)])
