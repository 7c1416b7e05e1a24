"""Attack: swap a hook between the moment plexd hashes it and the moment it runs, so that the control plane's
checksum vouches for one program and another runs as root. plexd hashes a sealed memfd copy of the file and
executes that descriptor (`plexd.trust.integrity.image_hook`, `runner.run_process(exec_fd=...)`), so what runs is the
hashed bytes whatever the file became. The seam is entered deterministically: the real dispatcher's call of
`run_process` (after the hash and the ack, before the exec) is wrapped to swap the file first."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from plexd.actions import dispatcher as dispatcher_module
from plexd.actions.audit import LocalAudit
from plexd.actions.builtins import NodeView
from plexd.actions.dispatcher import ActionDispatcher
from plexd.actions.hooks import HookSet
from plexd.actions.journal import ActionJournal
from plexd.actions.outbox import Outbox
from plexd.actions.runner import run_process
from plexd.config.settings import ActionsConfig
from plexd.controlplane.envelope import Envelope
from plexd.trust.integrity import HookUnusable, image_hook, scan_hooks

pytestmark = pytest.mark.root  # hooks must be root's


async def _none(*a):
    return None


async def _status():
    return {"health": {"status": "healthy"}}


class Node:
    """The real dispatcher, journal and hook set of a daemon, without the daemon around them."""

    def __init__(self, tmp: Path) -> None:
        self.hooks = tmp / "hooks"
        self.hooks.mkdir(mode=0o755)
        self.journal = ActionJournal(tmp / "actions.db")
        self.hookset = HookSet(str(self.hooks), self.journal, scan_hooks(self.hooks), self._publish)
        view = NodeView(lambda: "n_1", lambda: "10.100.0.1", _status, dict, _none, _none, dict, _none, _none,
                        lambda n: [])
        self.d = ActionDispatcher(ActionsConfig(), self.journal, Outbox(self.journal, self._send), self.hookset,
                                  view, lambda: "n_1", LocalAudit(tmp / "audit.log"))

    async def _publish(self, scan):
        pass

    async def _send(self, m):
        pass

    async def announce(self) -> None:
        await self.hookset.rescan("test")
        self.hookset.mark_announced(self.hookset.current)

    async def request(self, name: str, checksum: str) -> dict:
        await self.d.handle_event(Envelope("action_request", "evt", "2026-01-01T00:00:00Z", "n", json.dumps(
            {"execution_id": "e1", "action": name, "checksum": checksum}), ""))
        running = self.d.running["e1"]
        return await running.done


def swap_before_exec(monkeypatch, swap) -> list[str]:
    """Wrap the dispatcher's run_process: `swap()` runs after the hash and the ack, right before the exec."""
    calls: list[str] = []

    async def seam(path, env, **kw):
        swap()
        calls.append(path)
        return await run_process(path, env, **kw)

    monkeypatch.setattr(dispatcher_module, "run_process", seam)
    return calls


