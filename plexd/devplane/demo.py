"""`plexd-devplane demo [--nodes N] [--nat] [--keep]` / `--down`: the namespace lab.

A bridge and N network namespaces (unique `px*` names, veth, addresses on a private 10.231.X.0/24), the real
devplane on the bridge address, and a real `plexd up` in each namespace with its own private /run/wireguard
(wireguard-go). It waits until every pair of nodes has a WireGuard handshake, prints a table and a ping matrix
over the mesh IPs. With three nodes or more it then applies a policy (only tcp/22 from the first node to the
second) and prints which flows pass and which the nodes' firewalls drop, and who still sees whom; and it opens an
SSH access session on the second node (for a throw-away local account), logs in from the first with the real
`ssh` client and the session token as the password (given to sshpass in its environment, never its arguments,
which `ps` shows to every local user), lists it with `plexd sessions` and revokes it. Then it tears
everything down, unless `--keep` (then `plexd-devplane demo --down` removes it).

With `--nat` every node sits behind its own masquerading router namespace, coturn runs on the "public" bridge,
and the nodes find each other through NAT discovery alone; a table shows what each discovered and reported.

With `--bridge`: a node in bridge mode on the public side and two nodes behind port-randomising (symmetric) NAT
routers, which no direct path can join: they move to the bridge's relay by themselves (`fallback_endpoint`) and
ping each other through it; `plexd peers` shows the path and the relay what it learned.

`--dialect platform` runs the devplane and every node on the platform's contract (docs/platform-dialect.md)
instead of docs/protocol.md; the scenarios are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])


# TCP listeners on 22 and 80 that accept and close: the flows of the demo's policy (and of the policy lab test)
LISTENER = """
import socket, selectors
sel = selectors.DefaultSelector()
for port in (22, 80):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(16); s.setblocking(False); sel.register(s, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept(); conn.close()
"""


def _policy_demo(lab, mesh) -> bool:
    """Only tcp/22 from a to b: check real flows (TCP to listeners on b, ping), and what each node sees."""
    a, b, c = mesh.daemons[:3]
    lab.spawn(b.node.wrap([sys.executable, "-c", LISTENER]))  # stopped with the lab
    mesh.admin.set_policies([{"id": "ssh-only", "rules": [
        {"src": a.node_id, "dst": b.node_id, "port": 22, "protocol": "tcp", "action": "allow"}]}])
    print(f"\npolicy ssh-only: allow tcp/22 from {a.node.name} to {b.node.name}; everything else denied")

    def tcp(src, dst, port: int) -> bool:
        code = f"import socket; socket.create_connection(({dst.mesh_ip!r}, {port}), timeout=1.5); print('ok')"
        return lab.exec(src.node, [sys.executable, "-c", code], check=False).stdout.strip() == "ok"

    def ping(src, dst) -> bool:
        return lab.exec(src.node, ["ping", "-c", "1", "-W", "1", "-q", dst.mesh_ip], check=False).returncode == 0

    flows = [(f"{a.node.name} -> {b.node.name} tcp/22", lambda: tcp(a, b, 22), True),
             (f"{a.node.name} -> {b.node.name} tcp/80", lambda: tcp(a, b, 80), False),
             (f"{a.node.name} -> {b.node.name} ping", lambda: ping(a, b), False),
             (f"{b.node.name} -> {a.node.name} ping", lambda: ping(b, a), False),
             (f"{c.node.name} -> {b.node.name} tcp/22", lambda: tcp(c, b, 22), False)]
    deadline = time.monotonic() + 20
    while True:  # the nodes apply it within moments (policy_updated), not at their next reconcile
        results = [(name, check(), want) for name, check, want in flows]
        if all(got == want for _, got, want in results) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(_table([[name, "pass" if got else "dropped", "ok" if got == want else "UNEXPECTED"]
                  for name, got, want in results], ["FLOW", "RESULT", "AS THE POLICY SAYS"]))
    seen = [[d.node.name, str(len(mesh.lab.exec(d.node, ["wg", "show", "plexd0", "peers"], check=False)
                                 .stdout.split()))] for d in mesh.daemons]
    print("\npeers on each node's device now (peers no rule allows are not configured at all):")
    print(_table(seen, ["NODE", "PEERS"]))
    out = mesh.run_plexd(b, "policies", check=False).stdout
    print(f"\n'plexd policies' on {b.node.name}:\n" + out.rstrip())
    return all(got == want for _, got, want in results)


def _session_demo(lab, mesh) -> bool:
    """An SSH access session over the mesh: minted by the devplane for the second node, used from the first with
    the real OpenSSH client (the token is the password), listed by `plexd sessions`, then revoked."""
    import secrets
    import subprocess

    a, b = mesh.daemons[:2]
    user = f"pxdemo{secrets.token_hex(3)}"  # a throw-away local account to log in as, removed below
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", user], check=True, capture_output=True)
    try:
        created = mesh.admin.create_session(b.node_id, "ssh", 300, user=user)
        sid, token = created["session"]["session_id"], created["token"]
        endpoint = ""
        deadline = time.monotonic() + 20
        while not endpoint and time.monotonic() < deadline:
            endpoint = next((s["listener_endpoint"] for s in mesh.admin.sessions(b.node_id)
                             if s["session_id"] == sid), "")
            time.sleep(0.2)
        if not endpoint:
            print(f"\nSSH session {sid}: {b.node.name} never reported its listener")
            return False
        host, port = endpoint.rsplit(":", 1)
        print(f"\nSSH access session {sid} for {user} on {b.node.name}, listening on {endpoint} (mesh IP, port "
              f"chosen by the kernel); the policy's tcp/22 rule decides who may connect. From {a.node.name}:")
        print(f"  SSHPASS=<token> sshpass -e ssh -p {port} {user}@{host} id -un")
        # The token in sshpass's environment, not its arguments (-p): `ps` shows arguments to every local user.
        done = subprocess.run(a.node.wrap(["sshpass", "-e", "ssh", "-o", "UserKnownHostsFile=/dev/null", "-o",
                                           "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR", "-o",
                                           "ConnectTimeout=5", "-p", port, f"{user}@{host}", "id -un"]),
                              env={**os.environ, "SSHPASS": token}, capture_output=True, text=True, timeout=30)
        print("  " + (done.stdout.strip() or done.stderr.strip()).replace("\n", "\n  "))
        print(f"\n'plexd sessions' on {b.node.name}:\n" + mesh.run_plexd(b, "sessions", check=False).stdout.rstrip())
        mesh.admin.revoke_session(b.node_id, sid)
        print(f"session {sid} revoked: its listener is closed and the token refused from now on")
        return done.returncode == 0 and done.stdout.strip() == user
    finally:
        subprocess.run(["pkill", "-KILL", "-u", user], check=False)
        subprocess.run(["userdel", "-r", user], check=False, capture_output=True)


def _nat_table(lab, mesh) -> bool:
    """What each node behind its router discovered over STUN, and what the devplane was told."""
    rows, ok = [], True
    for d, router in zip(mesh.daemons, lab.routers, strict=False):
        res = mesh.run_plexd(d, "status", "--json", check=False)
        try:
            nat = json.loads(res.stdout).get("nat", {})
        except ValueError:
            nat = {}
        told = mesh.admin.node(d.node_id)
        found = nat.get("public_endpoint", "")
        ok = ok and found == f"{router.public}:{mesh.LISTEN_PORT}"
        has = f"{told['endpoint'] or '-'} ({told['nat_type'] or '-'})"
        rows.append([d.node.name, f"{d.node.address}:{mesh.LISTEN_PORT}", f"{router.name} {router.public}",
                     found or "-", nat.get("nat_type") or "-", has])
    print("\nNAT: each node behind its own masquerading router, discovered over STUN (coturn):")
    print(_table(rows, ["NODE", "PRIVATE", "ROUTER", "DISCOVERED", "NAT TYPE", "DEVPLANE HAS"]))
    return ok


RANDOM_NAT = "masquerade random,fully-random"  # a symmetric NAT: every destination gets its own random port


def _bridge_scenario(lab, mesh) -> bool:
    """`--bridge`: a bridge on the public side, and two nodes each behind a router that randomises ports, so no
    direct path can ever work between them: they move to the bridge's relay by themselves and reach each other."""
    bridge = mesh.start_node(lab.nodes[0], extra="mode: bridge\n")
    routers = [lab.add_router(RANDOM_NAT) for _ in range(2)]
    a, b = (mesh.start_node(lab.add_node(behind=r)) for r in routers)
    print(f"bridge {bridge.node.name} on the public side; {a.node.name} behind {routers[0].name} and "
          f"{b.node.name} behind {routers[1].name}, both routers '{RANDOM_NAT}' (symmetric NAT)", flush=True)
    mesh.wait(lambda: all(d.node_id for d in mesh.daemons), 60, "every node to register")
    for d, router in zip((a, b), routers, strict=True):  # what a control plane learns: the routers' addresses
        mesh.admin.set_node_endpoint(d.node_id, f"{router.public}:{mesh.LISTEN_PORT}")
    relay = f"{bridge.node.address}:51821"
    mesh.admin.set_bridge(bridge.node_id, {"relay": {"endpoint": relay, "sessions": [{
        "session_id": "rel_demo", "peer_a_id": a.node_id, "peer_a_endpoint": f"{routers[0].public}:51820",
        "peer_b_id": b.node_id, "peer_b_endpoint": f"{routers[1].public}:51820",
        "expires_at": "2999-01-01T00:00:00Z"}]}})
    started = time.monotonic()
    print(f"relay session assigned on {bridge.node.name} ({relay}); {a.node.name} and {b.node.name} try the direct "
          "path first...", flush=True)

    def pings() -> bool:
        return lab.exec(a.node, ["ping", "-c", "1", "-W", "1", "-q", b.mesh_ip], check=False).returncode == 0

    try:
        mesh.wait(pings, 60, f"{a.node.name} to reach {b.node.name}")
    except Exception as e:  # the demo says what went wrong and tears down
        print(f"{a.node.name} never reached {b.node.name}: {e}")
        return False
    print(f"{a.node.name} reaches {b.node.name} ({b.mesh_ip}) through the relay, "
          f"{time.monotonic() - started:.1f}s after the assignment\n")
    print(f"'plexd peers' on {a.node.name}:\n" + mesh.run_plexd(a, "peers", check=False).stdout.rstrip())
    status = json.loads(mesh.run_plexd(bridge, "status", "--json", check=False).stdout or "{}")
    sessions = ((status.get("domains") or {}).get("relay") or {}).get("sessions") or []
    rows = [[s["session_id"], s["peer_a_address"], s["peer_b_address"], str(s["packets_a_to_b"]),
             str(s["packets_b_to_a"])] for s in sessions]
    print(f"\nthe relay on {bridge.node.name} (what it learned: the routers' real, randomised ports):")
    print(_table(rows, ["SESSION", "SIDE A", "SIDE B", "PACKETS A->B", "PACKETS B->A"]))
    return bool(rows) and all(int(r[3]) > 0 and int(r[4]) > 0 for r in rows)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    from plexd import __version__
    from plexd.devplane.lab import DEFAULT_STATE_FILE, Lab, LabError, MeshLab

    if getattr(args, "down", False):
        if Lab.down_from_state(DEFAULT_STATE_FILE):
            print(f"removed the kept lab ({DEFAULT_STATE_FILE})")
        else:
            print("no kept lab to remove")
        return 0
    if os.geteuid() != 0:
        print("plexd-devplane demo: needs root (network namespaces, wireguard-go)", file=sys.stderr)
        return 1
    if args.keep and os.path.exists(DEFAULT_STATE_FILE):
        print(f"plexd-devplane demo: a kept lab exists ({DEFAULT_STATE_FILE}); remove it with "
              "'plexd-devplane demo --down' first", file=sys.stderr)
        return 1
    n = max(2, int(args.nodes))
    started = time.monotonic()
    # A SIGTERM or SIGHUP (a closed terminal, `timeout`, CI ending a job) ends the demo through its `finally`, as
    # Ctrl-C does: without this, Python died at once and the whole lab (namespaces, wireguard-go, every plexd, the
    # devplane) stayed behind, each in a session of its own.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    lab = Lab(state_file=DEFAULT_STATE_FILE if args.keep else None)
    mesh = MeshLab(lab, dialect=getattr(args, "dialect", "spec"))
    keep = False
    try:
        nat = getattr(args, "nat", False)
        if getattr(args, "bridge", False):
            lab.up(1)
            print(f"lab {lab.tag}: bridge {lab.bridge} in {lab.switch_netns}, {lab.uplink} {lab.bridge_address}/24",
                  flush=True)
            print(f"devplane on {mesh.start_devplane()}", flush=True)
            ok = _bridge_scenario(lab, mesh)
            if args.keep:
                keep = True
                print(f"\nkept: state in {DEFAULT_STATE_FILE}; remove with 'plexd-devplane demo --down'")
            return 0 if ok else 1
        lab.up(0 if nat else n)
        stun: tuple[str, ...] = ()
        if nat:
            stun = lab.start_stun()
            for _ in range(n):
                lab.add_node(behind=lab.add_router())
            print(f"coturn on {stun[0]} and {stun[1]}; each node behind its own NAT router "
                  f"({', '.join(r.netns for r in lab.routers)})", flush=True)
        print(f"lab {lab.tag}: bridge {lab.bridge} in {lab.switch_netns}, {lab.uplink} {lab.bridge_address}/24, "
              f"{n} namespaces ({', '.join(x.netns for x in lab.nodes)})", flush=True)
        url = mesh.start_devplane()
        print(f"devplane on {url}", flush=True)
        for node in lab.nodes:
            mesh.start_node(node, stun=[f"{a}:3478" for a in stun])
        mesh.wait(lambda: all(d.node_id for d in mesh.daemons), 60, "every node to register")
        registered = time.monotonic() - started
        print(f"{n} nodes registered after {registered:.1f}s", flush=True)
        mesh.wait(mesh.full_handshake_matrix, 60, "a handshake between every pair of nodes")
        took = time.monotonic() - started
        print(f"full handshake matrix after {took:.1f}s from start\n")
        print(_table(mesh.status_rows(), ["NODE", "ID", "MESH IP", "LOCAL ENDPOINT", "PEERS", "LATEST HANDSHAKE"]))
        matrix = mesh.ping_matrix()
        names = [d.node.name for d in mesh.daemons]
        print("\nping over the mesh (row → column):")
        print(_table([[a] + ["-" if a == b else ("ok" if matrix[(a, b)] else "FAIL") for b in names]
                      for a in names], ["FROM \\ TO", *names]))
        ok = all(matrix.values())
        if nat:
            ok = _nat_table(lab, mesh) and ok
        if n >= 3:
            ok = _policy_demo(lab, mesh) and ok
            ok = _session_demo(lab, mesh) and ok  # over the policy's tcp/22 from the first node to the second
        if args.keep:
            keep = True
            version = f"{__version__}+demo"
            checksum = mesh.publish_release(version)
            print(f"\nreleases: signed with the demo release key {mesh.release_key_file} (pinned in every node's "
                  f"upgrade.release_keys); plexd {version} ({checksum[:12]}) is published: upgrade a node with "
                  f"'plexd-devplane admin --url {mesh.url} --token-file {mesh.lab.workdir}/devplane/devplane.db"
                  f".admin-token upgrade {mesh.daemons[0].node_id} {version}'")
            print(f"\nkept: state in {DEFAULT_STATE_FILE}; try 'ip netns exec {lab.nodes[0].netns} ping "
                  f"{mesh.daemons[1].mesh_ip}'; remove with 'plexd-devplane demo --down'")
        return 0 if ok else 1
    except LabError as e:
        print(f"plexd-devplane demo: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        mesh.close()
        if not keep:
            lab.down()
