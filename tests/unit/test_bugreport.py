"""`plexd bugreport`'s parts: the secret scrub, the archive file itself, and a section that fails. The real command
against a planted data_dir (and a daemon whose answers leak) is in tests/integration/test_doctor_cli.py.

Stand-ins: systemd as PID 1 (`booted`) and journalctl's answer (recorded: plexd.service has no journal on these
machines), and doctor's report (its checks are tested in tests/unit/test_doctor.py).
"""

from __future__ import annotations

import base64
import io
import json
import os
import stat
import tarfile

import pytest

from plexd.base.errors import PlexdError
from plexd.base.wgkeys import generate_private_key
from plexd.config import settings
from plexd.identity.identity_store import Identity, IdentityStore
from plexd.node import bugreport as br
from plexd.node.doctor import Report
from plexd.node.doctor_checks import Ran

SIGNING = base64.b64encode(b"\x05" * 32).decode()


def config(tmp_path, text: str = "", token: str = ""):
    path = tmp_path / "config.yaml"
    path.write_text(f"api: {{url: https://cp.example:8443}}\ndata_dir: {tmp_path / 'data'}\n"
                    f"token: {{file: {tmp_path / 'token'}, value: '{token}'}}\n"
                    f"node_api: {{socket_path: {tmp_path / 'api.sock'}}}\nmesh: {{interface: pxbr-unit}}\n{text}")
    return settings.load(str(path), env={})


def no_doctor(config):
    return Report(config.config_file, [])


def read_archive(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()}


def test_scrub_replaces_each_secret_and_its_json_form():
    secrets = ['s3cr3t"quoted\\value', "plainsecretvalue"]
    data = json.dumps({"a": secrets[0], "b": f"x {secrets[1]} y"}).encode() + b"\n" + secrets[0].encode()
    out, hits = br.scrub(data, secrets)
    assert hits == 3 and b"s3cr3t" not in out and b"plainsecret" not in out
    assert out.count(br.REDACTED.encode()) == 3


def test_known_secrets_come_from_the_node(tmp_path, monkeypatch):
    cfg = config(tmp_path, token="plx_enroll_inline_token_0123")
    identity = Identity("n_1", "10.100.0.2", SIGNING, "node-secret-" + "x" * 20, generate_private_key(),
                        "hkdf-sha256")
    IdentityStore(cfg.data_dir).save(identity)
    (tmp_path / "token").write_text("plx_enroll_from_file_4567\n")
    monkeypatch.setenv("PLEXD_BOOTSTRAP_TOKEN", "plx_enroll_from_env_89ab")
    found = br.known_secrets(cfg)
    for secret in (identity.private_key_b64, identity.node_secret_key, identity.bearer, "plx_enroll_inline_token_0123",
                   "plx_enroll_from_file_4567", "plx_enroll_from_env_89ab"):
        assert secret in found


def test_a_leaking_log_line_is_scrubbed_and_counted(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    identity = Identity("n_1", "10.100.0.2", SIGNING, "node-secret-" + "y" * 20, generate_private_key())
    IdentityStore(cfg.data_dir).save(identity)
    monkeypatch.setattr("plexd.system.systemd.booted", lambda: True)  # stand-in: systemd as PID 1

    def run(argv, timeout=None):
        if argv[0] == "journalctl":
            assert argv[argv.index("-n") + 1] == "7"
            return Ran(0, f"plexd[1]: a hook printed {identity.node_secret_key}\n", "")
        return Ran(1, "", "Error: No such file or directory")

    out = tmp_path / "report.tar.gz"
    doc = br.bugreport(cfg, str(out), 7, run=run, doctor=no_doctor)
    files = read_archive(out)
    assert doc["secrets_scrubbed"] == 1 and identity.node_secret_key.encode() not in out.read_bytes()
    assert f"a hook printed {br.REDACTED}".encode() in files["log.txt"]
    assert "journalctl -u plexd.service" in dict((s["name"], s["note"]) for s in doc["sections"])["log.txt"]


def test_the_archive_is_0600_whatever_the_umask_and_replaces_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me")
    link = tmp_path / "report.tar.gz"
    link.symlink_to(target)
    old = os.umask(0)
    try:
        br.write_archive(str(link), [br.Section("a.txt", b"hello")], "root")
    finally:
        os.umask(old)
    assert target.read_text() == "keep me"  # the link itself was replaced, nothing written through it
    st = os.lstat(link)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert read_archive(link) == {"a.txt": b"hello"}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_unwritable_output_and_bad_lines_are_one_line_errors(tmp_path):
    cfg = config(tmp_path)
    with pytest.raises(PlexdError, match=r"cannot write the bug report .*/missing/r.tar.gz: No such file"):
        br.bugreport(cfg, str(tmp_path / "missing" / "r.tar.gz"), run=lambda *a, **k: Ran(1, "", ""),
                     doctor=no_doctor)
    with pytest.raises(PlexdError, match="--lines 0: give 1 to 100000"):
        br.bugreport(cfg, str(tmp_path / "r.tar.gz"), 0)


def test_a_failing_section_is_that_sections_content(tmp_path, monkeypatch):
    def broken(config):
        raise RuntimeError("device exploded")

    monkeypatch.setattr(br, "_peers", broken)
    sections = {s.name: s for s in br.collect(config(tmp_path), 10, run=lambda *a, **k: Ran(0, "[]", ""),
                                              doctor=no_doctor)}
    assert json.loads(sections["peers.json"].data) == {"error": "RuntimeError: device exploded"}
    assert sections["peers.json"].note == "failed: device exploded"
    assert json.loads(sections["status.json"].data)["daemon"] == {"running": False}


def test_a_password_in_a_url_is_hidden(tmp_path):
    cfg = config(tmp_path, "telemetry: {queue_dir: ''}\n")
    doc = br._config(cfg)
    assert doc["settings"]["api.url"]["value"] == "https://cp.example:8443"
    assert br._without_password("https://ops:hunter22@cp.example/") == f"https://ops:{br.REDACTED}@cp.example/"


def test_sections_go_in_as_files_of_one_directory(tmp_path):
    out = tmp_path / "x.tar.gz"
    br.write_archive(str(out), [br.Section("one.json", b"{}"), br.Section("two.txt", b"2")], "plexd-bugreport-x")
    with tarfile.open(out) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["plexd-bugreport-x/one.json", "plexd-bugreport-x/two.txt"]
    assert all(m.mode == 0o600 and m.uname == "root" for m in members)
    assert io.BytesIO(out.read_bytes()).read(2) == b"\x1f\x8b"  # gzip
