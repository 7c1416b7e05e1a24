"""Suite-wide guards: root-only tests never skip silently in CI, nothing is left behind, and the suite runs in
parallel where the tests allow it.

Every e2e test needs root (network namespaces, wireguard-go). Outside CI a non-root run skips them with a
reason; in CI (CI=true, which runs as root) a missing privilege is a failure, never a silent skip.

Parallel runs (pytest-xdist, `make test` uses `-n 4 --dist loadfile`): labs have names of their own
(plexd.devplane.lab), so they run side by side; the tests of one file stay on one worker (their module fixtures
are built once). The files that run daemons in the root network namespace itself (its `inet plexd` table,
`plexd0`) are marked as one xdist group, which pytest-xdist 3.8 ignores under pytest 9 (its `--dist loadgroup`
kept no group together), so they may run at the same time.

At the end of the whole run (once, in the controlling process, after every worker is done) we fail if any lab
namespace, wireguard-go, plexd, devplane or coturn process, root-namespace link, route or routing rule, or the
root namespace's `inet plexd` table that was not there before the tests is still there.
"""

from __future__ import annotations

import base64
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from nacl.public import PrivateKey
from process_helpers import run_as

from plexd.devplane.harness import Devplane

IS_ROOT = os.geteuid() == 0
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Set by scripts/kernel-vm-guest.sh: this run is the kernel tier, inside a VM booting Debian's stock kernel.
IN_KERNEL_VM = os.environ.get("PLEXD_KERNEL_VM") == "1"


# Files whose tests run plexd (or its firewall) in the root network namespace: one worker, one at a time.
ROOT_NAMESPACE_FILES = frozenset({
    "integration/test_action_runner.py", "integration/test_cli_errors.py", "integration/test_cli_up.py",
    "integration/test_connected_agent.py", "integration/test_events_devplane.py", "integration/test_local_api.py",
    "integration/test_node_api_socket.py", "integration/test_reconcile_cli.py",
    "integration/test_registration_devplane.py", "integration/test_registration_retry.py",
    "integration/test_telemetry_sources.py", "integration/test_upgrade_install.py", "integration/test_install.py",
    "security/test_bootstrap_token.py", "security/test_node_api_leaks.py", "security/test_node_api_reports.py",
    "security/test_node_api_tcp.py", "security/test_node_secret_kdf.py", "security/test_trusted_dirs.py",
})
# seconds, for a lab test that does not name its own (pyproject's default is for the rest); the kernel tier runs
# under an emulated CPU (QEMU's TCG: Python about 16x slower), where a lab test gets the longer window
LAB_TIMEOUT = 900 if IN_KERNEL_VM else 240
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    _select_tier(config, items)
    for item in items:
        relative = Path(str(item.fspath)).relative_to(TESTS).as_posix()
        if relative.startswith("e2e/") or item.get_closest_marker("root"):
            item.add_marker(pytest.mark.root)
            # In CI a non-root run lets the test run and fail on its own: never a silent skip there.
            if not IS_ROOT and not IN_CI:
                item.add_marker(pytest.mark.skip(reason="needs root and network namespaces"))
        if relative.startswith("e2e/") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LAB_TIMEOUT))
        group = "root-namespace" if relative in ROOT_NAMESPACE_FILES else relative
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_ignore_collect(collection_path, config):
    """In the kernel tier, a test file that holds no kernel-tier test is not even imported: on the VM's emulated
    CPU, importing the whole suite to deselect it took minutes. (The marker still decides; this only skips files
    that name neither the mark nor the backend lists that carry it.)"""
    if IN_KERNEL_VM and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        text = collection_path.read_text()
        return not ("mark.kernel" in text or "BACKENDS" in text) or None
    return None


