"""Self-upgrade in the lab (plexd.upgrade): real daemons, the real devplane serving real release zipapps built
from this checkout, real wireguard-go. No systemd here (it is not PID 1), so the daemon re-executes itself and
the detached watcher stands in for systemd's restart; the systemd path differs only in who starts `plexd up`.

On one node a, pinging b through the tunnel:
1. a checksum that does not match the artifact's signature: refused before anything is downloaded;
2. a good release (this checkout, another version string) under a continuous ping: at most one packet lost, the
   same process (re-executed) and the same wireguard-go, the new version and checksum reported upstream;
3. a broken release (it exits as soon as `plexd up` starts): rolled back to the previous release by itself,
   the failure reported as the action's result;
4. a release that runs but never becomes healthy (its heartbeats never get through): it gives up at its health
   deadline and restarts, and the launcher rolls back.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import pytest
from lab_daemon import Daemon, ping_count, ping_during, pinging_pair, wait_until, wireguard_go_pids
from nacl.signing import SigningKey
from test_actions_lab import TERMINAL, execution, finished, outcome

from plexd.upgrade import signing, zipapp

RELEASE_KEY = SigningKey.generate()  # this lab's release key, pinned in node a's upgrade.release_keys

BROKEN_MAIN = b"""import sys

if sys.argv[1:2] == ["up"]:
    sys.exit("this release fails at start on purpose (the upgrade lab's broken artifact)")
from plexd.cli import main

sys.exit(main())
"""

UNHEALTHY_MAIN = b"""import sys

from plexd.services.heartbeat import HeartbeatService


async def never_sent(self):  # this release never gets a heartbeat through: it cannot prove itself healthy
    return False


HeartbeatService.beat = never_sent
from plexd.cli import main

sys.exit(main())
"""


def releases(d: Daemon) -> list[str]:
    """The release files (their .sig files aside)."""
    rel = d.dir / "releases"
    return sorted(p.name for p in rel.iterdir() if not p.name.endswith(".sig")) if rel.exists() else []


def put_signed(dp, version: str, path) -> str:
    data = path.read_bytes()
    checksum = hashlib.sha256(data).hexdigest()
    return dp.admin.put_artifact(version, data, signature=signing.sign(RELEASE_KEY, version, checksum))["sha256"]


def last_checksum(dp, node_id: str) -> str:
    return dp.admin.node(node_id)["last_heartbeat"]["binary_checksum"]


def stop_pid(pid: int) -> None:
    """SIGTERM a daemon the test did not start itself (the watcher did), and wait for it to go."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(300):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def upgrading_pair(lab_dp, upgrade_extra: str = ""):
    """Node a, pinning RELEASE_KEY with a 10 s health deadline (and `upgrade_extra`), pinging b: (lab, dp,
    daemons, a, b)."""
    lab, dp, daemons, workdir = lab_dp
    a_config = (f"upgrade: {{dir: {workdir / lab.nodes[0].name / 'releases'}, health_deadline: 10s, "
                f"release_keys: ['{signing.public_key(RELEASE_KEY)}']{upgrade_extra}}}\n")
    a, b = pinging_pair(lab, dp, daemons, workdir, reconcile="1h", a_config=a_config)
    return lab, dp, daemons, a, b


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_upgrade_refuses_a_bad_checksum_installs_a_good_release_under_ping_and_rolls_back_a_broken_one(
        lab_dp, tmp_path):
    lab, dp, daemons, a, b = upgrading_pair(lab_dp)
    a_id = a.node_id()
    before = a.status()["daemon"]
    good_sum = zipapp.build(tmp_path / "good.pyz", version="0.1.1-lab")
    broken_sum = zipapp.build(tmp_path / "broken.pyz", version="0.1.2-lab", overrides={"__main__.py": BROKEN_MAIN})
    assert put_signed(dp, "0.1.1-lab", tmp_path / "good.pyz") == good_sum
    put_signed(dp, "0.1.2-lab", tmp_path / "broken.pyz")
    zipapp.build(tmp_path / "unhealthy.pyz", version="0.1.3-lab", overrides={"__main__.py": UNHEALTHY_MAIN})
    put_signed(dp, "0.1.3-lab", tmp_path / "unhealthy.pyz")
    relaunched = []
    try:
        # 1. The wrong checksum: nothing installed, nothing restarted.
        eid = dp.admin.start_upgrade(a_id, "0.1.1-lab", checksum="0" * 64)["execution_id"]
        result = finished(dp, a_id, eid, daemons)["result"]
        # (the signature names the real checksum: refused before the artifact is even downloaded)
        assert result["status"] == "failed" and "release signature refused" in result["stderr"], result
        assert f"the signature is for SHA-256 '{good_sum}', not {'0' * 64}" in result["stderr"], result
        assert releases(a) == [], "a refused artifact must leave nothing behind"
        assert a.status()["daemon"]["pid"] == before["pid"] and a.proc.poll() is None

        # 2. A good release under a continuous ping (10 per second).
        wg_before = wireguard_go_pids(lab, a.node)
        def upgrade():
            eid = dp.admin.start_upgrade(a_id, "0.1.1-lab")["execution_id"]
            return finished(dp, a_id, eid, daemons, timeout=60)["result"]

        result, missing, sent = ping_during(lab, a.node, b.mesh_ip(), 120, upgrade)
        print(f"upgrade under ping: {missing} of {sent} lost")
        assert result["status"] == "success", result
        doc = json.loads(result["stdout"])
        assert doc["status"] == "upgraded" and doc["to_version"] == "0.1.1-lab" and doc["binary_checksum"] == good_sum
        assert sent == 120 and missing <= 1
        now = a.status()["daemon"]
        assert now["version"] == "0.1.1-lab" and now["binary_checksum"] == good_sum
        assert now["pid"] == before["pid"], "without systemd the daemon re-executes itself in the same process"
        assert last_checksum(dp, a_id) == good_sum
        assert wireguard_go_pids(lab, a.node) == wg_before, "the tunnels' wireguard-go must outlive the upgrade"
        assert os.readlink(a.dir / "releases" / "current") == f"plexd-0.1.1-lab-{good_sum[:12]}.pyz"
        assert not (a.dir / "data" / "upgrade.json").exists()

        # 3. A broken release: it dies at start; the watcher starts plexd again, whose launcher rolls back.
        eid = dp.admin.start_upgrade(a_id, "0.1.2-lab")["execution_id"]
        result = finished(dp, a_id, eid, daemons, timeout=90)["result"]
        assert result["status"] == "failed", result
        assert "stopped before it became healthy" in result["stderr"] and "rolled back to plexd 0.1.1-lab" in \
            result["stderr"], result
        a.proc.wait(10)  # the original process ended with the broken release
        now = a.status()["daemon"]
        relaunched.append(now["pid"])
        assert now["version"] == "0.1.1-lab" and now["binary_checksum"] == good_sum
        assert os.readlink(a.dir / "releases" / "current") == f"plexd-0.1.1-lab-{good_sum[:12]}.pyz"
        wait_until(lambda: last_checksum(dp, a_id) == good_sum, 15, "the rolled-back checksum upstream", daemons)
        last = a.status()["upgrade"]["last"]
        assert last["status"] == "rolled back" and last["to_version"] == "0.1.2-lab", last
        assert "upgrade:        rolled back: 0.1.1-lab -> 0.1.2-lab (plexd 0.1.2-lab stopped before" in \
            a.cli("status").stdout
        assert f"plexd-0.1.2-lab-{broken_sum[:12]}.pyz" in releases(a), "kept beside the others, for a look"
        text = a.logged()
        assert "upgrade to plexd 0.1.2-lab failed" in text and "rolled back to plexd 0.1.1-lab" in text
        assert execution(dp, a_id, eid)["ack"]["status"] == "accepted"

        # 4. A release that never becomes healthy gives up at its deadline (10 s here) and is rolled back.
        eid = dp.admin.start_upgrade(a_id, "0.1.3-lab")["execution_id"]
        result = finished(dp, a_id, eid, daemons, timeout=90)["result"]
        assert result["status"] == "failed", result
        assert "was not healthy by its deadline: no heartbeat accepted yet" in result["stderr"], result
        now = a.status()["daemon"]
        assert now["pid"] == relaunched[0], "the release gave up and re-executed; no watcher had to step in"
        assert now["version"] == "0.1.1-lab" and now["binary_checksum"] == good_sum
        assert ping_count(lab, a.node, b.mesh_ip(), 3, 0.2) == 3
    finally:
        for pid in relaunched:
            stop_pid(pid)


