"""``plexd reconcile --once [--dry-run]`` as a real process against the real devplane (no device needed for the
dry run; the applying run refuses clearly when the interface is not up)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from plexd.base.wgkeys import generate_private_key, public_key_of
from plexd.devplane.harness import Devplane
from plexd.identity.identity_store import Identity, IdentityStore

PLEXD = str(Path(sys.executable).with_name("plexd"))


@pytest.fixture
def registered(tmp_path):
    with Devplane(tmp_path / "dp") as dp:
        priv = generate_private_key()
        nodes = []
        for i in range(2):
            key = priv if i == 0 else generate_private_key()
            token = dp.admin.create_token()
            r = httpx.post(f"{dp.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                           json={"token": token, "public_key": base64.b64encode(public_key_of(key)).decode(),
                                 "hostname": f"px-rc-{i}"})
            r.raise_for_status()
            nodes.append(r.json())
        me = nodes[0]
        IdentityStore(tmp_path / "data").save(Identity(me["node_id"], me["mesh_ip"], me["signing_public_key"],
                                                       me["node_secret_key"], priv))
        yield dp, tmp_path, me, nodes[1]


def plexd(tmp_path, dp, *args):
    env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": "", "PLEXD_API": dp.url, "PLEXD_API_ALLOW_INSECURE": "true",
           "PLEXD_DATA_DIR": str(tmp_path / "data"), "PLEXD_MESH_INTERFACE": "pxrc0",
           "PLEXD_MESH_BACKEND": "userspace", "PLEXD_HOOKS_DIR": str(tmp_path / "hooks"),
           "PLEXD_NODE_API_SOCKET_PATH": str(tmp_path / "api.sock")}
    return subprocess.run([PLEXD, *args], env=env, capture_output=True, text=True, timeout=60)


def test_dry_run_prints_the_plan_and_changes_nothing(registered):
    dp, tmp_path, me, other = registered
    out = plexd(tmp_path, dp, "reconcile", "--once", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["dry_run"] is True and doc["drift_reported"] is False
    details = " ".join(c["detail"] for c in doc["corrections"])
    assert other["node_id"] in details  # the other node would be added as a peer
    assert dp.admin.drift(me["node_id"]) == []
    text = plexd(tmp_path, dp, "reconcile", "--once", "--dry-run")
    assert text.returncode == 0 and "would correct" in text.stdout
    assert f"peer_added             peer {other['node_id']}: missing from the device" in text.stdout  # the plan
    assert subprocess.run(["ip", "link", "show", "pxrc0"], capture_output=True).returncode != 0


def test_applying_without_a_device_says_to_run_up(registered):
    dp, tmp_path, _, _ = registered
    out = plexd(tmp_path, dp, "reconcile", "--once")
    assert out.returncode == 1
    assert "pxrc0 is not up" in out.stderr and "plexd up" in out.stderr
    assert "Traceback" not in out.stderr


def test_not_registered(tmp_path):
    with Devplane(tmp_path / "dp") as dp:
        out = plexd(tmp_path, dp, "reconcile", "--once", "--dry-run")
    assert out.returncode == 1 and "not registered" in out.stderr
