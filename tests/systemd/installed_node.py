"""The systemd tier: plexd installed as the README's Debian section says, under the shipped unit, with systemd as
PID 1 (scripts/systemd-vm.sh boots Debian 12 for it; scripts/test-systemd.sh runs this inside).

One machine: this VM's root network namespace is the installed node ("server"); a namespace `peer` holds a second
node (`plexd up` by hand) and the devplane listens on the link between them. Each check prints one line, PASS or
FAIL with what it saw, and the run exits 1 if any failed. Checks that need an earlier one's state say so and are
not run when it failed (printed as SKIP, which fails the run too).

The unit gets one drop-in, said here: WatchdogSec=30s and TimeoutAbortSec=5s (the shipped 60 s and 40 s would make
the watchdog check take two minutes on an emulated CPU; what is checked is that systemd's watchdog restarts a
wedged plexd, which adopts the live device).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from nacl.signing import SigningKey

from plexd.upgrade import signing

VENV = Path(os.environ.get("PLEXD_VENV", "/opt/plexd/venv"))
DP_URL = "http://10.99.0.1:8080"
DP_DIR = Path("/tmp/dp")
PEER_DIR = Path("/tmp/peer")
SLOW = float(os.environ.get("PLEXD_TEST_LOAD_FACTOR", "4"))  # the VM's CPU is emulated: waits stretch
RESULTS: list[tuple[str, str]] = []


def sh(*cmd: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def wait(pred, seconds: float, what: str, interval: float = 0.5):
    """Look after `interval` at first, each pause a quarter longer than the last, up to 4x: a look spawns tools, paid
    for on the VM's emulated CPU by the daemon under test."""
    deadline = time.monotonic() + seconds * SLOW
    pause = interval
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(pause)
        pause = min(pause * 1.25, 4 * interval)
    raise AssertionError(f"timed out after {seconds * SLOW:.0f}s waiting for {what}")


def check(name: str, what: str, needs: tuple[str, ...] = ()):
    """Run the decorated function as one check, now (a check is a step of one story); record PASS, FAIL or SKIP.
    `needs`: the names of the checks whose state this one builds on."""
    def run(fn):
        failed = [n for n, verdict in RESULTS if n in needs and verdict != "PASS"]
        if failed:
            RESULTS.append((name, "SKIP"))
            print(f"SKIP {name}: {what} (needs {', '.join(failed)})", flush=True)
            return fn
        started = time.monotonic()
        try:
            detail = fn() or ""
        except Exception as exc:  # a check that fails must not stop the others
            RESULTS.append((name, "FAIL"))
            journal = sh("journalctl", "-u", "plexd", "-n", "40", "--no-pager", "-o", "cat", check=False).stdout
            print(f"FAIL {name}: {what}: {exc}\n{traceback.format_exc(limit=3)}--- journal of plexd.service\n{journal}",
                  flush=True)
            return fn
        RESULTS.append((name, "PASS"))
        print(f"PASS {name}: {what} ({time.monotonic() - started:.1f}s){'; ' + detail if detail else ''}", flush=True)
        return fn
    return run


def unit(prop: str) -> str:
    return sh("systemctl", "show", "-p", prop, "--value", "plexd").stdout.strip()


RELEASE_KEY = SigningKey.generate()  # this tier's release key, pinned in the node's upgrade.release_keys


def admin():
    from plexd.devplane.harness import AdminClient

    return AdminClient(DP_URL, (DP_DIR / "dp.db.admin-token").read_text().strip())


