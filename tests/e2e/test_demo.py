"""`plexd-devplane demo`, the README's first command, run exactly as a user runs it (real namespaces, real
wireguard-go, real devplane): every node pings every other over the mesh, and the lab is gone afterwards.
The first run puts every node behind its own NAT router (`--nat`): they find each other through STUN alone."""

import re
import subprocess
import sys

import pytest


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _lab_namespaces(demo_output: str) -> set[str]:
    """The namespaces of the lab the demo says it built ("lab TAG: ..."), still present. Only its own: other
    tests' labs run beside it (pytest-xdist)."""
    tag = re.search(r"^lab (\w+): bridge", demo_output, re.M)
    assert tag is not None, demo_output
    return {n for n in _netns() if n.startswith(f"px{tag.group(1)}")}


@pytest.mark.timeout(240)
def test_demo_forms_a_full_mesh_and_cleans_up():
    # The command's own time limit is well inside the test's: a hung demo is killed (its lab removed by its own
    # teardown) before pytest gives up on the test.
    proc = subprocess.run([sys.executable, "-m", "plexd.devplane.devplane_cli", "demo", "--nodes", "3", "--nat"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "full handshake matrix after" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^node\d\s+n_", line)]
    assert len(rows) == 3 and all(r[4] == "2" for r in rows), out  # each node has the two others as peers
    matrix = out.split("ping over the mesh", 1)[1].split("NAT: each node", 1)[0]
    assert matrix.count("ok") == 6 and "FAIL" not in matrix.upper().replace("FROM", ""), out
    # Each node discovered its router's public address (not its private one) and the devplane has it.
    nat = [line.split() for line in out.split("NAT: each node", 1)[1].split("policy ssh-only", 1)[0].splitlines()
           if re.match(r"^node\d\s+192\.168\.", line)]
    assert len(nat) == 3, out
    for _node, private, _router, public, discovered, nat_type, told, told_type in nat:
        assert discovered == f"{public}:51820" and told == discovered and private.startswith("192.168."), out
        assert (nat_type, told_type) == ("full_cone", "(full_cone)"), out
    # Then the policy: only tcp/22 from node1 to node2. Each flow as the policy says, checked for real.
    flows = {" ".join(line.split()[:4]): line.split()[4] for line in out.splitlines()
             if re.match(r"^node\d -> node\d ", line)}
    assert flows == {"node1 -> node2 tcp/22": "pass", "node1 -> node2 tcp/80": "dropped",
                     "node1 -> node2 ping": "dropped", "node2 -> node1 ping": "dropped",
                     "node3 -> node2 tcp/22": "dropped"}, out
    assert "UNEXPECTED" not in out and "enforcement: enforced" in out
    # Then an SSH access session on node2, logged into from node1 with the real ssh client, and revoked.
    session = out.split("SSH access session", 1)[1]
    user = session.split()[2]
    assert re.search(rf"^  {user}$", session, re.M), out  # `id -un` over the session printed the account
    assert re.search(r"^ses_\w+\s+ssh\s+10\.100\.\d+\.\d+:\d+\s+" + user, session, re.M), out  # plexd sessions
    assert "revoked: its listener is closed" in session, out
    assert _lab_namespaces(out) == set()
    assert subprocess.run(["id", user], capture_output=True).returncode != 0  # the throw-away account is gone


@pytest.mark.timeout(120)
def test_a_demo_ended_by_sigterm_removes_its_lab():
    """SIGTERM (a closed terminal, `timeout`, CI ending a job) killed the demo without its teardown: the lab, each
    part in a session of its own, stayed behind. It ends through the teardown now, as Ctrl-C does."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "plexd.devplane.devplane_cli", "demo", "--nodes", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = ""
    try:
        while "full handshake matrix" not in out:  # the lab, its devplane and three daemons run; the policy and
            line = proc.stdout.readline()          # the SSH session parts (several seconds) are to come
            assert line, proc.stderr.read()
            out += line
        tag = re.search(r"^lab (\w+): bridge", out, re.M).group(1)
        assert _lab_namespaces(out)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert _lab_namespaces(out) == set()
    left = subprocess.run(["pgrep", "-f", f"px{tag}"], capture_output=True, text=True).stdout
    assert left == "", left


@pytest.mark.timeout(240)
def test_demo_keep_leaves_a_working_lab_and_down_removes_it():
    cli = [sys.executable, "-m", "plexd.devplane.devplane_cli", "demo"]
    proc = None
    try:
        proc = subprocess.run([*cli, "--nodes", "2", "--keep"], capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr
        kept = _lab_namespaces(proc.stdout)
        switch = [n for n in kept if n.endswith("sw")]  # the bridge's own namespace
        nodes = sorted(kept - set(switch))
        assert len(nodes) == 2 and len(switch) == 1, proc.stdout
        # The kept mesh still carries traffic after the demo command has exited.
        node1 = nodes[0]
        peer_ip = re.search(r"^node2\s+n_\S+\s+(\S+)", proc.stdout, re.M).group(1)
        ping = subprocess.run(["ip", "netns", "exec", node1, "ping", "-c", "3", "-i", "0.2", "-W", "2", peer_ip],
                              capture_output=True, text=True, timeout=30)
        assert ping.returncode == 0, ping.stdout + ping.stderr
    finally:
        down = subprocess.run([*cli, "--down"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert _lab_namespaces(proc.stdout) == set()


@pytest.mark.timeout(240)
def test_demo_bridge_joins_two_nodes_behind_symmetric_nats_through_the_relay():
    """With --keep (it was ignored: the bridge scenario returned before it was read), then --down."""
    cli = [sys.executable, "-m", "plexd.devplane.devplane_cli", "demo"]
    try:
        proc = subprocess.run([*cli, "--bridge", "--keep"], capture_output=True, text=True, timeout=180)
        out = proc.stdout
        assert proc.returncode == 0, out + proc.stderr
        assert "kept: state in" in out and len(_lab_namespaces(out)) >= 4, out  # the switch, the bridge, 2 routers
    finally:
        down = subprocess.run([*cli, "--down"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "removed the kept lab" in down.stdout, down.stdout + down.stderr
    assert "reaches node3" in out and "through the relay" in out, out
    path = next(line.split() for line in out.splitlines() if re.match(r"^n_\w+\s", line) and "10.231." in line
                and ":51821" in line)
    assert "relay" in path, out  # `plexd peers` on node2: node3 is on the bridge's relay
    assert re.search(r"^rel_demo\s+\S+\s+\S+\s+[1-9]\d*\s+[1-9]\d*$", out, re.M), out  # packets both ways
    assert _lab_namespaces(out) == set()
