"""Run a real `plexd-devplane serve` process for tests and the demo, with a typed admin client.

    with Devplane(tmp_path) as dp:
        token = dp.admin.create_token()
        ...  # point an agent at dp.url
        dp.restart()  # same db, same port

The server is a separate process (`python -m plexd.devplane.devplane_cli serve`), so tests exercise the real thing over
real HTTP, can kill it (SIGKILL) mid-stream, and restart it on the same port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from plexd.base.errors import PlexdError

READY_PREFIX = "plexd-devplane listening on "


class AdminError(PlexdError):
    """The admin API refused a request."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"admin API: {status} {message}")


class AdminClient:
    """Synchronous client of `/admin/v1` (httpx)."""

    def __init__(self, url: str, token: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url + "/admin/v1", headers={"Authorization": f"Bearer {token}"},
                                 timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["json"] = body
        if params:
            kwargs["params"] = params
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise PlexdError(f"devplane at {self.url} unreachable: {exc}") from None
        if resp.status_code >= 300:
            try:
                message = resp.json().get("error", resp.text)
            except ValueError:
                message = resp.text
            raise AdminError(resp.status_code, message)
        return resp.json() if resp.content else None

    # -- deployment ---------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/status")

    def create_token(self, kind: str | None = None, ttl_seconds: float | None = None) -> str:
        """A one-time bootstrap token (`kind` "bridge": a platform-dialect bridge token; `ttl_seconds`: it
        expires)."""
        return self.create_token_info(kind, ttl_seconds)["token"]

    def create_token_info(self, kind: str | None = None, ttl_seconds: float | None = None) -> dict[str, Any]:
        """The whole answer: {token[, project_id, kind (platform dialect)][, expires_at]}."""
        body = {k: v for k, v in (("kind", kind), ("ttl_seconds", ttl_seconds)) if v is not None}
        return self._call("POST", "/tokens", body or None)

    def revoke_token(self, token: str) -> None:
        self._call("DELETE", f"/tokens/{_q(token)}")

    def project_id(self) -> str:
        """The platform dialect's project (what a node puts in registration.project_id)."""
        return self.status()["project_id"]

    def tokens(self) -> list[dict[str, Any]]:
        return self._call("GET", "/tokens")

    def nodes(self, include_removed: bool = False) -> list[dict[str, Any]]:
        return self._call("GET", "/nodes", **({"all": "1"} if include_removed else {}))

    def node(self, node_id: str) -> dict[str, Any]:
        return self._call("GET", f"/nodes/{_q(node_id)}")

    def forget_node(self, node_id: str) -> None:
        self._call("DELETE", f"/nodes/{_q(node_id)}")

    def policies(self) -> list[dict[str, Any]]:
        return self._call("GET", "/policies")

    def set_policies(self, policies: list[Any], *, unchecked: bool = False) -> list[Any]:
        return self._call("PUT", "/policies" + ("?unchecked=1" if unchecked else ""), policies)

    def set_metadata(self, node_id: str, metadata: dict[str, str]) -> dict[str, str]:
        return self._call("PUT", f"/nodes/{_q(node_id)}/metadata", metadata)

    def set_data(self, node_id: str, key: str, content_type: str, payload: Any) -> dict[str, Any]:
        return self._call("PUT", f"/nodes/{_q(node_id)}/data/{_q(key)}",
                          {"content_type": content_type, "payload": payload})

    def set_secret(self, node_id: str, key: str, value: str) -> int:
        return self._call("PUT", f"/nodes/{_q(node_id)}/secrets/{_q(key)}", {"value": value})["version"]

    def set_node_endpoint(self, node_id: str, endpoint: str) -> None:
        self._call("PUT", f"/nodes/{_q(node_id)}/endpoint", {"endpoint": endpoint})

    def set_node_public_key(self, node_id: str, public_key: str) -> None:
        """Change a node's WireGuard key as the control plane (sends `peer_key_rotated` to its peers)."""
        self._call("PUT", f"/nodes/{_q(node_id)}/public-key", {"public_key": public_key})

    def requests(self) -> dict[str, dict[str, int]]:
        """The agent API's requests by node id and route template (`POST /v1/nodes/{node_id}/heartbeat`)."""
        return self._call("GET", "/requests")

    def clear_requests(self) -> None:
        self._call("DELETE", "/requests")

    def request_heartbeat_flags(self, node_id: str, *, reconcile: bool = False, rotate_keys: bool = False) -> None:
        """One-shot flags returned in the node's next heartbeat response."""
        self._call("PUT", f"/nodes/{_q(node_id)}/heartbeat-flags",
                   {"reconcile": reconcile, "rotate_keys": rotate_keys})

    def request_action(self, node_id: str, action: str, parameters: dict[str, Any] | None = None,
                       timeout: str | None = None, checksum: str | None = None,
                       action_type: str | None = None) -> str:
        """An action for the node; in the platform dialect an execution in its state (`action_type` builtin or
        hook, guessed from its declared hooks when not given)."""
        body = {"action": action, "parameters": parameters or {}, "timeout": timeout, "checksum": checksum}
        if action_type:
            body["type"] = action_type
        return self._call("POST", f"/nodes/{_q(node_id)}/actions", body)["execution_id"]

    def request_key_rotation(self, node_id: str) -> None:
        """Ask the node for a new mesh key (the platform dialect keeps asking, and sends `rotate_keys`)."""
        self._call("POST", f"/nodes/{_q(node_id)}/keys/rotate", {})

    def put_artifact(self, version: str, data: bytes, *, os_name: str = "linux", arch: str | None = None,
                     signature: bytes | None = None) -> dict:
        """Store a release for nodes to download, and its signature file (served at the artifact's path + .sig)
        when given; `arch` defaults to this machine's (Go's name)."""
        from plexd.upgrade.upgrader import goarch

        path = f"/artifacts/{_q(version)}/{_q(os_name)}/{_q(arch or goarch())}"
        doc = {}
        for suffix, body in (("", data), (".sig", signature)):
            if body is None:
                continue
            try:
                resp = self.http.put(path + suffix, content=body)
            except httpx.HTTPError as exc:
                raise PlexdError(f"devplane at {self.url} unreachable: {exc}") from None
            if resp.status_code >= 300:
                raise AdminError(resp.status_code, resp.text)
            doc = doc or resp.json()
        return doc

    def start_upgrade(self, node_id: str, version: str, checksum: str | None = None, *,
                      allow_downgrade: bool = False) -> dict[str, str]:
        body: dict = {"version": version, "checksum": checksum}
        if allow_downgrade:
            body["allow_downgrade"] = True
        return self._call("POST", f"/nodes/{_q(node_id)}/upgrade", body)

    def resend_action(self, node_id: str, execution_id: str) -> str:
        """Publish an execution's request again as a new event; returns the event id."""
        return self._call("POST", f"/nodes/{_q(node_id)}/actions/{_q(execution_id)}/resend", {})["event_id"]

    def publish_event(self, node_id: str, event_type: str, payload: Any = None, *, payload_raw: str | None = None,
                      issued_at: str | None = None, nonce: str | None = None, signature: str | None = None,
                      raw_data: str | None = None, raw_frame: str | None = None) -> str:
        """Publish one event to one node. `signature="forge"` sends a random signature; `raw_data` is sent as
        the SSE data verbatim (unsigned); `raw_frame` is sent as a whole SSE block verbatim."""
        body = {"event_type": event_type, "payload": payload, "payload_raw": payload_raw, "issued_at": issued_at,
                "nonce": nonce, "signature": signature, "raw_data": raw_data, "raw_frame": raw_frame}
        return self._call("POST", f"/nodes/{_q(node_id)}/events", body)["event_id"]

    def broadcast_event(self, event_type: str, payload: Any = None, node_ids: list[str] | None = None,
                        **kwargs: Any) -> str:
        """One event (one id and signature) to `node_ids`, or to every registered node."""
        body = {"event_type": event_type, "payload": payload, "node_ids": node_ids, **kwargs}
        return self._call("POST", "/events", body)["event_id"]

    def rotate_signing_key(self, transition: str = "24h") -> dict[str, str]:
        return self._call("POST", "/signing-key/rotate", {"transition": transition})

    def create_session(self, node_id: str, kind: str, ttl_seconds: float, **target: Any) -> dict[str, Any]:
        """Mint an access session: `target` is user= (ssh, k8s), host=/port= (tcp), groups=, allowed_commands=,
        idle_timeout_seconds=. Returns {"session", "token"}."""
        return self._call("POST", f"/nodes/{_q(node_id)}/sessions",
                          {"kind": kind, "ttl_seconds": ttl_seconds, **target})

    def revoke_session(self, node_id: str, session_id: str) -> None:
        self._call("DELETE", f"/nodes/{_q(node_id)}/sessions/{_q(session_id)}")

    def sessions(self, node_id: str | None = None) -> list[dict[str, Any]]:
        return self._call("GET", f"/nodes/{_q(node_id)}/sessions" if node_id else "/sessions")

    def set_bridge(self, node_id: str, block: dict[str, Any] | None) -> None:
        """The node's `bridge` block ({"relay": {"sessions": [...]}, ...}), or None for none."""
        self._call("PUT", f"/nodes/{_q(node_id)}/bridge", block)

    def session_activity(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "session-activity")

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        """events_status, retry_after, close_after_events, silent, all_status (agent endpoints only)."""
        return self._call("PUT", "/faults", faults)

    def clear_faults(self) -> None:
        self._call("DELETE", "/faults")

    # -- what a node reported -----------------------------------------------------------------------------------

    def records(self, node_id: str, kind: str) -> list[Any]:
        return self._call("GET", f"/nodes/{_q(node_id)}/{kind}")

    def drift(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "drift")

    def executions(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "executions")

    def execution(self, node_id: str, execution_id: str) -> dict[str, Any]:
        found = [e for e in self.executions(node_id) if e["execution_id"] == execution_id]
        if not found:
            raise AdminError(404, f"node {node_id} has no execution {execution_id}")
        return found[0]

    def execution_callbacks(self, node_id: str, execution_id: str) -> list[dict[str, Any]]:
        """Platform dialect: every callback the node posted for the execution, in order, each
        {received_at, body, http_status, code} (refused ones too, with their status and code)."""
        return self.execution(node_id, execution_id)["callbacks"]

    def execution_output(self, node_id: str, execution_id: str) -> bytes:
        """Platform dialect: the output the terminal callback delivered (inline, or uploaded over the ceiling)."""
        try:
            resp = self.http.get(f"/nodes/{_q(node_id)}/executions/{_q(execution_id)}/output")
        except httpx.HTTPError as exc:
            raise PlexdError(f"devplane at {self.url} unreachable: {exc}") from None
        if resp.status_code >= 300:
            raise AdminError(resp.status_code, resp.text)
        return resp.content

    def capabilities(self, node_id: str) -> list[dict[str, Any]]:
        """Every capability manifest the node sent, oldest first."""
        return self.records(node_id, "capabilities")

    def report_entries(self, node_id: str) -> list[dict[str, Any]]:
        """The node's current report entries (its batches folded), sorted by key."""
        return self._call("GET", f"/nodes/{_q(node_id)}/report-entries")

    def reports(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "reports")

    def metrics(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "metrics")

    def logs(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "logs")

    def audit(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "audit")

    def integrity(self, node_id: str) -> list[dict[str, Any]]:
        """The violation reports (platform dialect: each body is {"violations": [...]})."""
        return self.records(node_id, "integrity")

    def heartbeats(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "heartbeats")

    def endpoints(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "endpoints")

    def tunnels(self, node_id: str) -> list[dict[str, Any]]:
        return self.records(node_id, "tunnels")


def _q(part: str) -> str:
    from urllib.parse import quote

    return quote(part, safe="")


class Devplane:
    """A `plexd-devplane serve` child process on `listen` (port 0 = any), its db in `tmp_dir`.

    `netns` runs it inside that network namespace (`ip netns exec`). `extra_args` go to `serve`, e.g.
    `["--heartbeat-interval", "1s", "--keepalive", "1s"]`. `dialect="platform"` serves the platform contract.
    """

    def __init__(self, tmp_dir: str | os.PathLike[str], listen: str = "127.0.0.1:0", netns: str | None = None,
                 extra_args: list[str] | tuple[str, ...] = (), *, heartbeat_interval: str | None = None,
                 keepalive: str | None = None, start_timeout: float = 20.0, dialect: str = "spec") -> None:
        self.dir = Path(tmp_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.dir / "devplane.db"
        self.log_path = self.dir / "devplane.log"
        self.listen = listen
        self.netns = netns
        self.extra_args = list(extra_args)
        if heartbeat_interval:
            self.extra_args += ["--heartbeat-interval", heartbeat_interval]
        if keepalive:
            self.extra_args += ["--keepalive", keepalive]
        self.dialect = dialect  # the node API's contract: "spec" or "platform" (docs/devplane.md)
        if dialect != "spec":
            self.extra_args += ["--dialect", dialect]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self._admin: AdminClient | None = None
        self._drain: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "plexd.devplane.devplane_cli", "serve", "--listen", self.listen,
               "--db", str(self.db_path), *self.extra_args]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        return cmd

    def start(self) -> Devplane:
        if self.proc is not None and self.proc.poll() is None:
            return self
        log = open(self.log_path, "a")  # noqa: SIM115 - closed when the drain thread ends
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        line = ""
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith(READY_PREFIX) or not line:
                break
        if not line.startswith(READY_PREFIX):
            self.kill()
            tail = self.log_path.read_text()[-2000:] if self.log_path.exists() else ""
            raise RuntimeError(f"devplane did not start: {line!r}\n{tail}")
        self.url = line[len(READY_PREFIX):].strip()
        # Keep the port on restart, so agents pointed at .url find us again.
        self.listen = self.url.removeprefix("http://")
        self._drain = threading.Thread(target=_drain, args=(self.proc.stdout, log), daemon=True)
        self._drain.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap()

    def kill(self) -> None:
        """SIGKILL, like a crash."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._reap()

    def _reap(self) -> None:
        if self._drain is not None:
            self._drain.join(5)
            self._drain = None
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def restart(self) -> Devplane:
        """Stop and start again: same db, same port."""
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def admin_token(self) -> str:
        return (self.dir / "devplane.db.admin-token").read_text().strip()

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            if not self.url:
                raise RuntimeError("devplane not started")
            self._admin = AdminClient(self.url, self.admin_token)
        return self._admin

    def __enter__(self) -> Devplane:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _drain(stream: Any, log: Any) -> None:
    """Copy whatever else the server prints to stdout into its log, so a full pipe never blocks it."""
    try:
        for line in stream:
            log.write(line)
            log.flush()
    except (ValueError, OSError):
        pass
    finally:
        log.close()
