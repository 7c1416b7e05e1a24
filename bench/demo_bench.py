"""Demo time: from nothing to a full handshake matrix with N nodes (default 3), as `plexd-devplane demo` does it.

Each run builds a fresh lab (bridge + namespaces), starts the devplane on the bridge and `plexd up` in every node,
and stops the clock when every pair of nodes has a WireGuard handshake; then tears it all down.

Run as root:  .venv/bin/python bench/demo_bench.py [--nodes 3] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from plexd.devplane.lab import Lab, MeshLab


def one_run(nodes: int) -> tuple[float, float, float]:
    started = time.monotonic()
    lab = Lab()
    mesh = MeshLab(lab)
    try:
        lab.up(nodes)
        mesh.start_devplane()
        devplane_up = time.monotonic() - started
        for node in lab.nodes:
            mesh.start_node(node)
        mesh.wait(lambda: all(d.node_id for d in mesh.daemons), 60, "registration")
        registered = time.monotonic() - started
        mesh.wait(mesh.full_handshake_matrix, 60, "the full handshake matrix")
        return devplane_up, registered, time.monotonic() - started
    finally:
        mesh.close()
        lab.down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    full = []
    for i in range(args.runs):
        dp, reg, hs = one_run(args.nodes)
        full.append(hs)
        print(f"run {i + 1}: devplane up {dp:.2f}s, all {args.nodes} registered {reg:.2f}s, "
              f"full handshake matrix {hs:.2f}s", flush=True)
    print(f"{args.nodes} nodes, start to full handshake matrix: median {statistics.median(full):.2f}s, "
          f"min {min(full):.2f}s, max {max(full):.2f}s")


if __name__ == "__main__":
    main()
