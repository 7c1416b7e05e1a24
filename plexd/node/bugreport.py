"""`plexd bugreport`: one tar.gz an operator attaches to a ticket, and nothing in it that must stay on the node.

The archive is built only from documents made here for it, never from files copied out of data_dir or /etc/plexd:
the version, the effective config (secrets as `display_value` shows them), the daemon's status, peers and policies
(or what the CLI can say without a daemon), the `inet plexd` table, routes and rules, the last log lines, and
`plexd doctor`'s report. As a second guard, every document is scrubbed of each secret value this node holds and
the command can read (WireGuard private keys, the node secret and its bearer, the bootstrap token, token files);
none of them can then appear, whatever a log line or a future status field carries. The file is written 0600.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import platform
import socket
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from plexd import __version__
from plexd.base import boundedjson
from plexd.base.errors import PlexdError
from plexd.config.settings import Config
from plexd.node.doctor_checks import Ran, run_command

DEFAULT_LINES = 500
MAX_LINES = 100_000
DAEMON_TIMEOUT = 10.0  # seconds per question to the daemon: a wedged daemon is worth a report, not a hang
COMMAND_TIMEOUT = 15.0  # nft and ip listing a large mesh
REDACTED = "<redacted>"
MIN_SECRET = 8  # shorter "secrets" would scrub ordinary words


@dataclass(frozen=True)
class Section:
    name: str  # the file's name in the archive
    data: bytes
    note: str = ""  # where it came from, or why it is not what was asked for


def collect(config: Config, lines: int, *, run: Callable[..., Ran] = run_command,
            doctor: Callable[[Config], Any] | None = None) -> list[Section]:
    """Every section, each made on its own: one that fails is a section saying why."""
    makers: list[tuple[str, Callable[[], tuple[Any, str]]]] = [
        ("version.json", lambda: (_version(), "plexd, Python, kernel and OS versions")),
        ("config.json", lambda: (_config(config), "secrets hidden")),
        ("status.json", lambda: _status(config)),
        ("peers.json", lambda: _peers(config)),
        ("policies.json", lambda: _policies(config)),
        ("nftables.json", lambda: _command_json(run, ["nft", "-j", "list", "table", "inet", "plexd"],
                                                missing="none: this machine has no table inet plexd")),
        ("routes.json", lambda: _families(run, ["route", "show", "table", "all"])),
        ("rules.json", lambda: _families(run, ["rule", "show"])),
        ("log.txt", lambda: _log(run, lines)),
    ]
    sections = [_made(name, make) for name, make in makers]
    sections += _doctor(config, doctor)
    return sections


def _made(name: str, make: Callable[[], tuple[Any, str]]) -> Section:
    try:
        doc, note = make()
    except Exception as exc:  # one section's failure is that section's content, never a traceback
        doc, note = {"error": f"{type(exc).__name__}: {exc}"}, f"failed: {exc}"
    data = doc.encode() if isinstance(doc, str) else (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()
    return Section(name, data, note)


def _version() -> dict[str, Any]:
    os_release = {}
    try:
        with open("/etc/os-release") as f:
            os_release = dict(line.strip().partition("=")[::2] for line in f if "=" in line)
    except OSError:
        pass
    return {"plexd_version": __version__, "python": platform.python_version(), "kernel": platform.release(),
            "machine": platform.machine(), "os": os_release.get("PRETTY_NAME", "").strip('"'),
            "hostname": socket.gethostname(), "generated_at": datetime.now(UTC).isoformat(timespec="seconds")}


def _config(config: Config) -> dict[str, Any]:
    shown = config.shown()  # secrets as display_value shows them: a fingerprint, never the value
    for entry in shown.values():
        if isinstance(entry["value"], str) and "@" in entry["value"] and "://" in entry["value"]:
            entry["value"] = _without_password(entry["value"])
    return {"config_file": config.config_file, "settings": shown}


def _without_password(url: str) -> str:
    """A URL's password (https://user:pass@host) is a secret too, though no setting is marked so."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{parts.username}:{REDACTED}@{host}"))
    except ValueError:
        return REDACTED