def write_hook(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return hashlib.sha256(text.encode()).hexdigest()


async def test_a_hook_renamed_over_between_hash_and_exec_runs_only_the_hashed_bytes(tmp_path, monkeypatch):
    node = Node(tmp_path)
    ran, sentinel = tmp_path / "original-ran", tmp_path / "swapped-ran"
    good = write_hook(node.hooks / "job", f"#!/bin/sh\ntouch {ran}\necho original\n")
    await node.announce()
    evil = tmp_path / "evil"

    def swap():  # the usual atomic replace: a new file renamed over the hook
        write_hook(evil, f"#!/bin/sh\ntouch {sentinel}\necho swapped\n")
        os.rename(evil, node.hooks / "job")

    calls = swap_before_exec(monkeypatch, swap)
    result = await node.request("job", good)
    assert calls == [str(node.hooks / "job")], "the seam was not passed: the test proves nothing"
    assert "swapped" in (node.hooks / "job").read_text()  # the swap happened
    assert result["status"] == "success" and result["stdout"] == "original\n", result
    assert ran.exists() and not sentinel.exists()


async def test_a_hook_rewritten_in_place_between_hash_and_exec_runs_only_the_hashed_bytes(tmp_path, monkeypatch):
    node = Node(tmp_path)
    sentinel = tmp_path / "swapped-ran"
    good = write_hook(node.hooks / "job", "#!/bin/sh\necho original\n")
    await node.announce()
    inode = (node.hooks / "job").stat().st_ino

    def rewrite():  # same inode, new bytes: a rename-proof descriptor of the file itself would not help here
        with open(node.hooks / "job", "r+") as fh:
            fh.write(f"#!/bin/sh\ntouch {sentinel}\necho swapped\n")

    swap_before_exec(monkeypatch, rewrite)
    result = await node.request("job", good)
    assert (node.hooks / "job").stat().st_ino == inode and "swapped" in (node.hooks / "job").read_text()
    assert result["status"] == "success" and result["stdout"] == "original\n", result
    assert not sentinel.exists()


async def test_a_binary_hook_swapped_for_a_script_runs_the_binary(tmp_path, monkeypatch):
    """An ELF hook (a copy of printenv) runs from its descriptor too; the script swapped in never runs."""
    node = Node(tmp_path)
    sentinel = tmp_path / "swapped-ran"
    shutil.copy(shutil.which("printenv"), node.hooks / "env")
    (node.hooks / "env").chmod(0o755)
    good = hashlib.sha256((node.hooks / "env").read_bytes()).hexdigest()
    await node.announce()
    swap_before_exec(monkeypatch, lambda: write_hook(node.hooks / "env", f"#!/bin/sh\ntouch {sentinel}\n"))
    result = await node.request("env", good)
    assert result["status"] == "success", result
    assert "PLEXD_ACTION_NAME=env\n" in result["stdout"] and not sentinel.exists()


async def test_control_executing_the_path_after_the_swap_would_have_run_the_swapped_content(tmp_path):
    """What the descriptor prevents: the same swap, then an exec by path (the old runner) runs the attacker's
    bytes. Without this the tests above could pass for another reason."""
    hook, sentinel = tmp_path / "job", tmp_path / "swapped-ran"
    write_hook(hook, "#!/bin/sh\necho original\n")
    image = image_hook(hook)
    try:
        write_hook(tmp_path / "evil", f"#!/bin/sh\ntouch {sentinel}\necho swapped\n")
        os.rename(tmp_path / "evil", hook)
        by_fd = await run_process(str(hook), {"PATH": "/usr/bin:/bin"}, timeout=10, cap=4096, kill_grace=1,
                                  exec_fd=image.fd)
        assert by_fd.stdout == "original\n" and not sentinel.exists()
    finally:
        image.close()
    by_path = await run_process(str(hook), {"PATH": "/usr/bin:/bin"}, timeout=10, cap=4096, kill_grace=1)
    assert by_path.stdout == "swapped\n" and sentinel.exists()


def test_the_opened_file_itself_is_checked_not_only_the_scan(tmp_path):
    """A hook made writable by others after the scan is refused when it is opened to run."""
    hook = tmp_path / "job"
    write_hook(hook, "#!/bin/sh\necho hi\n")
    hook.chmod(0o757)
    with pytest.raises(HookUnusable, match="writable by group or other"):
        image_hook(hook)
    hook.chmod(0o644)
    with pytest.raises(HookUnusable, match="not an executable regular file"):
        image_hook(hook)


def test_the_image_is_sealed_and_not_leaked_to_other_children(tmp_path):
    import fcntl

    hook = tmp_path / "job"
    write_hook(hook, "#!/bin/sh\necho hi\n")
    image = image_hook(hook)
    try:
        assert image.sealed and image.checksum == hashlib.sha256(b"#!/bin/sh\necho hi\n").hexdigest()
        seals = fcntl.fcntl(image.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.pwrite(image.fd, b"x", 0)
        assert fcntl.fcntl(image.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # only the hook's own exec receives it
    finally:
        image.close()


async def test_a_hook_too_large_to_copy_runs_from_its_opened_file_which_a_rename_cannot_swap(tmp_path, monkeypatch):
    from plexd.trust import integrity

    monkeypatch.setattr(integrity, "MAX_IMAGE", 8)
    hook, sentinel = tmp_path / "job", tmp_path / "swapped-ran"
    write_hook(hook, "#!/bin/sh\necho original\n")
    image = image_hook(hook)
    try:
        assert not image.sealed
        write_hook(tmp_path / "evil", f"#!/bin/sh\ntouch {sentinel}\n")
        os.rename(tmp_path / "evil", hook)
        out = await run_process(str(hook), {"PATH": "/usr/bin:/bin"}, timeout=10, cap=4096, kill_grace=1,
                                exec_fd=image.fd)
    finally:
        image.close()
    assert out.stdout == "original\n" and not sentinel.exists()


def test_a_fifo_swapped_in_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "job"
    os.mkfifo(fifo, 0o755)
    with pytest.raises(HookUnusable, match="not an executable regular file"):
        image_hook(fifo)  # O_NONBLOCK: a FIFO with no writer would otherwise block this open forever
