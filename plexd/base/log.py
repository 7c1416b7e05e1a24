"""Logging setup: JSON lines when stderr is not a terminal (journald, files, tests), a readable line on a TTY.

Modules log through ``logging.getLogger(__name__)`` and pass structured fields with ``extra={...}``; the JSON
formatter emits them as keys, the human formatter appends them as ``key=value``. Secrets never go into a log:
log ``fingerprint(secret)`` instead, a short tag that lets two log lines be matched without revealing the value.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Mapping
from typing import IO, Any

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
          "error": logging.ERROR}

# Attributes every LogRecord has; anything else on a record came from `extra=` and is a structured field.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime",
                                                                                       "taskName"}


def fingerprint(secret: str | bytes) -> str:
    """A short, non-reversible tag for a secret (``fp:1a2b3c4d``): first 8 hex digits of its SHA-256.

    Eight hex digits cannot be inverted to a high-entropy token or key, yet tell two different secrets apart.
    """
    data = secret.encode() if isinstance(secret, str) else secret
    if not data:
        return "fp:empty"
    return "fp:" + hashlib.sha256(data).hexdigest()[:8]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (RFC 3339 UTC), level, logger, msg, then the structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out: dict[str, Any] = {"ts": ts, "level": record.levelname.lower(), "logger": record.name,
                               "msg": record.getMessage()}
        for key, value in _fields(record).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class HumanFormatter(logging.Formatter):
    """``12:00:01 INFO  plexd.node.agent: registered node_id=n_1`` for people watching a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{ts} {record.levelname:<5} {record.name}: {record.getMessage()}"
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JournalPriority(logging.Formatter):
    """Another formatter's line with sd-daemon(3)'s ``<N>`` prefix: journald stores the line at syslog priority
    N (so ``journalctl -p warning`` filters) and strips the prefix."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        prefix = priority_prefix(record.levelno)
        return "\n".join(prefix + line for line in self.inner.format(record).split("\n"))


def setup_logging(level: str = "info", stream: IO[str] | None = None, *, json_lines: bool | None = None) -> None:
    """Route the root logger to `stream` (stderr) at `level`; JSON unless the stream is a terminal; with
    journald priority prefixes when stderr is the journal stream systemd gave us."""
    stream = stream if stream is not None else sys.stderr
    if json_lines is None:
        json_lines = not (hasattr(stream, "isatty") and stream.isatty())
    handler = logging.StreamHandler(stream)
    formatter: logging.Formatter = JsonFormatter() if json_lines else HumanFormatter()
    if _is_journal(stream):
        formatter = JournalPriority(formatter)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    RECENT.setLevel(logging.INFO)  # debug lines would crowd out what matters within the buffer
    root.addHandler(RECENT)
    root.setLevel(LEVELS.get(level.lower(), logging.INFO))
    # httpx logs every request at INFO, with full URLs; keep that for debug runs only.
    logging.getLogger("httpx").setLevel(logging.DEBUG if level.lower() == "debug" else logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


# syslog(3) priorities of sd-daemon(3)'s "<N>" line prefixes, which journald reads from a service's stderr.
PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def priority_prefix(levelno: int) -> str:
    level = max((lvl for lvl in PRIORITIES if lvl <= levelno), default=logging.DEBUG)
    return f"<{PRIORITIES[level]}>"


def _is_journal(stream: IO[str], env: Mapping[str, str] | None = None) -> bool:
    """True when `stream` is the one systemd connected to the journal ($JOURNAL_STREAM is "device:inode")."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (AttributeError, OSError, ValueError):  # a StringIO in tests has no descriptor
        return False


class RecentLines(logging.Handler):
    """The last `size` log lines in memory (JSON), for ``diagnostics.collect``: what an operator would ask for
    first, without reading files the daemon may not own (the journal)."""

    def __init__(self, size: int = 500) -> None:
        super().__init__(logging.DEBUG)
        self.lines: deque[str] = deque(maxlen=size)
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # never let a diagnostics buffer break logging
            self.handleError(record)


RECENT = RecentLines()


def recent_lines(limit: int = 200) -> list[str]:
    return list(RECENT.lines)[-limit:]