def _status(config: Config) -> tuple[Any, str]:
    from plexd.node.control import STATUS_PATH, stored_status
    from plexd.node.control_client import DaemonNotRunning, call

    try:
        return call(config.node_api.socket_path, "GET", STATUS_PATH, admin_group=config.node_api.admin_group,
                    timeout=DAEMON_TIMEOUT), "from the running daemon"
    except DaemonNotRunning:
        return stored_status(config), "no daemon running: what data_dir says"
    except PlexdError as exc:
        return {**stored_status(config), "daemon_error": str(exc)}, f"the daemon did not answer ({exc}): data_dir"


def _policies(config: Config) -> tuple[Any, str]:
    from plexd.node.control import POLICIES_PATH
    from plexd.node.control_client import DaemonNotRunning, call

    try:
        return call(config.node_api.socket_path, "GET", POLICIES_PATH, admin_group=config.node_api.admin_group,
                    timeout=DAEMON_TIMEOUT), "from the running daemon"
    except DaemonNotRunning:
        return {"error": "no daemon running: policies are only known to it"}, "none: no daemon running"
    except PlexdError as exc:
        return {"error": str(exc)}, f"none: {exc}"


def _peers(config: Config) -> tuple[Any, str]:
    from plexd.mesh.peers import peers_report

    async def report() -> Any:
        async with asyncio.timeout(DAEMON_TIMEOUT):
            return await peers_report(config)

    try:
        rows, now = asyncio.run(report())
    except TimeoutError:
        return {"error": f"the device did not answer within {DAEMON_TIMEOUT:g}s"}, "none: the device hangs"
    except PlexdError as exc:
        return {"error": str(exc)}, f"none: {exc}"
    return [r.to_json(now) for r in rows], "the live device"


def _command_json(run: Callable[..., Ran], argv: list[str], missing: str = "") -> tuple[Any, str]:
    ran = run(argv, timeout=COMMAND_TIMEOUT)
    command = " ".join(argv)
    if ran.returncode != 0 and missing and "No such file or directory" in ran.stderr:
        return {"command": command, "exit_status": ran.returncode, "stderr": ran.stderr[:2000]}, missing
    if ran.returncode != 0:
        return {"command": command, "exit_status": ran.returncode, "stderr": ran.stderr[:2000]}, \
            f"'{command}' failed: {(ran.stderr.splitlines() or ['exit status ' + str(ran.returncode)])[0][:120]}"
    try:
        return boundedjson.parse(ran.stdout), command
    except ValueError:
        return {"command": command, "output": ran.stdout[:200_000]}, f"'{command}' printed no JSON"


def _families(run: Callable[..., Ran], args: list[str]) -> tuple[Any, str]:
    out, notes = {}, []
    for family in ("4", "6"):
        doc, note = _command_json(run, ["ip", "-j", f"-{family}", *args])
        out[f"ipv{family}"] = doc
        notes.append(note)
    return out, "; ".join(notes)


def _log(run: Callable[..., Ran], lines: int) -> tuple[str, str]:
    from plexd.system.systemd import booted

    if not booted():
        return ("none: systemd is not PID 1 here, so plexd.service has no journal; 'plexd up' logs to the stderr "
                "of wherever it was started\n"), "none: systemd is not PID 1"
    ran = run(["journalctl", "-u", "plexd.service", "-n", str(lines), "--no-pager", "-o", "short-iso-precise"],
              timeout=30)
    if ran.returncode != 0:
        return f"none: journalctl failed: {ran.stderr}\n", f"none: journalctl failed ({ran.stderr[:80]})"
    return ran.stdout, f"the last {lines} lines of journalctl -u plexd.service"


def _doctor(config: Config, doctor: Callable[[Config], Any] | None) -> list[Section]:
    from plexd.node.doctor import run_doctor

    try:
        report = (doctor or run_doctor)(config)
    except Exception as exc:
        return [Section("doctor.txt", f"doctor could not run: {type(exc).__name__}: {exc}\n".encode(), "failed")]
    warned = report.count("warn")
    note = f"plexd doctor: {report.count('fail')} failed, {warned} warning{'s' if warned != 1 else ''}"
    return [Section("doctor.json", (json.dumps(report.to_json(), indent=2) + "\n").encode(), note),
            Section("doctor.txt", (report.text() + "\n").encode(), note)]


# -- secrets ------------------------------------------------------------------------------------------------------


