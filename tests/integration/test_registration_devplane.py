"""Registration against the real reference control plane (`plexd-devplane` process, real HTTP), driving the real
``plexd`` executable: join, identity files and modes, token file deletion, identity reuse by ``plexd up`` without
a POST, a reused token refused with the operator message, and re-registration after the devplane forgets the node.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from plexd.devplane.harness import Devplane
from plexd.identity.identity_store import IdentityStore

PLEXD = str(Path(sys.executable).with_name("plexd"))


@pytest.fixture
def dp(tmp_path):
    with Devplane(tmp_path / "devplane") as plane:
        yield plane


class Node:
    """One plexd installation: its own data_dir, token file and config."""

    def __init__(self, root: Path, dp: Devplane, name: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.name = root, name
        self.data = root / "data"
        self.token = root / "bootstrap-token"
        self.config = root / "config.yaml"
        self.config.write_text(
            f"api: {{url: {dp.url}, allow_insecure: true}}\n"
            f"data_dir: {self.data}\ntoken: {{file: {self.token}}}\nhooks: {{dir: {root / 'hooks'}}}\n"
            f"registration: {{hostname: {name}, max_wait: 5s}}\nnode_api: {{socket_path: {root / 'api.sock'}}}\n"
            "sse: {backoff_base: 50ms, backoff_max: 500ms}\n"
            # Registration is the subject here: keep the mesh device out of the host (its converge fails, is
            # logged, and the daemon keeps running).
            "mesh: {interface: pxcore0, backend: userspace, userspace_implementation: /nonexistent/px-no-wg}\n")

    def env(self, **extra: str) -> dict[str, str]:
        # systemd forced off: `deregister --purge` here must never disable the host's own plexd.service
        return {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(self.config), "PLEXD_TEST_NO_SYSTEMD": "1", **extra}

    def run(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PLEXD, *args], env=self.env(**extra), capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)

    def up(self, **extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen([PLEXD, "up"], env=self.env(**extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)

    def identity(self):
        return IdentityStore(self.data).load().identity


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, err


def wait_until(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


def registrations(dp: Devplane) -> list[dict]:
    """Every /v1/register the devplane handled (fresh and by node secret), from its structured log."""
    out = []
    for line in dp.log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") in ("node registered", "node re-registered with its node secret"):
            out.append(entry)
    return out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_join_registers_persists_and_up_reuses_without_a_post(tmp_path, dp):
    node = Node(tmp_path / "a", dp, "px-node-a")
    node.token.write_text(dp.admin.create_token() + "\n")
    r = node.run("join")
    assert r.returncode == 0, r.stderr
    ident = node.identity()
    assert f"registered as node {ident.node_id} with mesh IP {ident.mesh_ip}" in r.stdout

    # The control plane knows it, with our public key.
    (listed,) = dp.admin.nodes()
    assert (listed["id"], listed["hostname"], listed["mesh_ip"]) == (ident.node_id, "px-node-a", ident.mesh_ip)
    assert listed["public_key"] == ident.public_key

    # Identity files: the [C] names, 0600 files in a 0700 dir; the used token file is gone.
    assert mode(node.data) == 0o700
    for name in ("identity.json", "private_key", "node_secret_key", "signing_public_key"):
        assert mode(node.data / name) == 0o600, name
    assert json.loads((node.data / "identity.json").read_text()) == {
        "node_id": ident.node_id, "mesh_ip": ident.mesh_ip,
        "signing_public_key": dp.admin.status()["signing_keys"]["current"]}
    assert not node.token.exists()
    assert len(ident.node_secret_key) == 32

    status = json.loads(node.run("status", "--json").stdout)
    assert status["registered"] and status["node_id"] == ident.node_id and status["control_plane"] == dp.url

    # A second start reuses the identity: no registration reaches the control plane.
    before = registrations(dp)
    assert len(before) == 1
    caps = dp.admin.node(ident.node_id)["capabilities"]  # sent with the registration
    assert len(caps["binary"]["checksum"]) == 64 and caps["binary"]["version"]
    proc = node.up()
    try:
        wait_until(lambda: len(dp.admin.records(ident.node_id, "capabilities")) == 1,
                   what="capabilities announced by plexd up")
    finally:
        rc, err = stop(proc)
    assert rc == 0, err
    assert registrations(dp) == before
    assert node.identity() == ident
    assert "using the stored identity" in err


def test_reused_token_is_refused_with_the_operator_message(tmp_path, dp):
    token = dp.admin.create_token()
    first = Node(tmp_path / "a", dp, "px-first")
    first.token.write_text(token)
    assert first.run("join").returncode == 0
    second = Node(tmp_path / "b", dp, "px-second")
    second.token.write_text(token)
    r = second.run("join")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [r.stderr.strip()]
    assert "bootstrap token refused (HTTP 401)" in r.stderr and "already used" in r.stderr
    assert "create a new token and run 'plexd join' again" in r.stderr
    assert second.token.exists() and second.identity() is None
    assert not (second.data / "identity.json").exists()


def test_join_on_a_registered_node_confirms_by_node_secret(tmp_path, dp):
    node = Node(tmp_path / "a", dp, "px-confirm")
    node.token.write_text(dp.admin.create_token())
    assert node.run("join").returncode == 0
    ident = node.identity()
    r = node.run("join")
    assert r.returncode == 0, r.stderr
    assert f"already registered as node {ident.node_id}" in r.stdout and "confirmed" in r.stdout
    assert node.identity() == ident
    assert [e["msg"] for e in registrations(dp)] == ["node registered", "node re-registered with its node secret"]


def test_up_re_registers_after_the_devplane_forgets_the_node(tmp_path, dp):
    node = Node(tmp_path / "a", dp, "px-forgotten")
    node.token.write_text(dp.admin.create_token())
    assert node.run("join").returncode == 0
    old = node.identity()
    dp.admin.forget_node(old.node_id)
    assert dp.admin.nodes() == []

    # The forgotten node's secret is refused (401); plexd re-registers, first with its node secret (refused
    # too: the devplane no longer knows it), then afresh with the new bootstrap token it is given.
    proc = node.up(PLEXD_BOOTSTRAP_TOKEN=dp.admin.create_token())
    try:
        wait_until(lambda: len(dp.admin.nodes()) == 1, what="re-registration")
        # One read per try: a save with a new key retracts identity.json first (its commit marker), so a second
        # read a moment after the first can find no identity at all.
        wait_until(lambda: getattr(node.identity(), "node_id", old.node_id) != old.node_id,
                   what="new identity saved")
    except Exception as exc:  # any failure, not only a timed-out wait: the daemon must never outlive the test
        _, err = stop(proc)
        raise AssertionError(f"{exc!r}; the daemon said:\n{err[:5000]}\n...\n{err[-3000:]}") from None
    rc, err = stop(proc)
    assert rc == 0, err
    new = node.identity()
    assert "re-registration refused" in err
    assert new.node_id != old.node_id and new.node_secret_key != old.node_secret_key
    assert dp.admin.nodes() == []  # deregistered on SIGTERM (shutdown.deregister defaults to true)
    record = dp.admin.node(new.node_id)
    assert record["hostname"] == "px-forgotten" and record["status"] == "deregistered"
    assert record["public_key"] == new.public_key


def test_join_after_forget_registers_afresh_with_a_new_token(tmp_path, dp):
    node = Node(tmp_path / "a", dp, "px-rejoin")
    node.token.write_text(dp.admin.create_token())
    assert node.run("join").returncode == 0
    old = node.identity()
    dp.admin.forget_node(old.node_id)

    r = node.run("join")  # no token available: say so in one line, keep the identity
    assert r.returncode == 1 and "no longer accepts this node's secret" in r.stderr
    assert "no bootstrap token" in r.stderr and node.identity() == old

    fresh_token = tmp_path / "new-token"
    fresh_token.write_text(dp.admin.create_token())
    r = node.run("join", "--token-file", str(fresh_token))
    assert r.returncode == 0, r.stderr
    new = node.identity()
    assert f"no longer knew node {old.node_id}; registered afresh" in r.stdout
    assert [n["id"] for n in dp.admin.nodes()] == [new.node_id]
    assert not fresh_token.exists()


def test_join_prompts_for_the_token_on_a_tty_without_echo(tmp_path, dp):
    import fcntl
    import pty
    import select
    import termios

    node = Node(tmp_path / "a", dp, "px-tty")
    token = dp.admin.create_token()
    master, slave = pty.openpty()

    def make_controlling_tty() -> None:  # getpass talks to /dev/tty, which needs a controlling terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([PLEXD, "join"], env=node.env(), stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=make_controlling_tty)
    os.close(slave)
    seen = b""

    def read_until(marker: bytes | None, timeout: float = 20) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker is None or marker not in seen:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} in {seen!r}")
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    return
                if not chunk:
                    return
                seen += chunk

    try:
        read_until(b"Bootstrap token (input hidden): ")
        os.write(master, token.encode() + b"\n")
        read_until(None)
        assert proc.wait(20) == 0, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert b"registered as node" in seen
    assert token.encode() not in seen  # never echoed
    assert node.identity().node_id == dp.admin.nodes()[0]["id"]


def test_deregister_keeps_the_identity_to_rejoin_and_purge_revokes_it(tmp_path, dp):
    node = Node(tmp_path / "a", dp, "px-leaving")
    node.token.write_text(dp.admin.create_token())
    assert node.run("join").returncode == 0
    ident = node.identity()

    r = node.run("deregister", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc == {"by_daemon": False, "node_id": ident.node_id, "deregistered": True, "error": "",
                   "torn_down": True, "purge": None}
    assert dp.admin.node(ident.node_id)["status"] == "deregistered" and dp.admin.nodes() == []
    assert node.identity() == ident and (node.data / "deregistered").exists()  # kept to rejoin

    # No new token: the node comes back with its secret, as the same node with the same mesh IP.
    assert not node.token.exists()
    r = node.run("join", "--json")
    assert r.returncode == 0, r.stderr
    back = json.loads(r.stdout)
    assert (back["node_id"], back["mesh_ip"], back["outcome"]) == (ident.node_id, ident.mesh_ip, "confirmed")
    assert dp.admin.node(ident.node_id)["status"] == "online" and not (node.data / "deregistered").exists()

    node.token.write_text("leftover")  # the purge removes a token file that is still there
    r = node.run("deregister", "--purge")
    assert r.returncode == 0, r.stderr
    assert f"node {ident.node_id} deregistered" in r.stdout
    assert f"purged: removed {node.data}" in r.stdout and f"purged: removed the bootstrap token file {node.token}" \
        in r.stdout and "skipped: systemd is not running here" in r.stdout
    assert not node.data.exists() and not node.token.exists()
    # a purge revokes: the secret no longer re-registers, and the mesh IP is free again
    assert dp.admin.node(ident.node_id)["status"] == "removed"
    with httpx.Client() as http:
        refused = http.post(f"{dp.url}/v1/register", headers={"Authorization": f"Bearer {ident.node_secret_key}"},
                            json={"token": "", "public_key": ident.public_key, "hostname": "px-leaving"})
    assert refused.status_code == 401

    r = node.run("deregister")
    assert r.returncode == 1 and "not registered" in r.stderr and "Traceback" not in r.stderr


def test_deregister_with_the_control_plane_down_changes_nothing_unless_forced(tmp_path, dp):
    node = Node(tmp_path / "a", dp, "px-stranded")
    node.token.write_text(dp.admin.create_token())
    assert node.run("join").returncode == 0
    ident = node.identity()
    dp.stop()

    r = node.run("deregister", "--purge")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "did not take the deregistration" in r.stderr and "Nothing was changed" in r.stderr \
        and "--force" in r.stderr
    assert node.identity() == ident  # everything in place

    r = node.run("deregister", "--purge", "--force")
    assert r.returncode == 0, r.stderr
    assert f"node {ident.node_id} was NOT deregistered" in r.stdout and "--force" in r.stdout
    assert f"purged: removed {node.data}" in r.stdout and not node.data.exists()


def test_deregister_purge_through_the_daemon_removes_the_daemons_own_data_dir(tmp_path, dp):
    """The daemon was started with another data_dir than the command's (a --data-dir, a PLEXD_DATA_DIR): the purge
    removed the command's (nothing there) and the daemon's private key and node secret stayed."""
    node = Node(tmp_path / "a", dp, "px-purged")
    node.token.write_text(dp.admin.create_token())
    assert node.run("join").returncode == 0
    ident = node.identity()
    proc = node.up()
    try:
        wait_until(lambda: json.loads(node.run("status", "--json").stdout or "{}").get("daemon", {}).get("running"),
                   what="the daemon's socket")
        elsewhere = tmp_path / "not-the-daemons"
        r = node.run("deregister", "--purge", "--json", PLEXD_DATA_DIR=str(elsewhere))
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["by_daemon"] and doc["node_id"] == ident.node_id and "paths" not in doc
        assert f"removed {node.data} (identity, keys, caches, journals)" in doc["purge"]["done"], doc
        _, err = proc.communicate(timeout=30)  # the daemon stops by itself after the deregistration
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            stop(proc)
    assert not node.data.exists() and not elsewhere.exists()


# -- the platform contract, and choosing it (api.dialect: auto) -------------------------------------------------

@pytest.fixture
def platform_dp(tmp_path):
    with Devplane(tmp_path / "platform-devplane", dialect="platform") as plane:
        yield plane


def test_auto_registers_with_a_platform_control_plane_and_keeps_the_nsk_secret(tmp_path, platform_dp):
    node = Node(tmp_path / "a", platform_dp, "px-platform")
    token = platform_dp.admin.create_token()
    node.token.write_text(token)
    r = node.run("join")
    assert r.returncode == 0, r.stderr
    doc = json.loads((node.data / "identity.json").read_text())
    assert doc["dialect"] == "platform" and doc["signing_key_id"] and doc["domain_mesh_cidr"]
    ident = node.identity()
    assert ident.bearer.startswith("nsk_plexd_") and mode(node.data / "node_secret_key") == 0o600
    assert ident.node_secret_key not in r.stdout + r.stderr and token not in r.stdout + r.stderr
    (listed,) = platform_dp.admin.nodes()
    assert (listed["id"], listed["hostname"]) == (ident.node_id, "px-platform")  # the hostname is the handle
    assert not node.token.exists()

    # the token is spent: a second node with it is refused, and the line names the platform's reason
    other = Node(tmp_path / "b", platform_dp, "px-platform-b")
    other.token.write_text(token)
    r = other.run("join")
    assert r.returncode == 1 and "token_consumed" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert other.identity() is None and other.token.exists()


def test_a_wrong_guess_is_corrected_by_the_answer_and_saves_nothing(tmp_path, dp, platform_dp):
    # A token of the platform's form given to a spec control plane: the spec control plane's refusal (not
    # problem+json) says which contract it speaks; asked again in it, the unknown token is refused as such.
    node = Node(tmp_path / "a", dp, "px-guess")
    node.token.write_text("psb_dev_aebagbafaydqqbrhibbsa3kqaq_node_" + "a" * 26)
    r = node.run("join")
    assert r.returncode == 1 and "bootstrap token refused (HTTP 401)" in r.stderr, r.stderr
    assert node.identity() is None and not (node.data / "identity.json").exists() and node.token.exists()

    # A node told to speak spec to a platform control plane: one line naming what was refused, nothing saved.
    told = Node(tmp_path / "b", platform_dp, "px-told")
    told.config.write_text(told.config.read_text().replace("allow_insecure: true", "allow_insecure: true, "
                                                                                 "dialect: spec"))
    told.token.write_text(platform_dp.admin.create_token())
    r = told.run("join")
    # (the spec request is gzipped, which the platform does not read: refused as malformed either way)
    assert r.returncode == 1 and "rejected the registration request" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "correlation id" in r.stderr
    assert told.identity() is None and told.token.exists()
    assert platform_dp.admin.nodes() == []
