"""Access sessions in a real mesh (issue 33): three `plexd up` nodes in namespaces, the real devplane minting
sessions, the real OpenSSH client (through sshpass) and raw TCP clients over WireGuard, the per-session nftables
rules checked with `nft -j list`.

The policy lets node a reach b's SSH port (tcp/22) and the TCP session's target port; node c only pings b, so it
is b's peer (on the device) but the policy does not let it reach either service, and so neither session.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from integration.ssh_session_helpers import throwaway_user
from lab_daemon import connects, ping_count, publish_endpoints, start_mesh, wait_until

ECHO_PORT = 7007
ECHO = f"""
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", {ECHO_PORT}))
s.listen()
def serve(c):
    while data := c.recv(65536):
        c.sendall(data)
    c.close()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
HOLD = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120)
for line in sys.stdin:
    c.sendall(line.strip().encode())
    print(c.recv(65536).decode(), flush=True)
"""
SEND = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
c.sendall(sys.argv[3].encode()); c.shutdown(socket.SHUT_WR)
print(c.recv(65536).decode())
"""



def ssh_argv(token: str, user: str, endpoint: str, *command: str) -> list[str]:
    host, port = endpoint.rsplit(":", 1)
    return ["sshpass", "-p", token, "ssh", "-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no",
            "-o", "PreferredAuthentications=password", "-o", "NumberOfPasswordPrompts=1", "-o", "LogLevel=ERROR",
            "-o", "ConnectTimeout=5", "-p", port, f"{user}@{host}", *command]


def listener_of(dp, node_id: str, session_id: str) -> str:
    return next((s["listener_endpoint"] for s in dp.admin.sessions(node_id) if s["session_id"] == session_id), "")


def activity(dp, node_id: str, session_id: str, kind: str) -> list[dict]:
    return [a[kind] for a in dp.admin.session_activity(node_id) if a["session_id"] == session_id and kind in a]


def session_rules(lab, node) -> list[dict]:
    out = lab.exec(node, ["nft", "-j", "list", "chain", "inet", "plexd", "input"], check=False)
    rules = [o["rule"] for o in json.loads(out.stdout)["nftables"] if "rule" in o] if out.returncode == 0 else []
    return [r for r in rules if any("socket" in json.dumps(e) for e in r["expr"])]


