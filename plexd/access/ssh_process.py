"""What an SSH session's process runs as: the target user from the local user database, a scrubbed login
environment, and the exit status the client is told."""

from __future__ import annotations

import os
import pwd
import shutil
from dataclasses import dataclass

from plexd.base.errors import PlexdError

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SETPRIV = "/usr/bin/setpriv"  # util-linux, Essential on Debian: always there, never looked up on a PATH
DEFAULT_TERM = "dumb"
# A session limited to its allowed commands: a pager that starts anyway (forced by its program) is `cat`, and less
# and systemd's pager run without their shell escapes (`!cmd`, `|`, `v`) and file commands.
RESTRICTED_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "MANPAGER": "cat", "SYSTEMD_PAGER": "cat", "LESSSECURE": "1",
                  "SYSTEMD_PAGERSECURE": "1"}


class UserRefused(PlexdError):
    """The target user cannot be run as (unknown here, or another user while plexd is not root)."""


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary, the primary included (as getgrouplist gives them)
    home: str
    shell: str


def resolve_user(name: str) -> LocalUser:
    """The local account `name`; UserRefused when it does not exist, or when plexd could not switch to it."""
    try:
        entry = pwd.getpwnam(name)
    except (KeyError, ValueError):
        raise UserRefused(f"no local user {name[:40]!r}") from None
    euid = os.geteuid()
    if euid != 0 and entry.pw_uid != euid:
        raise UserRefused(f"cannot run as {name!r}: plexd is not root")
    shell = entry.pw_shell or "/bin/sh"
    return LocalUser(name, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(name, entry.pw_gid)),
                     entry.pw_dir or "/", shell)


def switch_user_argv(user: LocalUser) -> list[str] | None:
    """The argv prefix under which an exec's process becomes `user`: setpriv takes on the user's uid (real,
    effective, saved), gid and groups, then execs the rest. None when setpriv is missing.

    Why not Popen(user=, group=, extra_groups=): with those, Python 3.11 must fork() the daemon, which copies
    its page tables on the event loop (~0.8 ms of loop CPU at 60 MiB, more as the daemon grows, and the page
    faults of copy-on-write after it). Without them it uses vfork(), which copies nothing; setpriv's own exec
    costs the child ~1 ms instead, off the loop. A login shell cannot go this way: setpriv cannot give it the
    argv[0] of "-bash"."""
    if not os.access(SETPRIV, os.X_OK):
        return None
    groups = ["--groups=" + ",".join(map(str, user.groups))] if user.groups else ["--clear-groups"]
    return [SETPRIV, f"--reuid={user.uid}", f"--regid={user.gid}", *groups, "--"]


# A session's unit, once stopped: SIGHUP to every process in it (the hang-up sshd sends), SIGKILL to what is left
# 1.5 s later, so every process of a revoked, expired or closed session is gone within 2 s.
SESSION_UNIT_PROPERTIES = ("KillSignal=SIGHUP", "SendSIGHUP=no", "TimeoutStopSec=1500ms", "WorkingDirectory=~")


def session_unit_argv(unit: str, user: LocalUser, env: dict[str, str], argv: list[str], *, pty: bool,
                      bound_to: str = "") -> list[str] | None:
    """The argv that runs `argv` (a shell or `shell -c COMMAND`) as `user` in a transient service of its own, or
    None when systemd is not there to start one (`systemd-run` missing).

    Under systemd, a session's process started by plexd itself would live inside plexd's sandbox: the unit's
    capability set (no setuid: a non-root user cannot be become), its read-only file system and hidden home
    directories, its cgroup and TasksMax. A transient service is started by systemd, as the user, with none of
    that, and its cgroup holds every descendant (`setsid -f` too): `systemctl stop` ends them all
    (`SESSION_UNIT_PROPERTIES`). `systemd-run --pipe` (or `--pty`) carries the process's input and output through
    the systemd-run plexd runs, and exits with its status. `bound_to` (plexd's own unit): a plexd that dies takes
    its sessions' units with it. What a command leaves running ends with it (the unit stops when its main process
    exits), unlike sshd, which lets `nohup cmd &` outlive the login."""
    found = shutil.which("systemd-run")
    if found is None:
        return None
    props = [*SESSION_UNIT_PROPERTIES, *((f"BindsTo={bound_to}", f"After={bound_to}") if bound_to else ())]
    return [found, "--quiet", "--collect", f"--unit={unit}", "--service-type=exec", f"--uid={user.name}",
            "--pty" if pty else "--pipe", *(f"--property={p}" for p in props),
            *(f"--setenv={k}={v}" for k, v in env.items()), "--", *argv]


def login_environment(user: LocalUser, term: str | None, restricted: bool = False) -> dict[str, str]:
    """Only these: nothing of plexd's environment and nothing the client sent (env requests are never applied).
    `restricted` (allowed commands only) adds RESTRICTED_ENV."""
    env = {"HOME": user.home, "USER": user.name, "LOGNAME": user.name, "SHELL": user.shell,
           "PATH": SAFE_PATH, "TERM": term or DEFAULT_TERM}
    return {**env, **RESTRICTED_ENV} if restricted else env


def exit_status(returncode: int) -> int:
    """The SSH exit-status of a process's return code: a death by signal N is 128+N (as a shell reports it)."""
    return 128 - returncode if returncode < 0 else returncode

