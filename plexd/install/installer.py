"""``plexd install`` and ``plexd uninstall [--purge]`` (docs/protocol.md §11.3–11.4, done more carefully).

Everything is placed under `root` ("/" on a real machine; a scratch directory in tests), each path with its
mode. Install creates what is missing and never overwrites an operator's config; uninstall removes what install
made, and with `--purge` also the data, the config and the groups. Every step says what it did or skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from plexd.base.errors import PlexdError
from plexd.system.steps import StepReport
from plexd.system.systemd import booted, systemctl

UNIT_NAME = "plexd.service"
UNIT_DIR = "etc/systemd/system"
LINK = "usr/local/bin/plexd"
GROUPS = ("plexd", "plexd-secrets", "plexd-admin")  # the socket's, the secrets', the control routes'
# opt/plexd/releases: upgrade.dir's default, the one path the unit lets the daemon write under /opt (the venv
# stays read-only); it must exist before the unit starts, since ProtectSystem=strict forbids creating it then.
DIRECTORIES = (("etc/plexd", 0o755), ("etc/plexd/hooks.d", 0o755), ("var/lib/plexd", 0o700),
               ("run/plexd", 0o755), ("opt/plexd/releases", 0o755))
CONFIG = "etc/plexd/config.yaml"
TOKEN = "etc/plexd/bootstrap-token"
DEFAULT_EXEC = "/usr/local/bin/plexd"

DEFAULT_CONFIG = """\
# plexd configuration; every key, its default and where a value came from: 'plexd config show'.
# The control plane ('plexd join --api URL' writes it here):
{api}
# log_level: info
# shutdown:
#   deregister: true    # a stop (and so a reboot) leaves the mesh; the next start rejoins as the same node
#   drain: 30s          # running actions get this long at a stop
"""


def unit_text(exec_path: str) -> str:
    """The packaged unit, pointed at `exec_path`."""
    text = resources.files("plexd.install").joinpath(UNIT_NAME).read_text(encoding="utf-8")
    return text.replace(f"ExecStart={DEFAULT_EXEC} up", f"ExecStart={exec_path} up")


def entry_point() -> str:
    """The `plexd` this Python runs from (a venv's bin/plexd), the path the unit should start."""
    candidate = Path(sys.prefix) / "bin" / "plexd"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("plexd")
    if found:
        return os.path.realpath(found)
    raise PlexdError("cannot find the installed plexd entry point; pass --exec PATH")


def install(root: str = "/", *, exec_path: str | None = None, api: str = "", token_file: str = "",
            systemd: bool | None = None) -> StepReport:
    _require_root()
    base = Path(root)
    exec_path = exec_path or entry_point()
    if exec_path.startswith(("/home/", "/root/")):
        raise PlexdError(f"{exec_path} is under a home directory, which the unit hides (ProtectHome=yes): install "
                         "plexd into a venv under /opt/plexd (see the README)")
    report = StepReport()
    for group in GROUPS:
        _group(base, group, add=True, report=report)
    for rel, mode in DIRECTORIES:
        path = base / rel
        if path.is_dir():
            report.skipped.append(f"/{rel} exists")
        else:
            path.mkdir(parents=True, exist_ok=True)
            report.done.append(f"created /{rel} ({mode:04o})")
        os.chmod(path, mode)
    config = base / CONFIG
    if config.exists():
        report.skipped.append(f"/{CONFIG} exists: left as it is")
    else:
        line = f"api: {api}" if api else "# api: https://cp.example.com"
        _write(config, DEFAULT_CONFIG.format(api=line), 0o644)
        report.done.append(f"wrote a default /{CONFIG} (0644)")
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise PlexdError(f"--token-file {token_file}: {exc.strerror}") from None
        _write(base / TOKEN, token, 0o600)
        report.done.append(f"wrote the bootstrap token to /{TOKEN} (0600)")
    unit = base / UNIT_DIR / UNIT_NAME
    unit.parent.mkdir(parents=True, exist_ok=True)
    _write(unit, unit_text(exec_path), 0o644)
    report.done.append(f"wrote /{UNIT_DIR}/{UNIT_NAME} (ExecStart={exec_path} up)")
    link = base / LINK
    if exec_path != f"/{LINK}":
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or not link.exists():
            link.unlink(missing_ok=True)
            link.symlink_to(exec_path)
            report.done.append(f"linked /{LINK} -> {exec_path}")
        else:
            report.skipped.append(f"/{LINK} is a file, not plexd's link: left as it is")
    _systemctl(root, systemd, report, ["daemon-reload"])
    return report


def uninstall(root: str = "/", *, purge: bool = False, systemd: bool | None = None,
              daemon_running: bool = False) -> StepReport:
    _require_root()
    base = Path(root)
    report = StepReport()
    unit = base / UNIT_DIR / UNIT_NAME
    if daemon_running and not _on_systemd(root, systemd):
        raise PlexdError("a plexd daemon is running: stop it first ('plexd deregister', or SIGTERM)")
    if unit.exists():
        _systemctl(root, systemd, report, ["disable", "--now", UNIT_NAME])
        unit.unlink()
        report.done.append(f"removed /{UNIT_DIR}/{UNIT_NAME}")
        _systemctl(root, systemd, report, ["daemon-reload"])
    else:
        report.skipped.append(f"no /{UNIT_DIR}/{UNIT_NAME}")
    link = base / LINK
    if link.is_symlink():
        link.unlink()
        report.done.append(f"removed the link /{LINK}")
    else:
        report.skipped.append(f"/{LINK} is not plexd's link")
    if purge:
        for rel in ("var/lib/plexd", "etc/plexd", "run/plexd", "opt/plexd/releases"):
            path = base / rel
            if path.exists():
                shutil.rmtree(path)
                report.done.append(f"removed /{rel}")
            else:
                report.skipped.append(f"/{rel} does not exist")
        for group in GROUPS:
            _group(base, group, add=False, report=report)
    return report


def _require_root() -> None:
    if os.geteuid() != 0:
        raise PlexdError("plexd install and uninstall need root (they create system groups, /etc/plexd and the "
                         "systemd unit)")


def _on_systemd(root: str, systemd: bool | None) -> bool:
    return root == "/" and (systemd if systemd is not None else booted())


def _systemctl(root: str, systemd: bool | None, report: StepReport, args: list[str]) -> None:
    if not _on_systemd(root, systemd):
        report.skipped.append(f"systemctl {' '.join(args)} (systemd is not running here)")
        return
    error = systemctl(*args)
    if not error:
        report.done.append(f"systemctl {' '.join(args)}")
    else:
        report.skipped.append(f"systemctl {' '.join(args)} failed: {error}")


def _group(base: Path, name: str, *, add: bool, report: StepReport) -> None:
    exists = _group_exists(base, name)
    if add == exists:
        report.skipped.append(f"group {name} {'exists' if exists else 'does not exist'}")
        return
    prefix = ["--prefix", str(base)] if str(base) != "/" else []
    cmd = ["groupadd", "--system", *prefix, name] if add else ["groupdel", *prefix, name]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PlexdError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.returncode}")
    report.done.append(f"{'created' if add else 'removed'} group {name}")


def _group_exists(base: Path, name: str) -> bool:
    try:
        lines = (base / "etc/group").read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    return any(line.split(":", 1)[0] == name for line in lines)


def _write(path: Path, text: str, mode: int) -> None:
    from plexd.base.atomicfile import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode(), mode=mode)
