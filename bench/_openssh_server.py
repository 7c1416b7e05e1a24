"""OpenSSH's own sshd as the baseline of bench ssh_sessions (`--server sshd`).

The machine has no sshd and the bench must not install one (its package would start a service on port 22), so
the binary is unpacked from Debian's `openssh-server` and `libwrap0` packages (`apt-get download`, nothing
installed) into `.cache/bench-openssh/`. It runs in a mount namespace of its own: there its privilege
separation user `sshd` is added to a copy of /etc/passwd bound over the real one, and /run is a fresh tmpfs,
so the host's files are untouched. It listens on 127.0.0.1 only and admits one public key; logins run the
same `<shell> -c true` as the plexd server's. Its key exchange is pinned to curve25519-sha256, the one asyncssh
negotiates with the plexd server: OpenSSH 9.2 prefers sntrup761x25519, whose key generation alone costs the
client some 60 ms of CPU per login here.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "bench-openssh"
PACKAGES = ("openssh-server", "libwrap0")


def unpacked_sshd() -> Path:
    """The sshd binary, unpacked from the Debian packages on first use."""
    sshd = CACHE / "root" / "usr" / "sbin" / "sshd"
    if sshd.exists():
        return sshd
    (CACHE / "root").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        try:
            subprocess.run(["apt-get", "download", *PACKAGES], cwd=download, check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise SystemExit(f"bench ssh_sessions --server sshd: cannot download {', '.join(PACKAGES)} "
                             f"(apt-get download; run `apt-get update` first?): {exc}") from exc
        for deb in Path(download).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(CACHE / "root")], check=True)
    return sshd


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class OpensshServer:
    """One sshd on 127.0.0.1 admitting `key_path` for the running user. Use as an async context manager."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-sshd-"))
        self.key_path = self.workdir / "client_key"
        self.port = free_port()
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _configure(self, sshd: Path) -> str:
        work = self.workdir
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / key)], check=True)
        shutil.copy(work / "client_key.pub", work / "authorized_keys")
        passwd = Path("/etc/passwd").read_text()
        if not any(line.startswith("sshd:") for line in passwd.splitlines()):
            passwd += "sshd:x:65500:65534:privilege separation:/run/sshd:/usr/sbin/nologin\n"
        (work / "passwd").write_text(passwd)
        # Defaults but for what the bench needs: one key, no DNS, and MaxStartups above the burst (the default
        # 10:30:100 drops most of 100 simultaneous handshakes, which would measure refusals, not logins).
        (work / "sshd_config").write_text(
            f"ListenAddress 127.0.0.1\nPort {self.port}\nHostKey {work / 'host_key'}\n"
            f"AuthorizedKeysFile {work / 'authorized_keys'}\nStrictModes no\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin yes\nUseDNS no\nMaxStartups 1000\n"
            "PidFile none\nLogLevel ERROR\nKexAlgorithms curve25519-sha256\n")
        libs = sshd.parent.parent / "lib" / "x86_64-linux-gnu"
        # Debian's bash sources ~/.bashrc for a command sshd runs (it sees SSH_CLIENT); plexd's server passes a
        # scrubbed environment, so its `bash -c true` reads none. Hidden here too, or sshd would be timed running
        # whatever the user's .bashrc does (here: `pyenv init`, some 50 processes per login).
        bashrc = Path(pwd.getpwuid(os.geteuid()).pw_dir) / ".bashrc"
        hide = f"mount --bind /dev/null {bashrc} && " if bashrc.exists() else ""
        return (f"{hide}mount --bind {work / 'passwd'} /etc/passwd && mount -t tmpfs -o mode=755 tmpfs /run && "
                f"mkdir -m 755 /run/sshd && LD_LIBRARY_PATH={libs} exec {sshd} -D -e -f {work / 'sshd_config'}")

    async def __aenter__(self) -> OpensshServer:
        script = self._configure(unpacked_sshd())
        with open(self.workdir / "sshd.log", "wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                "unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
        for _ in range(100):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                if self.proc.returncode is not None:
                    break
                await asyncio.sleep(0.1)
                continue
            writer.close()
            return self
        await self.__aexit__()
        raise SystemExit(f"sshd did not start: {(self.workdir / 'sshd.log').read_text()[-500:]}")

    async def __aexit__(self, *exc_info: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (sshd's per-connection processes and the sessions' commands)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
