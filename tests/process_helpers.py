"""Running test code as another user: a forked child with the uid, gid and supplementary groups a test names."""

from __future__ import annotations

import os

NOBODY = 65534


def run_as(fn, uid: int = NOBODY, gid: int = NOBODY, groups: tuple[int, ...] = ()) -> tuple[int, str]:
    """Run `fn()` in a forked child that has dropped to `uid`/`gid` with exactly `groups` as supplementary groups;
    return (its exit status, what it printed). A fork rather than an exec: another uid cannot read this venv's
    interpreter under /root, so the code under test (imported before the call) runs in the child as it is."""
    import sys

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
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
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


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
