"""Cost of building the desired model: one event's peer against an N-peer model, and a full N-peer state pull.

    .venv/bin/python -m bench desired_model [--peers 1000] [--repeat 200]

Measures the validation and route-limit checks every peer goes through as it enters the model (plexd/state/desired.py,
plexd/state/route_limits.py), in process, with warm caches (as in a running daemon) and cold.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import time

from plexd.state.desired import DesiredState
from plexd.state.model import Peer, State
from plexd.state.route_limits import RouteLimits, address


def key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def peers(n: int) -> tuple[Peer, ...]:
    out = []
    for i in range(n):
        mesh = f"10.100.{i // 250}.{i % 250 + 1}"
        endpoint = f"192.0.{i // 250}.{i % 250 + 1}:51820"
        out.append(Peer(id=f"n_{i:05d}", public_key=key(), mesh_ip=mesh, endpoint=endpoint,
                        allowed_ips=(f"{mesh}/32",)))
    return tuple(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=200)
    args = p.parse_args()
    base = DesiredState.initial(interface="plexd0", listen_port=51820, mtu=1420, mesh_ip="10.200.0.1",
                                private_key=key()).with_route_limits(
        RouteLimits(frozenset({address("198.51.100.10"), address("192.0.2.250")})))
    state = State(peers=peers(args.peers))
    t = time.perf_counter()
    model = base.with_state(state)
    cold = time.perf_counter() - t
    fulls = []
    for _ in range(10):
        t = time.perf_counter()
        model = base.with_state(state)
        fulls.append(time.perf_counter() - t)
    events = []
    for i in range(args.repeat):
        new = Peer(id=f"n_new{i}", public_key=key(), mesh_ip=f"10.101.{i // 250}.{i % 250 + 1}",
                   allowed_ips=(f"10.101.{i // 250}.{i % 250 + 1}/32",))
        t = time.perf_counter()
        model.with_peer(new)
        events.append(time.perf_counter() - t)
    print(f"peers: {args.peers}  accepted: {len(model.peers)}  refused: {len(model.rejected)}")
    print(f"full state, cold caches: {cold * 1000:.2f} ms")
    print(f"full state, warm: median {statistics.median(fulls) * 1000:.2f} ms")
    print(f"one event's peer: median {statistics.median(events) * 1000:.3f} ms, "
          f"p99 {sorted(events)[int(len(events) * 0.99) - 1] * 1000:.3f} ms")


if __name__ == "__main__":
    main()
