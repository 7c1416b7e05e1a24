"""`plexd --help` is a newcomer's first screen: it must say how to start and list the commands (issue 3, CLI)."""

from __future__ import annotations

import pytest

from plexd.cli import main


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
    (("status",), ("--json", "Reads local files only")),
    (("up",), ("SIGINT or SIGTERM",)),
    (("config", "show"), ("--json", "Secrets are hidden")),
])
def test_command_help_explains_itself(capsys, argv, fragments):
    out = " ".join(help_text(capsys, *argv).split())  # argparse wraps lines
    for fragment in fragments:
        assert fragment in out, (argv, fragment)
