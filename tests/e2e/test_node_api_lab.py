"""The node API of a real `plexd up` (real wireguard-go in a lab namespace) against the real devplane: node state
set by an admin arrives through one event, the cache files are a converge domain, secrets are gated by real
groups and leave no plaintext behind, reports reach the control plane through outages and restarts, and the TCP
listener wants its token. Callers are `plexd state` (root) and forked processes under other uids."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from pathlib import Path

import pytest
from lab_daemon import Daemon, wait_until
from process_helpers import run_as

from plexd.node import control_client

pytestmark = pytest.mark.root
OTHER_UID = 64_202
SECRET = "plaintext-only-in-memory-7f3a9c"


def state(d: Daemon, *args: str) -> object:
    return json.loads(d.cli("state", *args, "--json").stdout)


def started(lab, dp, daemons, tmp_path, *, node_api: str, extra: str = "") -> Daemon:
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, "1h", node_api=node_api,
               extra_config="log_level: debug\nshutdown: {deregister: false}\n" + extra)
    daemons.append(d)
    wait_until(lambda: d.node_id() is not None and (d.dir / "data/state/metadata.json").exists()
               and d.api_listening(), 30, "registration, the first cache write and the node API socket", daemons)
    return d


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_node_state_arrives_by_event_secrets_are_gated_and_the_cache_is_converged(lab_dp, api_dir, system_groups):
    lab, dp, daemons, tmp_path = lab_dp
    (sock_group, sock_gid), (secrets_group, secrets_gid) = system_groups(2)
    sock = api_dir / "api.sock"
    d = started(lab, dp, daemons, tmp_path, node_api=f"socket_path: {sock}, socket_group: {sock_group}, "
                                                      f"secrets_group: {secrets_group}")
    node_id = d.node_id()
    assert oct(sock.stat().st_mode & 0o777) == "0o660" and sock.stat().st_gid == sock_gid

    # metadata and data: one event each, no reconcile (its interval is 1 h)
    wait_until(lambda: d.status()["event_stream"]["state"] == "connected", 20, "the event stream", daemons)
    wait_until(lambda: "event stream (re)connected" in ((d.status()["reconcile"]["last"] or {}).get("reasons") or []),
               20, "the reconcile the connection triggers", daemons)
    cycles = d.status()["reconcile"]["cycles"]
    dp.admin.set_metadata(node_id, {"env": "prod", "role": "db"})
    dp.admin.set_data(node_id, "db/config", "application/json", {"host": "db.internal", "port": 5432})
    wait_until(lambda: state(d, "get", "metadata") == {"env": "prod", "role": "db"}, 10, "metadata", daemons)
    wait_until(lambda: state(d, "get", "data") != [], 10, "data", daemons)
    assert state(d, "get", "data", "db/config")["payload"] == {"host": "db.internal", "port": 5432}
    assert d.status()["reconcile"]["cycles"] == cycles  # no state pull brought them
    cache = d.dir / "data" / "state"
    wait_until(lambda: json.loads((cache / "metadata.json").read_text()) == {"env": "prod", "role": "db"}, 10,
               "the metadata cache file", daemons)
    [data_file] = os.listdir(cache / "data")
    assert json.loads((cache / "data" / data_file).read_text())["key"] == "db/config"  # kept inside data/

    # secrets: live from the devplane, decrypted with the node's key; root and plexd-secrets members only
    dp.admin.set_secret(node_id, "tls-key", SECRET)
    wait_until(lambda: state(d, "get", "secret") == [{"key": "tls-key", "version": 1}], 10, "secret index",
               daemons)
    assert state(d, "get", "secret", "tls-key") == {"key": "tls-key", "value": SECRET, "version": 1}

    def read_secret():
        try:
            print(json.dumps(control_client.call(str(sock), "GET", "/v1/state/secrets/tls-key")))
        except Exception as exc:
            print(exc)

    rc, out = run_as(read_secret, OTHER_UID, OTHER_UID, (sock_gid, secrets_gid))
    assert rc == 0 and json.loads(out)["value"] == SECRET, out
    rc, out = run_as(read_secret, OTHER_UID, OTHER_UID, (sock_gid,))
    assert "forbidden: insufficient privileges for secret access (HTTP 403)" in out, out

    # a cache file edited or deleted by hand is restored by the reconcile and reported upstream as drift
    (cache / "metadata.json").write_text('{"env": "tampered"}')
    (cache / "data" / data_file).unlink()
    doc = json.loads(d.cli("reconcile", "--once", "--json").stdout)
    fixed = {(c["type"], c["detail"].split(":")[0]) for c in doc["corrections"]}
    assert ("cache_file_updated", "node cache state/metadata.json") in fixed, doc
    assert ("cache_file_added", f"node cache state/data/{data_file}") in fixed, doc
    assert json.loads((cache / "metadata.json").read_text()) == {"env": "prod", "role": "db"}
    assert (cache / "data" / data_file).stat().st_mode & 0o777 == 0o600
    reported = [c["type"] for report in dp.admin.drift(node_id) for c in report["corrections"]]
    assert "cache_file_updated" in reported and "cache_file_added" in reported

    # the plaintext is nowhere on disk: not under data_dir, the socket's directory, the logs, or the test's files
    # (the devplane's database is the control plane's store of the secret and is not the node's)
    d.stop()
    needle = SECRET.encode()
    scanned = 0
    for root in (tmp_path, api_dir):
        for path in Path(root).rglob("*"):
            if path.is_file() and not path.is_relative_to(tmp_path / "dp"):
                assert needle not in path.read_bytes(), f"secret plaintext found in {path}"
                scanned += 1
    assert scanned >= 5 and (d.dir / "data" / "identity.json").exists()


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def queued_reports(d: Daemon) -> list[str]:
    """The keys in the reports lane of the daemon's uplink outbox (read beside the running daemon: WAL)."""
    with contextlib.closing(sqlite3.connect(d.dir / "data/uplink.db")) as db:
        return sorted(key for (key,) in db.execute("SELECT key FROM outbox WHERE lane = 'reports'"))