def ping_lost(count: int, during, interval: float = 0.2) -> tuple[object, int]:
    """Ping the server's mesh IP from the peer `count` times while `during()` runs; (its result, lost)."""
    proc = subprocess.Popen(["ip", "netns", "exec", "peer", "ping", "-n", "-c", str(count), "-i", str(interval), "-W",
                             "2", SERVER["mesh_ip"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline() + proc.stdout.readline()  # the header and the first echo
    assert "bytes from" in first, f"no first echo before the change: {first}"
    result = during()
    out, _ = proc.communicate(timeout=count * interval + 60 * SLOW)
    sent, received = map(int, re.search(r"(\d+) packets transmitted, (\d+) received", out).groups())
    return result, sent - received


def ifindex() -> int | None:
    path = Path("/sys/class/net/plexd0/ifindex")
    return int(path.read_text()) if path.exists() else None


SERVER: dict[str, str] = {}


def setup() -> None:
    sh("ip", "netns", "add", "peer")
    sh("ip", "link", "add", "veth0", "type", "veth", "peer", "name", "veth1")
    sh("ip", "link", "set", "veth1", "netns", "peer")
    sh("ip", "addr", "add", "10.99.0.1/24", "dev", "veth0")
    sh("ip", "link", "set", "veth0", "up")
    for args in (("addr", "add", "10.99.0.2/24", "dev", "veth1"), ("link", "set", "veth1", "up"),
                 ("link", "set", "lo", "up")):
        sh("ip", "-n", "peer", *args)
    DP_DIR.mkdir(parents=True)
    log = open(DP_DIR / "devplane.log", "w")  # noqa: SIM115 - for the VM's life
    subprocess.Popen([str(VENV / "bin" / "plexd-devplane"), "serve", "--listen", "10.99.0.1:8080", "--db",
                      str(DP_DIR / "dp.db"), "--heartbeat-interval", "10s"], stdout=log, stderr=subprocess.STDOUT)
    wait(lambda: (DP_DIR / "dp.db.admin-token").exists() and "listening" in (DP_DIR / "devplane.log").read_text(),
         30, "the devplane")


def main() -> int:
    print(f"kernel {os.uname().release}; {sh('systemctl', '--version').stdout.splitlines()[0]}; PID 1 is "
          f"{Path('/proc/1/comm').read_text().strip()}", flush=True)
    setup()
    dp = admin()

    @check("install", "plexd install, plexd join, systemctl enable --now: READY=1 and a STATUS= line")
    def _():
        Path("/opt/plexd").mkdir(exist_ok=True)
        Path("/opt/plexd/venv").symlink_to(VENV)  # README: python3 -m venv /opt/plexd/venv; pip install plexd
        sh("/opt/plexd/venv/bin/plexd", "install")
        Path("/tmp/token").write_text(dp.create_token())
        os.chmod("/tmp/token", 0o600)
        sh("plexd", "join", "--api", DP_URL, "--token-file", "/tmp/token", env={**os.environ,
                                                                               "PLEXD_API_ALLOW_INSECURE": "true"})
        with open("/etc/plexd/config.yaml", "a") as config:  # the release key this tier signs its upgrade with
            config.write(f"upgrade: {{release_keys: ['{signing.public_key(RELEASE_KEY)}']}}\n")
        dropin = Path("/etc/systemd/system/plexd.service.d")
        dropin.mkdir(parents=True)
        (dropin / "test.conf").write_text("[Service]\nWatchdogSec=30s\nTimeoutAbortSec=5s\n")
        sh("systemctl", "daemon-reload")
        started = time.monotonic()
        sh("systemctl", "enable", "--now", "plexd", timeout=300 * SLOW)  # Type=notify: returns after READY=1
        ready = time.monotonic() - started
        assert unit("ActiveState") == "active" and unit("SubState") == "running", unit("ActiveState")
        status = unit("StatusText")
        assert status, "no STATUS= line"
        identity = json.loads(Path("/var/lib/plexd/identity.json").read_text())
        SERVER.update(node_id=identity["node_id"], mesh_ip=identity["mesh_ip"])
        kind = sh("ip", "-d", "link", "show", "plexd0").stdout
        assert " wireguard " in kind, f"mesh.backend auto did not pick the kernel's WireGuard: {kind}"
        return f"active {ready:.1f}s after enable --now; STATUS={status!r}; backend: kernel (auto)"

    @check("peer", "a peer in a namespace pings the installed node over the mesh", needs=("install",))
    def _():
        PEER_DIR.mkdir()
        (PEER_DIR / "token").write_text(dp.create_token())
        (PEER_DIR / "config.yaml").write_text(
            f"api: {{url: {DP_URL}, allow_insecure: true}}\ndata_dir: {PEER_DIR / 'data'}\n"
            f"token: {{file: {PEER_DIR / 'token'}}}\nhooks: {{dir: {PEER_DIR / 'hooks'}}}\n"
            f"mesh: {{interface: plexd0, backend: kernel}}\nnode_api: {{socket_path: {PEER_DIR / 'api.sock'}}}\n"
            "registration: {hostname: peer}\n")
        log = open(PEER_DIR / "plexd.log", "w")  # noqa: SIM115 - for the VM's life
        subprocess.Popen(["ip", "netns", "exec", "peer", str(VENV / "bin" / "plexd"), "up"], stdout=log,
                         stderr=subprocess.STDOUT, env={**os.environ, "PLEXD_CONFIG": str(PEER_DIR / "config.yaml")})
        peer_id = wait(lambda: json.loads((PEER_DIR / "data" / "identity.json").read_text())["node_id"]
                       if (PEER_DIR / "data" / "identity.json").exists() else None, 60, "the peer to register")
        dp.set_node_endpoint(SERVER["node_id"], "10.99.0.1:51820")
        dp.set_node_endpoint(peer_id, "10.99.0.2:51820")
        wait(lambda: sh("ip", "netns", "exec", "peer", "ping", "-c", "1", "-W", "2", SERVER["mesh_ip"],
                        check=False).returncode == 0, 60, "a ping from the peer")

    @check("watchdog", "a SIGSTOPped plexd is restarted by the watchdog and adopts the live device",
           needs=("install", "peer"))
    def _():
        pid, index = unit("MainPID"), ifindex()
        restarts = int(unit("NRestarts"))
        os.kill(int(pid), signal.SIGSTOP)
        wait(lambda: int(unit("NRestarts")) > restarts and unit("MainPID") not in ("0", pid)
             and unit("ActiveState") == "active", 60, "the watchdog's restart")
        assert ifindex() == index, f"plexd0 was recreated ({index} -> {ifindex()})"
        wait(lambda: sh("ip", "netns", "exec", "peer", "ping", "-c", "1", "-W", "2", SERVER["mesh_ip"],
                        check=False).returncode == 0, 30, "a ping after the watchdog's restart")
        return f"pid {pid} -> {unit('MainPID')}, plexd0 kept (ifindex {index})"

    @check("restart", "systemctl restart plexd keeps the tunnel: a continuous ping loses nothing",
           needs=("install", "peer"))
    def _():
        index = ifindex()
        _, lost = ping_lost(150, lambda: sh("systemctl", "restart", "plexd", timeout=300 * SLOW))
        assert lost == 0, f"{lost} of 150 pings lost"
        assert ifindex() == index and dp.node(SERVER["node_id"])["status"] == "online"
        journal = sh("journalctl", "-u", "plexd", "--no-pager", "-o", "cat").stdout
        assert "systemd is restarting plexd" in journal
        return "0 of 150 lost, plexd0 kept"

    @check("stop", "systemctl stop deregisters within TimeoutStopSec; systemctl start rejoins as the same node",
           needs=("install", "peer"))
    def _():
        shown = re.fullmatch(r"(\d+)s", unit("TimeoutStopUSec"))
        limit = int(shown.group(1)) if shown else 40
        started = time.monotonic()
        sh("systemctl", "stop", "plexd", timeout=120 * SLOW)
        took = time.monotonic() - started
        assert unit("ActiveState") == "inactive" and unit("Result") == "success", unit("Result")
        assert took < limit, f"the stop took {took:.1f}s, TimeoutStopSec is {limit}s"
        assert dp.node(SERVER["node_id"])["status"] == "deregistered" and ifindex() is None
        assert "plexd" not in sh("nft", "list", "tables").stdout
        sh("systemctl", "start", "plexd", timeout=300 * SLOW)
        wait(lambda: dp.node(SERVER["node_id"])["status"] == "online", 60, "the rejoin")
        identity = json.loads(Path("/var/lib/plexd/identity.json").read_text())
        assert (identity["node_id"], identity["mesh_ip"]) == (SERVER["node_id"], SERVER["mesh_ip"])
        wait(lambda: sh("ip", "netns", "exec", "peer", "ping", "-c", "1", "-W", "2", SERVER["mesh_ip"],
                        check=False).returncode == 0, 60, "a ping after the rejoin")
        return f"stopped in {took:.1f}s (TimeoutStopSec {limit}s): deregistered, plexd0 and the table gone; rejoined"

    @check("upgrade", "a self-upgrade's exit 75 is restarted by systemd into the new release", needs=("install",))
    def _():
        from plexd.upgrade import zipapp

        version, release = "0.1.1-systemd", Path("/tmp/plexd-upgrade.pyz")
        checksum = zipapp.build(release, version=version)
        dp.put_artifact(version, release.read_bytes(), signature=signing.sign(RELEASE_KEY, version, checksum))
        restarts, pid = int(unit("NRestarts")), unit("MainPID")
        eid = dp.start_upgrade(SERVER["node_id"], version)["execution_id"]
        result = wait(lambda: next((e["result"] for e in dp.executions(SERVER["node_id"])
                                    if e.get("execution_id") == eid and e.get("result")), None), 180,
                      "the upgrade's result")
        assert result["status"] == "success", result
        assert int(unit("NRestarts")) > restarts and unit("MainPID") != pid and unit("ActiveState") == "active"
        running = json.loads(sh("plexd", "status", "--json").stdout)["daemon"]
        assert running["version"] == version and running["binary_checksum"] == checksum, running
        return f"exit 75, restarted by systemd (NRestarts {restarts} -> {unit('NRestarts')}), running {version}"

    @check("ssh", "an SSH session into a non-root user runs outside plexd's sandbox; revoked, none of its processes"
                  " is left", needs=("install", "peer"))
    def _():
        sh("useradd", "--create-home", "--shell", "/bin/bash", "alice")
        created = dp.create_session(SERVER["node_id"], "ssh", 600, user="alice")
        sid, token = created["session"]["session_id"], created["token"]
        endpoint = wait(lambda: next((x["listener_endpoint"] for x in dp.sessions(SERVER["node_id"])
                                      if x["session_id"] == sid and x.get("listener_endpoint")), None), 30,
                        "the session's listener")
        host, port = endpoint.rsplit(":", 1)
        ssh = ["ip", "netns", "exec", "peer", "sshpass", "-e", "ssh", "-o", "UserKnownHostsFile=/dev/null", "-o",
               "StrictHostKeyChecking=no", "-o", "PreferredAuthentications=password", "-o", "LogLevel=ERROR", "-o",
               f"ConnectTimeout={int(20 * SLOW)}", "-p", port, f"alice@{host}"]
        env = {**os.environ, "SSHPASS": token}
        done = sh(*ssh, "id -un; touch ~/x; ls -l ~/x", env=env, timeout=120 * SLOW)
        lines = done.stdout.splitlines()
        assert lines[0] == "alice" and re.match(r"-rw\S* 1 alice alice 0 .* /home/alice/x$", lines[1]), done.stdout
        # a command that leaves a process outside its process group (setsid), and stays
        live = subprocess.Popen([*ssh, "setsid -f sleep 1000; exec sleep 900"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            pids = wait(lambda: (p := sh("pgrep", "-u", "alice", check=False).stdout.split()) and len(p) >= 2 and p,
                        60, "the session's two sleeps")
            units = {re.search(r"plexd-session-\S+?\.service", Path(f"/proc/{pid}/cgroup").read_text()).group(0)
                     for pid in pids}
            assert len(units) == 1, units  # both in the session's unit (not plexd.service's cgroup)
            revoked = time.monotonic()
            dp.revoke_session(SERVER["node_id"], sid)
            wait(lambda: not sh("pgrep", "-u", "alice", check=False).stdout.strip(), 30,
                 "the session's processes to go", interval=0.1)
            gone = time.monotonic() - revoked
        finally:
            live.kill()
            live.wait()
        return (f"ssh alice@{endpoint}: {lines[0]}; {lines[1]}; {len(pids)} processes in {units.pop()}, "
                f"0 left {gone:.1f}s after the revocation")

    @check("hook", "a hook runs under the unit, its result reported", needs=("install",))
    def _():
        hook = Path("/etc/plexd/hooks.d/whoami")
        hook.write_text("#!/bin/sh\necho \"ran as $(id -un) in $PLEXD_HOOKS_DIR\"\n")
        hook.chmod(0o700)
        sh("plexd", "hooks", "reload")
        wait(lambda: "whoami" in sh("plexd", "actions", "list").stdout, 30, "the hook to be listed")
        eid = dp.request_action(SERVER["node_id"], "whoami")
        done = wait(lambda: next((e for e in dp.executions(SERVER["node_id"]) if e.get("execution_id") == eid
                                  and e.get("result")), None), 60, "the hook's result")
        result = done["result"]
        assert result.get("status") == "success" and "ran as root" in json.dumps(result), result
        return f"result: {result.get('status')}"

    @check("doctor", "plexd doctor on the healthy installed node, and with the control plane unreachable",
           needs=("install",))
    def _():
        healthy = sh("plexd", "doctor", check=False, timeout=120 * SLOW)
        print(healthy.stdout, flush=True)
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        down = sh("plexd", "doctor", check=False, timeout=120 * SLOW,
                  env={**os.environ, "PLEXD_API_URL": "http://10.99.0.1:9"})  # nothing listens there
        print(down.stdout, flush=True)
        assert down.returncode == 1 and "TCP: connection refused" in down.stdout, down.stdout + down.stderr
        return "exit 0 healthy; exit 1 with the control plane unreachable (TCP: connection refused)"

    @check("bugreport", "plexd bugreport holds none of the node's secrets", needs=("install",))
    def _():
        import base64
        import tarfile

        sh("plexd", "bugreport", "--output", "/tmp/bugreport.tar.gz", timeout=120 * SLOW)
        assert Path("/tmp/bugreport.tar.gz").stat().st_mode & 0o777 == 0o600
        with tarfile.open("/tmp/bugreport.tar.gz") as tar:
            blob = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
            names = tar.getnames()
        data = Path("/var/lib/plexd")
        secrets = {name: (data / name).read_bytes().strip() for name in ("private_key", "node_secret_key")
                   if (data / name).exists()}
        assert secrets, "no private key or node secret found to look for"
        for name, value in secrets.items():
            for form in (value, base64.b64encode(value)):
                assert form not in blob, f"the bugreport holds the {name}"
        return f"{len(names)} files, {len(blob)} bytes: none of {', '.join(sorted(secrets))} in them"

    @check("purge", "plexd deregister --purge disables the unit and removes everything", needs=("install",))
    def _():
        out = sh("plexd", "deregister", "--purge", "--json", timeout=120 * SLOW).stdout
        doc = json.loads(out)
        assert doc["deregistered"] and doc["torn_down"], doc
        wait(lambda: unit("ActiveState") in ("inactive", "failed"), 60, "the unit to stop")
        enabled = sh("systemctl", "is-enabled", "plexd", check=False).stdout.strip()
        assert enabled in ("disabled", "not-found"), enabled
        assert ifindex() is None and not Path("/var/lib/plexd/identity.json").exists()
        assert dp.node(SERVER["node_id"])["status"] == "removed"
        return f"unit {enabled}, plexd0 and data_dir gone, node removed"

    @check("security", "systemd-analyze security plexd: exposure at most 2.5")
    def _():
        out = sh("systemd-analyze", "security", "--no-pager", "plexd.service", check=False).stdout
        score = float(re.search(r"Overall exposure level for plexd\.service: ([\d.]+)", out).group(1))
        assert score <= 2.5, out[-600:]
        return f"{score}"

    failed = [n for n, v in RESULTS if v != "PASS"]
    print(f"systemd tier: {len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed", flush=True)
    if failed:
        for name in ("plexd",):
            print(sh("journalctl", "-u", name, "--no-pager", "-n", "60", check=False).stdout, flush=True)
        print((PEER_DIR / "plexd.log").read_text()[-3000:] if (PEER_DIR / "plexd.log").exists() else "", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