def _select_tier(config, items) -> None:
    """The kernel tier's tests (marked `kernel`) run inside the kernel VM and only there (`make test-kernel`, part of
    `make test`); every other test runs on the host only. Deselected, never skipped: the summary says where they run.
    """
    keep, moved = [], []
    for item in items:
        (keep if (item.get_closest_marker("kernel") is not None) == IN_KERNEL_VM else moved).append(item)
    if moved:
        config.hook.pytest_deselected(items=moved)
        items[:] = keep
        config.stash[_TIER_NOTE] = (
            f"{len(moved)} host-tier tests deselected: this is the kernel tier (the host runs them)" if IN_KERNEL_VM
            else f"{len(moved)} kernel-tier tests deselected: they run in the kernel VM (make test-kernel)")


_TIER_NOTE = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _TIER_NOTE in config.stash:
        terminalreporter.write_line(config.stash[_TIER_NOTE])


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


_WATCHED = ("wireguard-go", "plexd up", "plexd-devplane", "plexd.devplane.devplane_cli", "turnserver")


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2}


def _root_routes() -> set[str]:
    out = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True,
                         check=False).stdout
    # the kernel's local/broadcast entries of an address come and go with it: the addresses are what we check
    return {" ".join(line.split()) for line in out.splitlines() if line.strip() and not line.startswith(
        ("local ", "broadcast ", "multicast ", "fe80::", "ff00::"))}


def _root_rules() -> set[str]:
    rules = set()
    for family in ("-4", "-6"):
        out = subprocess.run(["ip", family, "rule", "show"], capture_output=True, text=True, check=False).stdout
        rules.update(f"{family} {' '.join(line.split())}" for line in out.splitlines() if line.strip())
    return rules


def _snapshot() -> dict[str, object]:
    return {"netns": _netns(), "procs": _processes(_WATCHED), "table": _plexd_table(), "links": _root_links(),
            "routes": _root_routes(), "rules": _root_rules()}


def _leaks(before: dict) -> list[str]:
    problems = []
    leaked_ns = sorted(n for n in _netns() - before["netns"] if n.startswith("px"))
    leaked_procs = sorted(_processes(_WATCHED) - before["procs"])
    if leaked_ns:
        problems.append(f"network namespaces left behind: {leaked_ns}")
    if leaked_procs:
        problems.append(f"processes left behind: {leaked_procs}")
    if _plexd_table() and not before["table"]:  # daemons run in the root namespace by the integration tests
        problems.append("nftables table inet plexd left behind in the root network namespace")
    links = sorted(_root_links() - before["links"])
    if links:
        problems.append(f"links left behind in the root network namespace: {links}")
    routes = sorted(_root_routes() - before["routes"])
    if routes:
        problems.append(f"routes left behind in the root network namespace: {routes}")
    rules = sorted(_root_rules() - before["rules"])
    if rules:
        problems.append(f"routing rules left behind in the root network namespace: {rules}")
    return problems


def _controller(config) -> bool:
    """The process that runs the session as a whole: the only one without xdist, the controller with it."""
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if _controller(session.config):
        session.config.stash[_BEFORE] = _snapshot()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if not _controller(session.config) or _BEFORE not in session.config.stash:
        return
    problems = _leaks(session.config.stash[_BEFORE])
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "left behind by the test run: " + "; ".join(problems)
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[dict]()


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


# -- a devplane for a module, and a node registered with it (fixtures of the tests that need no lab) ----------


@pytest.fixture(scope="module")
def devplane(tmp_path_factory):
    """A real `plexd-devplane serve` on loopback for the module's tests."""
    dp = Devplane(tmp_path_factory.mktemp("devplane"))
    dp.start()
    try:
        yield dp
    finally:
        dp.stop()


@pytest.fixture(scope="module")
def secret(devplane) -> str:
    """The node secret of a node registered with the module's devplane (no daemon behind it)."""
    token = devplane.admin.create_token()
    public = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
    resp = httpx.post(f"{devplane.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                      json={"token": token, "public_key": public, "hostname": f"px-node-{time.monotonic_ns()}"})
    resp.raise_for_status()
    return resp.json()["node_secret_key"]