@pytest.mark.parametrize("lab_dp", [3, {"nodes": 3, "dialect": "platform"}], indirect=True, ids=["spec", "platform"])
def test_ssh_and_tcp_sessions_over_the_mesh(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    start_mesh(lab, dp, daemons, tmp_path, reconcile="10m")
    a, b, c = daemons
    publish_endpoints(dp, daemons)
    b_id, b_ip = b.node_id(), b.mesh_ip()
    dp.admin.set_policies([{"id": "access", "rules": [
        {"src": a.node_id(), "dst": b_id, "port": 22, "protocol": "tcp", "action": "allow"},
        {"src": a.node_id(), "dst": b_id, "port": ECHO_PORT, "protocol": "tcp", "action": "allow"},
        {"src": c.node_id(), "dst": b_id, "protocol": "icmp", "action": "allow"}]}])
    wait_until(lambda: ping_count(lab, c.node, b_ip, 1, 0.2) == 1, 20, "c to ping b (c stays b's peer)", daemons)
    lab.spawn(b.node.wrap([sys.executable, "-c", ECHO]))

    with throwaway_user() as account:
        # -- SSH: the real client logs in over the mesh with the minted token --------------------------------------
        created = dp.admin.create_session(b_id, "ssh", 600, user=account.name)
        sid, token = created["session"]["session_id"], created["token"]
        wait_until(lambda: listener_of(dp, b_id, sid), 15, "b to report the SSH session's listener", daemons)
        endpoint = listener_of(dp, b_id, sid)
        assert endpoint.startswith(f"{b_ip}:")  # the mesh IP, a port of the kernel's choice
        done = lab.exec(a.node, ssh_argv(token, account.name, endpoint, "id -un"), check=False)
        assert (done.returncode, done.stdout.strip()) == (0, account.name), done.stderr
        # c is a peer of b, but the policy gives it no say over tcp/22: its SYN meets the default deny
        assert not connects(lab, c.node, b_ip, int(endpoint.rsplit(":", 1)[1]))
        rules = session_rules(lab, b.node)
        assert rules and all(sid in r["comment"] for r in rules), rules

        listed = json.loads(b.cli("sessions", "--json").stdout)
        assert [(s["session_id"], s["kind"], s["listener_endpoint"], s["user"]) for s in listed["live"]] == [
            (sid, "ssh", endpoint, account.name)]
        wait_until(lambda: any(x.get("command") == "id -un" and x.get("exit_code") == 0
                               for x in activity(dp, b_id, sid, "ssh")), 10, "the command's activity report")

        # A live remote command, then the revocation: the client is told and disconnected.
        live = lab.spawn(a.node.wrap(ssh_argv(token, account.name, endpoint, "sleep 60")),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: json.loads(b.cli("sessions", "--json").stdout)["live"][0]["connections"] == 1, 15,
                   "the live connection", daemons)
        revoked_at = time.monotonic()
        dp.admin.revoke_session(b_id, sid)
        _, err = live.communicate(timeout=15)
        closed_after = time.monotonic() - revoked_at
        print(f"revocation to ssh client gone: {closed_after * 1000:.0f} ms")
        assert live.returncode != 0 and "revoked" in err, err
        refused = lab.exec(a.node, ssh_argv(token, account.name, endpoint, "id -un"), check=False)
        assert refused.returncode != 0 and account.name not in refused.stdout
        wait_until(lambda: any(x.get("terminated_by") == "operator_revoke" for x in activity(dp, b_id, sid, "ssh")),
                   10, "the session_ended report")
        wait_until(lambda: session_rules(lab, b.node) == [], 10, "the session's rules to go")

        # -- TCP: a listener that forwards to its target and nothing else ---------------------------------------------
        tcp = dp.admin.create_session(b_id, "tcp", 600, host="127.0.0.1", port=ECHO_PORT)["session"]
        tid = tcp["session_id"]
        wait_until(lambda: listener_of(dp, b_id, tid), 15, "b to report the TCP session's listener", daemons)
        host, port = listener_of(dp, b_id, tid).rsplit(":", 1)
        echoed = lab.exec(a.node, [sys.executable, "-c", SEND, host, port, "hello through the session"], check=False)
        assert echoed.stdout.strip() == "hello through the session", echoed.stderr
        assert not connects(lab, c.node, host, int(port))
        assert not connects(lab, a.node, b_ip, ECHO_PORT)  # the target itself is b's loopback only
        # Around the firewall (whose rules match the mesh interface): a LAN host that routes b's mesh IP through
        # b, and a program on b itself, both reach b's mesh IP, but not the session: its listener takes only what
        # arrives on the mesh interface (Linux answers for a local address on any interface).
        lan_host = lab.add_lan_host(b.node, "10.231.254.0/24")
        assert ping_count(lab, lan_host, b_ip, 1, 0.2) == 1  # b's mesh IP answers on the LAN
        assert not connects(lab, lan_host, host, int(port))
        assert not connects(lab, b.node, host, int(port))
        echoed = lab.exec(a.node, [sys.executable, "-c", SEND, host, port, "still through"], check=False)
        assert echoed.stdout.strip() == "still through", echoed.stderr
        # b's mesh interface deleted (its wireguard-go goes with it) and made again: a new interface index. The
        # listener's filter is moved to it in place: the same port, and a connection open across it goes on.
        held = lab.spawn(a.node.wrap([sys.executable, "-c", HOLD, host, port]), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        try:
            held.stdin.write("before\n")
            held.stdin.flush()
            assert held.stdout.readline().strip() == "before"
            lab.exec(b.node, ["ip", "link", "del", "plexd0"])
            for _ in range(2):  # the interface back, then the sessions see its new index (or an event's apply did)
                b.cli("reconcile", "--once")
            assert "session_listener_rebound" in b.logged(), b.logged()[-3000:]
            held.stdin.write("across\n")
            held.stdin.flush()
            assert held.stdout.readline().strip() == "across"
        finally:
            held.kill()
            held.wait()
        assert listener_of(dp, b_id, tid) == f"{host}:{port}"
        dp.admin.revoke_session(b_id, tid)
        wait_until(lambda: any(x.get("phase") == "session_ended" and x.get("terminated_by") == "operator_revoke"
                               and x.get("bytes_in") == len("hello through the sessionstill throughbeforeacross")
                               for x in activity(dp, b_id, tid, "tcp")), 10, "the TCP session's end and its bytes")
        assert not connects(lab, a.node, host, int(port))

        # -- Leaving the mesh closes what is left, and tells the client why ------------------------------------
        created = dp.admin.create_session(b_id, "ssh", 600, user=account.name)
        sid, token = created["session"]["session_id"], created["token"]
        wait_until(lambda: listener_of(dp, b_id, sid), 15, "the second SSH session's listener", daemons)
        live = lab.spawn(a.node.wrap(ssh_argv(token, account.name, listener_of(dp, b_id, sid), "sleep 60")),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: json.loads(b.cli("sessions", "--json").stdout)["live"][0]["connections"] == 1, 15,
                   "the live connection", daemons)
        b.stop()  # SIGTERM: deregisters (shutdown.deregister: true)
        _, err = live.communicate(timeout=15)
        assert live.returncode != 0 and "leaving the mesh" in err, err
        wait_until(lambda: any(x.get("terminated_by") == "plexd_close" for x in activity(dp, b_id, sid, "ssh")),
                   10, "the session_ended report sent before the node left", evidence=lambda: b.logged()[-4000:])
