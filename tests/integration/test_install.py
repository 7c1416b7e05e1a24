"""Putting plexd on a machine: `plexd install` / `plexd uninstall --purge` in a scratch root (real groupadd and
groupdel, with --prefix), the systemd unit checked by the real systemd-analyze (verify, and the security score
against the peers' units), and the Kubernetes DaemonSet parsed and its config loaded by plexd's own loader."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from plexd.config.settings import load as load_config
from plexd.install.installer import unit_text

PLEXD = str(Path(sys.executable).with_name("plexd"))
REPO = Path(__file__).resolve().parents[2]
PEER_SCORES = {"NetBird": 6.9, "the Go plexd agent": 7.1}  # systemd-analyze security of their units (the issue)

pytestmark = pytest.mark.root


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every path under root: its mode and (for files) a hash of its content, (for links) its target."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            what = "-> " + os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            what = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            what = "dir"
        out[str(path.relative_to(root))] = (stat.S_IMODE(st.st_mode), what)
    return out


def plexd(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    empty = tmp_path / "empty.yaml"  # never the host's /etc/plexd/config.yaml
    empty.touch()
    return subprocess.run([PLEXD, *args], env={"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(empty)},
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_install_then_uninstall_purge_in_a_scratch_root_leaves_nothing_behind(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for name in ("group", "gshadow"):  # groupadd --prefix edits these, keeping a NAME- backup
        for copy in (name, f"{name}-"):
            shutil.copy2(f"/etc/{name}", root / "etc" / copy)
    before = snapshot(root)
    token = tmp_path / "token"
    token.write_text("plx_enroll_0123456789abcdef\n")
    exec_path = "/opt/plexd/venv/bin/plexd"

    r = plexd(tmp_path, "install", "--root", str(root), "--exec", exec_path, "--token-file", str(token),
              "--api", "https://cp.example.com:8443", "--json")
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)["done"]
    assert "created group plexd" in done and "created group plexd-secrets" in done
    modes = {rel: stat.S_IMODE((root / rel).stat().st_mode) for rel in
             ("etc/plexd", "etc/plexd/hooks.d", "var/lib/plexd", "run/plexd", "opt/plexd/releases",
              "etc/plexd/config.yaml", "etc/plexd/bootstrap-token", "etc/systemd/system/plexd.service")}
    assert modes == {"etc/plexd": 0o755, "etc/plexd/hooks.d": 0o755, "var/lib/plexd": 0o700, "run/plexd": 0o755,
                     "opt/plexd/releases": 0o755,
                     "etc/plexd/config.yaml": 0o644, "etc/plexd/bootstrap-token": 0o600,
                     "etc/systemd/system/plexd.service": 0o644}
    assert load_config(str(root / "etc/plexd/config.yaml"), env={}).api.url == "https://cp.example.com:8443"
    assert (root / "etc/plexd/bootstrap-token").read_text() == token.read_text()
    assert f"ExecStart={exec_path} up\n" in (root / "etc/systemd/system/plexd.service").read_text()
    assert os.readlink(root / "usr/local/bin/plexd") == exec_path
    groups = {line.split(":")[0] for line in (root / "etc/group").read_text().splitlines()}
    assert {"plexd", "plexd-secrets", "plexd-admin"} <= groups
    assert "skipped: systemctl daemon-reload (systemd is not running here)" in \
        plexd(tmp_path, "install", "--root", str(root), "--exec", exec_path).stdout

    # An operator's config is never overwritten by a second install.
    (root / "etc/plexd/config.yaml").write_text("api: https://mine.example.com\n")
    again = plexd(tmp_path, "install", "--root", str(root), "--exec", exec_path)
    assert again.returncode == 0 and "/etc/plexd/config.yaml exists: left as it is" in again.stdout
    assert (root / "etc/plexd/config.yaml").read_text() == "api: https://mine.example.com\n"

    r = plexd(tmp_path, "uninstall", "--purge", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert "done: removed /var/lib/plexd" in r.stdout and "done: removed group plexd-secrets" in r.stdout
    after = snapshot(root)
    # Everything install made is gone; only the directories it needed on the way stay empty (etc/systemd/system,
    # usr/local/bin, var/lib, run, opt/plexd), as a package manager leaves them.
    left = {p for p in after if p not in before}
    assert left == {"etc/systemd", "etc/systemd/system", "usr", "usr/local", "usr/local/bin", "var", "var/lib",
                    "run", "opt", "opt/plexd"}, left
    assert all(after[p][1] == "dir" for p in left)
    for name in ("etc/group", "etc/gshadow"):
        assert after[name] == before[name], f"{name} differs from before the install"


def test_install_refuses_an_entry_point_the_unit_could_not_see(tmp_path):
    r = plexd(tmp_path, "install", "--root", str(tmp_path / "root"), "--exec", "/root/.local/bin/plexd")
    assert r.returncode == 1 and "ProtectHome" in r.stderr and "/opt/plexd" in r.stderr


def analyzable_unit(tmp_path: Path) -> Path:
    """systemd-analyze needs ExecStart to exist here (docs/test-environment.md §7): the unit as install writes it,
    pointed at an executable that does."""
    path = tmp_path / "plexd.service"
    path.write_text(unit_text(shutil.which("true")))
    return path


def test_the_installed_unit_verifies_without_a_word(tmp_path):
    unit = analyzable_unit(tmp_path)
    text = unit.read_text()
    for directive in ("Type=notify\n", "NotifyAccess=main\n", "WatchdogSec=", "Restart=on-failure\n",
                      "StateDirectory=plexd\n", "RuntimeDirectory=plexd wireguard\n", "ConfigurationDirectory=plexd\n",
                      "ExecReload=/bin/kill -HUP $MAINPID\n"):
        assert directive in text, directive
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                         cwd=tmp_path, check=False)
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")


def test_the_verify_check_would_catch_an_unknown_key(tmp_path):
    """Control: an unknown key only warns (rc 0), which is why the test above fails on any output."""
    unit = analyzable_unit(tmp_path)
    unit.write_text(unit.read_text().replace("[Service]\n", "[Service]\nBogusKey=1\n"))
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                         cwd=tmp_path, check=False)
    assert "Unknown key" in res.stderr


def test_the_unit_is_more_hardened_than_every_peers(tmp_path):
    unit = analyzable_unit(tmp_path)
    res = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                         capture_output=True, text=True, check=False)
    m = re.search(r"Overall exposure level for plexd\.service: (\d+\.\d+)", res.stdout + res.stderr)
    assert m is not None, res.stdout[-2000:] + res.stderr
    score = float(m.group(1))
    print(f"systemd-analyze security --offline=yes: {score}")
    assert all(score < peer for peer in PEER_SCORES.values()), score


def test_the_kubernetes_daemonset_gives_plexd_what_it_needs():
    docs = list(yaml.safe_load_all((REPO / "deploy/kubernetes/plexd-daemonset.yaml").read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["terminationGracePeriodSeconds"] >= 35  # plexd's stop budget
    (container,) = pod["containers"]
    caps = container["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"] and {"NET_ADMIN", "NET_RAW"} <= set(caps["add"])
    assert container["securityContext"]["privileged"] is False
    token = next(e for e in container["env"] if e["name"] == "PLEXD_BOOTSTRAP_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["key"] == "token"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/var/lib/plexd"]]["hostPath"]["path"] == "/var/lib/plexd"
    assert volumes[mounts["/dev/net/tun"]]["hostPath"]["type"] == "CharDevice"
    # The config the pod runs with is one plexd itself accepts, with data_dir on the host path.
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(config_map["data"]["config.yaml"])
        loaded = load_config(str(config), env={})
    assert loaded.data_dir == "/var/lib/plexd" and loaded.token.env == "PLEXD_BOOTSTRAP_TOKEN"
    assert loaded.node_api.socket_path in {f"{m}/api.sock" for m in mounts}
    assert loaded.shutdown.drain + 5 < pod["terminationGracePeriodSeconds"]
