"""Suite-wide guards: root-only tests never skip silently in CI, and nothing is left behind.

Every e2e test needs root (network namespaces, wireguard-go). Outside CI a non-root run skips them with a
reason; in CI (CI=true, which runs as root) a missing privilege is a failure, never a silent skip.
At the end of the session we fail if any lab namespace, wireguard-go process or plexd process that was not
there before the tests is still alive.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from process_helpers import run_as

IS_ROOT = os.geteuid() == 0
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/e2e/" in str(item.fspath) or item.get_closest_marker("root"):
            item.add_marker(pytest.mark.root)
            # In CI a non-root run lets the test run and fail on its own: never a silent skip there.
            if not IS_ROOT and not IN_CI:
                item.add_marker(pytest.mark.skip(reason="needs root and network namespaces"))


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _processes(names: tuple[str, ...]) -> set[tuple[int, str]]:
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if any(n in cmdline for n in names) and "pytest" not in cmdline:
            found.add((int(proc.name), cmdline[:120]))
    return found


def _plexd_table() -> bool:
    if not IS_ROOT:
        return False
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
    return "inet plexd" in out


_WATCHED = ("wireguard-go", "plexd up", "plexd-devplane", "plexd.devplane.cli", "turnserver")


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    namespaces_before = _netns()
    procs_before = _processes(_WATCHED)
    table_before = _plexd_table()
    yield
    leaked_ns = sorted(n for n in _netns() - namespaces_before if n.startswith("px"))
    leaked_procs = sorted(_processes(_WATCHED) - procs_before)
    problems = []
    if leaked_ns:
        problems.append(f"network namespaces left behind: {leaked_ns}")
    if leaked_procs:
        problems.append(f"processes left behind: {leaked_procs}")
    if _plexd_table() and not table_before:  # daemons run in the root namespace by the integration tests
        problems.append("nftables table inet plexd left behind in the root network namespace")
    assert not problems, "; ".join(problems)





@pytest.fixture
def run_as_nobody():
    """`run_as` for uid/gid 65534 (nobody) with no supplementary groups."""
    return run_as


@pytest.fixture
def system_groups():
    """`make(n)` creates n throw-away groups (groupadd) and returns [(name, gid)]; all are deleted afterwards.
    Group checks resolve names through the real group database, so a test of them needs real groups."""
    import secrets
    import subprocess

    made: list[str] = []

    def make(n: int) -> list[tuple[str, int]]:
        import grp

        out = []
        for _ in range(n):
            name = f"pxt-{secrets.token_hex(4)}"
            subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
            made.append(name)
            out.append((name, grp.getgrnam(name).gr_gid))
        return out

    yield make
    for name in made:
        subprocess.run(["groupdel", name], check=False, capture_output=True)
