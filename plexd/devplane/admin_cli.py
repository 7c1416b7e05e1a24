"""`plexd-devplane admin ...`: the admin API from a shell (tables by default, `--json` for scripts)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:  # filled in below
    pass
