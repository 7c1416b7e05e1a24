"""`plexd-devplane demo [--nodes N] [--keep]` / `--down`: the namespace lab.

A bridge and N network namespaces (unique `px*` names, veth, addresses on a private 10.231.X.0/24), the real
devplane on the bridge address, and a real `plexd up` in each namespace with its own private /run/wireguard
(wireguard-go). It waits until every pair of nodes has a WireGuard handshake, prints a table and a ping matrix
over the mesh IPs, then tears everything down, unless `--keep` (then `plexd-devplane demo --down` removes it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])


def run(args: argparse.Namespace) -> int:
    from plexd.lab import DEFAULT_STATE_FILE, Lab, LabError, MeshLab

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
    lab = Lab(state_file=DEFAULT_STATE_FILE if args.keep else None)
    mesh = MeshLab(lab)
    keep = False
    try:
        lab.up(n)
        print(f"lab {lab.tag}: bridge {lab.bridge} {lab.bridge_address}/24, {n} namespaces "
              f"({', '.join(x.netns for x in lab.nodes)})", flush=True)
        url = mesh.start_devplane()
        print(f"devplane on {url}", flush=True)
        for node in lab.nodes:
            mesh.start_node(node)
        mesh.wait(lambda: all(d.node_id for d in mesh.daemons), 60, "every node to register")
        registered = time.monotonic() - started
        print(f"{n} nodes registered after {registered:.1f}s", flush=True)
        mesh.wait(mesh.full_handshake_matrix, 60, "a handshake between every pair of nodes")
        took = time.monotonic() - started
        print(f"full handshake matrix after {took:.1f}s from start\n")
        print(_table(mesh.status_rows(), ["NODE", "ID", "MESH IP", "ENDPOINT", "PEERS", "LATEST HANDSHAKE"]))
        matrix = mesh.ping_matrix()
        names = [d.node.name for d in mesh.daemons]
        print("\nping over the mesh (row → column):")
        print(_table([[a] + ["-" if a == b else ("ok" if matrix[(a, b)] else "FAIL") for b in names]
                      for a in names], ["FROM \\ TO", *names]))
        ok = all(matrix.values())
        if args.keep:
            keep = True
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
