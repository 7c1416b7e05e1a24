"""`plexd-devplane admin ...` against a platform-dialect devplane, as a user runs it (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
from platform_helpers import PlatformNode, assert_problem, register, register_body

CLI = [sys.executable, "-m", "plexd.devplane.devplane_cli"]


def admin(dp, *args: str) -> subprocess.CompletedProcess[str]:
    token_file = dp.db_path.with_name(dp.db_path.name + ".admin-token")
    return subprocess.run([*CLI, "admin", "--url", dp.url, "--token-file", str(token_file), *args],
                          capture_output=True, text=True, timeout=30)


def test_tokens_status_keys_and_executions_from_the_cli(platform_dp):
    status = admin(platform_dp, "status")
    assert status.returncode == 0 and "dialect: platform (project " in status.stdout, status.stderr
    made = admin(platform_dp, "token", "create", "--kind", "bridge", "--ttl", "1h", "--json")
    info = json.loads(made.stdout)
    assert info["kind"] == "bridge" and "_bridge_" in info["token"] and info["expires_at"]
    token = admin(platform_dp, "token", "create").stdout.strip()
    assert admin(platform_dp, "token", "revoke", token).returncode == 0
    body = register_body(platform_dp, bootstrap_token=token)
    assert_problem(httpx.post(f"{platform_dp.url}/v1/register", json=body, timeout=10), 403, "token_revoked")

    node: PlatformNode = register(platform_dp)
    assert admin(platform_dp, "keys", "rotate", node.id).returncode == 0
    assert node.heartbeat().json()["rotate_keys"] is True
    eid = admin(platform_dp, "action", "request", node.id, "diagnostics.collect", "--type", "hook").stdout.strip()
    shown = admin(platform_dp, "executions", "show", node.id)
    assert shown.returncode == 0 and eid in shown.stdout and "hook" in shown.stdout and "pending" in shown.stdout
    node.put("state/reports/status.mesh", {"value": '{"peer_count":0}'})
    got = admin(platform_dp, "report", "get", node.id, "status.mesh")
    assert got.returncode == 0 and got.stdout.strip() == '{"peer_count":0}'
    assert "status.mesh" in admin(platform_dp, "report", "list", node.id).stdout