@pytest.mark.parametrize("lab_dp", [{"nodes": 2, "dialect": "platform"}], indirect=True)
def test_a_platform_node_upgrades_from_its_release_page_under_ping(lab_dp, tmp_path):
    # The platform serves no releases to nodes: node a fetches one from upgrade.release_url (the devplane's release
    # page, GitHub's place), reads the execution as the platform words it (a release tag, a typed digest), and the
    # new release sends the terminal callback once healthy, after the restart.
    lab, dp, daemons, a, b = upgrading_pair(lab_dp, f", release_url: '{lab_dp[1].url}/releases'")
    a_id = a.node_id()
    before = a.status()["daemon"]
    good_sum = zipapp.build(tmp_path / "good.pyz", version="0.1.4-lab")
    assert put_signed(dp, "0.1.4-lab", tmp_path / "good.pyz") == good_sum

    eid = dp.admin.start_upgrade(a_id, "0.1.4-lab", checksum="0" * 64)["execution_id"]
    assert dp.admin.execution(a_id, eid)["parameters"] == {"version": "v0.1.4-lab", "checksum": "sha256:" + "0" * 64}
    refused = outcome(dp, a_id, eid, daemons)
    assert refused["status"] == "failed" and "release signature refused" in refused["output"], refused
    assert releases(a) == [] and a.status()["daemon"]["pid"] == before["pid"]

    def upgrade():
        eid = dp.admin.start_upgrade(a_id, "0.1.4-lab")["execution_id"]
        wait_until(lambda: dp.admin.execution(a_id, eid)["status"] in TERMINAL, 60, f"the result of {eid}", daemons)
        return outcome(dp, a_id, eid, daemons)

    result, missing, sent = ping_during(lab, a.node, b.mesh_ip(), 120, upgrade)
    print(f"platform upgrade under ping: {missing} of {sent} lost")
    assert result["status"] == "success" and result["exit_code"] == 0, result
    doc = json.loads(result["output"])
    assert doc["status"] == "upgraded" and doc["to_version"] == "0.1.4-lab" and doc["binary_checksum"] == good_sum
    assert sent == 120 and missing <= 1
    now = a.status()["daemon"]
    assert now["version"] == "0.1.4-lab" and now["binary_checksum"] == good_sum and now["pid"] == before["pid"]
    assert os.readlink(a.dir / "releases" / "current") == f"plexd-0.1.4-lab-{good_sum[:12]}.pyz"
