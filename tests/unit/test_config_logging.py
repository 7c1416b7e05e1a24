"""Logging setup chosen by config: JSON lines off a TTY, human lines on one, level from log_level."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest

from plexd.base.log import fingerprint, setup_logging


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


def test_lines_carry_journald_priorities_only_when_stderr_is_the_journal_stream(tmp_path, monkeypatch):
    """systemd sets JOURNAL_STREAM to the device:inode of the stream it gave us; journald reads sd-daemon(3)'s
    "<N>" prefixes from it, so `journalctl -p warning` filters plexd's lines."""
    with open(tmp_path / "journal", "w+") as journal, open(tmp_path / "other", "w+") as other:
        st = os.fstat(journal.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        setup_logging("debug", journal)
        log = logging.getLogger("plexd.test")
        log.debug("d")
        log.info("i")
        log.warning("w")
        log.error("e")
        journal.seek(0)
        lines = journal.read().splitlines()
        assert [line[:4] for line in lines] == ["<7>{", "<6>{", "<4>{", "<3>{"]
        assert [json.loads(line[3:])["msg"] for line in lines] == ["d", "i", "w", "e"]

        setup_logging("info", other)  # a stream that is not the journal: plain lines
        log.warning("w")
        other.seek(0)
        assert other.read().startswith("{")
