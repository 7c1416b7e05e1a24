"""Attack: read the daemon's secrets from a child. plexd's environment may hold the bootstrap token
(`PLEXD_BOOTSTRAP_TOKEN`, how the Kubernetes DaemonSet passes it) and whatever else an operator put there; a hook
(code run on the control plane's request), wireguard-go and every other child must see an allow-list only:
PATH, LANG/LC_ALL, HOME, and what plexd adds for that child (a hook's PLEXD_* names and its parameters)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from lab_daemon import Daemon, wait_until, wireguard_go_pids

pytestmark = pytest.mark.root

SECRET_NAMES = ("PLEXD_BOOTSTRAP_TOKEN", "AWS_SECRET_ACCESS_KEY", "PLEXD_LOG_LEVEL")
HOOK_NAMES = {"PATH", "LANG", "LC_ALL", "HOME", "PLEXD_NODE_ID", "PLEXD_EXECUTION_ID", "PLEXD_ACTION_NAME",
              "PLEXD_HOOK_PATH", "PLEXD_HOOKS_DIR",
              "PLEXD_PARAM_TARGET"}


def environ(raw: bytes) -> dict[str, str]:
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if item)


def test_a_hook_and_wireguard_go_never_see_the_daemons_environment(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    token = dp.admin.create_token()  # a real, unused bootstrap token: the most valuable thing in the env
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    hooks = tmp_path / lab.nodes[0].name / "hooks"
    hooks.mkdir(mode=0o755, parents=True)
    dump = tmp_path / "hook-environ"
    hook = hooks / "dump-env"
    hook.write_text(f"#!/bin/sh\ncat /proc/$$/environ > {dump}\n")
    hook.chmod(0o755)
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, "1h", extra_config="shutdown: {deregister: false}\nlog_level: info\n",
               env={"PLEXD_BOOTSTRAP_TOKEN": token, "AWS_SECRET_ACCESS_KEY": secret, "PLEXD_LOG_LEVEL": "info",
                    "LANG": "C.UTF-8"})
    daemons.append(d)
    wait_until(lambda: d.api_listening() and d.node_id() is not None, 30, "the daemon", daemons)

    run = d.cli("actions", "run", "dump-env", "--local", "--param", "target=db1", check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    seen = environ(dump.read_bytes())
    assert set(seen) <= HOOK_NAMES, f"the hook saw {sorted(set(seen) - HOOK_NAMES)} besides the allow-list"
    assert seen["PLEXD_PARAM_TARGET"] == "db1" and seen["PLEXD_ACTION_NAME"] == "dump-env"
    assert seen["LANG"] == "C.UTF-8"  # the locale is passed on, it decides only how text is printed
    raw = dump.read_bytes()
    assert token.encode() not in raw and secret.encode() not in raw

    # wireguard-go, started by the same daemon, likewise.
    pids = wireguard_go_pids(lab, lab.nodes[0])
    assert pids, "no wireguard-go found in the lab node"
    for pid in pids:
        wg_env = environ(Path(f"/proc/{pid}/environ").read_bytes())
        assert not set(wg_env) & set(SECRET_NAMES), sorted(wg_env)
        assert wg_env.get("WG_PROCESS_FOREGROUND") == "1"  # what plexd adds for it is there

    # Control: the daemon itself has them (the lab's `ip netns exec ... sh -c 'exec plexd up'` keeps the pid).
    assert environ(Path(f"/proc/{d.proc.pid}/environ").read_bytes()).get("PLEXD_BOOTSTRAP_TOKEN") == token


def test_the_hook_environment_is_built_from_the_allow_list_only(monkeypatch):
    """The same, for the function every hook's environment comes from (no daemon needed)."""
    from plexd.actions.request import ActionRequest, hook_environment

    for name in SECRET_NAMES:
        monkeypatch.setenv(name, "leak-" + hashlib.sha256(name.encode()).hexdigest()[:8])
    env = hook_environment("n_1", ActionRequest("e1", "h", {"target": "x"}))
    assert set(env) <= HOOK_NAMES and not any(v.startswith("leak-") for v in env.values()), json.dumps(env)
