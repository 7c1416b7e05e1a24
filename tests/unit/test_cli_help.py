"""The CLI as a newcomer meets it: `--help` says how to start and lists the commands; `plexd status` answers in
words and in JSON without a daemon or network (issue 3, CLI)."""

from __future__ import annotations

import base64
import json

import pytest

from plexd.base.wgkeys import generate_private_key
from plexd.cli import main
from plexd.identity.identity_store import Identity, IdentityStore


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_shows_first_steps_and_commands(capsys):
    out = help_text(capsys)
    assert "plexd join --api" in out and "plexd up" in out and "plexd status" in out
    for command in ("join", "up", "status", "config", "deregister"):
        assert f"    {command}" in out, command
    assert "PLEXD_" in out and "config show" in out


@pytest.mark.parametrize("argv,fragments", [
    (("join",), ("--token-file", "--token-env", "asked for on a terminal", "--json")),
    (("status",), ("--json", "Ask the running daemon over its socket", "Without a running daemon")),
    (("up",), ("SIGINT or SIGTERM",)),
    (("config", "show"), ("--json", "Secrets are hidden")),
])
def test_command_help_explains_itself(capsys, argv, fragments):
    out = " ".join(help_text(capsys, *argv).split())  # argparse wraps lines
    for fragment in fragments:
        assert fragment in out, (argv, fragment)


def test_status_in_words_and_json_hides_secrets(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PLEXD_CONFIG", "/dev/null")
    data = tmp_path / "data"
    argv = ["--api", "https://cp.example:8080", "--data-dir", str(data), "status"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "registered:     no (run 'plexd join')" in out and "https://cp.example:8080" in out

    ident = Identity(node_id="n_status", mesh_ip="10.100.0.9", signing_public_key=base64.b64encode(b"k" * 32).decode(),
                     node_secret_key="S3cr3t" * 5 + "xy", private_key=generate_private_key())
    IdentityStore(data).save(ident)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "registered:     yes" in out and "n_status" in out and "10.100.0.9" in out
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["registered"] is True and doc["node_id"] == "n_status" and doc["mesh_ip"] == "10.100.0.9"
    assert doc["control_plane"] == "https://cp.example:8080" and doc["data_dir"] == str(data)
    assert "S3cr3t" not in json.dumps(doc) and ident.private_key_b64 not in json.dumps(doc)
