"""Logging setup chosen by config: JSON lines off a TTY, human lines on one, level from log_level."""

from __future__ import annotations

import io
import json
import logging

import pytest

from plexd.log import fingerprint, setup_logging


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_when_not_a_tty():
    out = io.StringIO()
    setup_logging("info", out)
    logging.getLogger("plexd.test").info("registered %s", "ok", extra={"node_id": "n_1", "token": fingerprint("t")})
    logging.getLogger("plexd.test").debug("hidden at info")
    (line,) = out.getvalue().splitlines()
    doc = json.loads(line)
    assert doc["level"] == "info" and doc["logger"] == "plexd.test" and doc["msg"] == "registered ok"
    assert doc["node_id"] == "n_1" and doc["token"].startswith("fp:")
    assert doc["ts"].endswith("Z")


def test_human_format_on_a_tty_and_debug_level():
    out = FakeTTY()
    setup_logging("debug", out)
    logging.getLogger("plexd.test").debug("hello", extra={"peer": "n_2"})
    text = out.getvalue()
    assert "DEBUG plexd.test: hello peer=n_2" in text
    assert not text.lstrip().startswith("{")


def test_level_warning_drops_info():
    out = io.StringIO()
    setup_logging("warning", out)
    logging.getLogger("plexd.test").info("quiet")
    logging.getLogger("plexd.test").warning("loud")
    assert [json.loads(x)["msg"] for x in out.getvalue().splitlines()] == ["loud"]
