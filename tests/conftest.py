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


NOBODY = 65534


@pytest.fixture
def run_as_nobody():
    """Run `fn()` in a forked child that has dropped to uid/gid 65534 with no supplementary groups; return (its
    exit status, what it printed). A fork rather than an exec: uid 65534 cannot read this venv's interpreter
    under /root, so the code under test (imported before the call) runs in the child as it is."""
    import sys

    def run(fn) -> tuple[int, str]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            rc = 99
            try:
                os.close(r)
                os.dup2(w, 1)
                os.dup2(w, 2)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                rc = int(fn() or 0)
            except BaseException as exc:
                print(f"child failed: {exc!r}")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        os.close(w)
        chunks = []
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()

    return run