def known_secrets(config: Config) -> list[str]:
    """Every secret value this node holds that this command can read: the scrub's list."""
    found = [config.token.value, os.environ.get(config.token.env, "") if config.token.env else ""]
    files = [config.token.file, config.metrics.token_file, config.node_api.http_token_file,
             config.access.kubernetes.token_file]
    from plexd.config import datadir

    files += [os.path.join(config.data_dir, name) for name in (datadir.PRIVATE_KEY, datadir.NEXT_PRIVATE_KEY,
                                                               datadir.NODE_SECRET)]
    for path in filter(None, files):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                found.append(f.read(64 * 1024).strip())
        except OSError:
            continue
    try:  # a registration in flight keeps its key in JSON
        with open(os.path.join(config.data_dir, datadir.REGISTERING_KEY), encoding="utf-8") as f:
            found.append(str(boundedjson.loads(f.read(64 * 1024)).get("private_key", "")))
    except (OSError, ValueError, AttributeError, PlexdError):
        pass
    try:
        from plexd.identity.identity_store import IdentityStore

        identity = IdentityStore(config.data_dir).load().identity
        if identity is not None:
            found += [identity.private_key_b64, identity.node_secret_key, identity.bearer]
    except Exception:  # an unreadable identity holds nothing this report could show
        pass
    return sorted({s for s in found if len(s) >= MIN_SECRET}, key=len, reverse=True)


def scrub(data: bytes, secrets: list[str]) -> tuple[bytes, int]:
    """`data` with every secret (and its JSON-escaped form) replaced; and how many were found."""
    hits = 0
    for secret in secrets:
        for form in {secret, json.dumps(secret, ensure_ascii=False)[1:-1], json.dumps(secret)[1:-1]}:
            raw = form.encode()
            if raw in data:
                hits += data.count(raw)
                data = data.replace(raw, REDACTED.encode())
    return data, hits


# -- the archive --------------------------------------------------------------------------------------------------


def default_output(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return f"plexd-bugreport-{socket.gethostname() or 'node'}-{stamp}.tar.gz"


def write_archive(path: str, sections: list[Section], root: str) -> int:
    """The tar.gz at `path`, 0600 from its first byte (written beside it, then renamed): its size."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PlexdError(f"cannot write the bug report {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            now = time.time()
            for section in sections:
                info = tarfile.TarInfo(f"{root}/{section.name}")
                info.size, info.mode, info.mtime, info.uname, info.gname = len(section.data), 0o600, now, "root", \
                    "root"
                tar.addfile(info, io.BytesIO(section.data))
        os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        raise PlexdError(f"cannot write the bug report {path}: {exc.strerror or exc}") from None
    except BaseException:
        _remove(tmp)
        raise
    return os.path.getsize(path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def bugreport(config: Config, output: str = "", lines: int = DEFAULT_LINES, *,
              run: Callable[..., Ran] = run_command, doctor: Callable[[Config], Any] | None = None) -> dict[str, Any]:
    """Collect, scrub, write: what was written, for the CLI to print."""
    if not 0 < lines <= MAX_LINES:
        raise PlexdError(f"--lines {lines}: give 1 to {MAX_LINES}")
    path = os.path.abspath(output or default_output())
    sections = collect(config, lines, run=run, doctor=doctor)
    secrets = known_secrets(config)
    scrubbed, total = [], 0
    for section in sections:
        data, hits = scrub(section.data, secrets)
        total += hits
        scrubbed.append(Section(section.name, data, section.note))
    index = "".join(f"{s.name:<14} {s.note}\n" for s in scrubbed)
    scrubbed.insert(0, Section("README.txt", (f"plexd {__version__} bug report\n\n{index}").encode()))
    root = os.path.basename(path).removesuffix(".tar.gz").removesuffix(".tgz") or "plexd-bugreport"
    size = write_archive(path, scrubbed, root)
    return {"path": path, "bytes": size, "sections": [{"name": s.name, "note": s.note} for s in scrubbed[1:]],
            "secrets_scrubbed": total}


def format_bugreport(doc: dict[str, Any]) -> str:
    width = max(len(s["name"]) for s in doc["sections"])
    lines = [f"wrote {doc['path']} ({doc['bytes']} bytes, mode 0600): attach it to the ticket"]
    lines += [f"  {s['name']:<{width}}  {s['note']}".rstrip() for s in doc["sections"]]
    if doc["secrets_scrubbed"]:
        lines.append(f"  {doc['secrets_scrubbed']} occurrence(s) of a secret value were replaced by {REDACTED}")
    return "\n".join(lines)
