"""What an SSH session's process runs as: the target user from the local user database, a scrubbed login
environment, and the exit status the client is told."""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SETPRIV = "/usr/bin/setpriv"  # util-linux, Essential on Debian: always there, never looked up on a PATH
DEFAULT_TERM = "dumb"
# A session limited to its allowed commands: a pager that starts anyway (forced by its program) is `cat`, and less
# and systemd's pager run without their shell escapes (`!cmd`, `|`, `v`) and file commands.
RESTRICTED_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "MANPAGER": "cat", "SYSTEMD_PAGER": "cat", "LESSSECURE": "1",
                  "SYSTEMD_PAGERSECURE": "1"}


class UserRefused(Exception):
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


def login_environment(user: LocalUser, term: str | None, restricted: bool = False) -> dict[str, str]:
    """Only these: nothing of plexd's environment and nothing the client sent (env requests are never applied).
    `restricted` (allowed commands only) adds RESTRICTED_ENV."""
    env = {"HOME": user.home, "USER": user.name, "LOGNAME": user.name, "SHELL": user.shell,
           "PATH": SAFE_PATH, "TERM": term or DEFAULT_TERM}
    return {**env, **RESTRICTED_ENV} if restricted else env


def exit_status(returncode: int) -> int:
    """The SSH exit-status of a process's return code: a death by signal N is 128+N (as a shell reports it)."""
    return 128 - returncode if returncode < 0 else returncode