def test_reports_reach_the_control_plane_through_an_outage_and_a_restart(lab_dp, api_dir):
    lab, dp, daemons, tmp_path = lab_dp
    (api_dir / "token").write_text("  tcp-token-1  \n")
    d = started(lab, dp, daemons, tmp_path,
                node_api=f"socket_path: {api_dir / 'api.sock'}, http_enabled: true, "
                         f"http_listen: '127.0.0.1:9100', http_token_file: {api_dir / 'token'}")
    node_id = d.node_id()
    payload = tmp_path / "payload.json"

    def put(key: str, body: dict) -> dict:
        payload.write_text(json.dumps(body))
        return state(d, "report", "put", key, "--file", str(payload))

    def upstream() -> dict:
        return {e["key"]: (e["version"], e["payload"]) for e in dp.admin.report_entries(node_id)}

    assert put("app-health", {"status": "starting"})["version"] == 1
    wait_until(lambda: upstream() == {"app-health": (1, {"status": "starting"})}, 20, "the first report", daemons)

    # the control plane goes away; workloads keep writing; the daemon restarts meanwhile
    dp.stop()
    assert put("app-health", {"status": "healthy"})["version"] == 2
    put("disk", {"free": 17})
    put("tmp", {"x": 1})
    d.cli("state", "report", "delete", "tmp")
    res = d.cli("state", "get", "secret", "any", check=False)  # secrets are never cached: 503 while away
    assert res.returncode == 1 and "control plane unavailable (HTTP 503)" in res.stderr, res.stderr
    # past the debounce: the daemon tried, failed, and keeps the queue
    wait_until(lambda: "reports batch of 3 (keys: app-health, disk, tmp) report not delivered" in d.logged(), 20,
               "a failed report sync", daemons)
    d.restart()
    wait_until(d.api_listening, 30, "the restarted daemon's socket", daemons)
    assert queued_reports(d) == ["app-health", "disk", "tmp"]
    dp.start()
    wait_until(lambda: upstream() == {"app-health": (2, {"status": "healthy"}), "disk": (1, {"free": 17})}, 60,
               "the reports written during the outage", daemons)
    wait_until(lambda: queued_reports(d) == [], 10, "the queue to empty", daemons)

    # a batch the control plane refuses (409) is dropped with a logged reason, not retried forever
    dp.admin.set_faults(report_status=409)
    put("refused", {"n": 1})
    wait_until(lambda: "reports batch of 1 (keys: refused) report dropped: the control plane refused it for good"
               in d.logged(), 20, "the 409 to be logged", daemons)
    dp.admin.clear_faults()
    put("after", {"n": 2})
    wait_until(lambda: "after" in upstream(), 20, "a later report", daemons)
    assert "refused" not in upstream()

    # the TCP listener (inside the node's namespace): no token, a wrong one, the right one
    def curl(*headers: str) -> str:
        cmd = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:9100/v1/state/report"]
        for h in headers:
            cmd += ["-H", h]
        return lab.exec(d.node, cmd).stdout

    assert curl() == "401"
    assert curl("Authorization: Bearer nope") == "401"
    assert curl("Authorization: Bearer tcp-token-1") == "200"
    api = d.status()["node_api"]
    assert api["tcp"] == "127.0.0.1:9100" and api["reports"] == 4 and api["report_sync"]["dropped"] == 1
    # two 401s are within the per-address allowance: nobody was turned away at the door; the store's size is shown
    assert api["tcp_refused"] == 0 and api["report_bytes"] == sum(
        p.stat().st_size for p in (d.dir / "data/state/report").glob("*.json"))
    assert "node API:" in d.cli("status").stdout


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_an_empty_token_file_stops_the_start_with_one_line(lab_dp, api_dir):
    lab, dp, daemons, tmp_path = lab_dp
    (api_dir / "empty").write_text("\n")
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, "1h",
               node_api=f"socket_path: {api_dir / 'api.sock'}, http_enabled: true, "
                        f"http_token_file: {api_dir / 'empty'}")
    daemons.append(d)
    assert d.proc.wait(20) == 1
    assert f"plexd: node_api.http_token_file: {api_dir / 'empty'} is empty" in d.logged()
    assert dp.admin.nodes() == []  # refused before registering
