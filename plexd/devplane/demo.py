"""Interim demo: start a devplane, create a bootstrap token, show the admin view."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    return 0
