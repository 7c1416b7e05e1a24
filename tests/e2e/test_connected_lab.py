"""The connected state end to end: real `plexd up` daemons in network namespaces (real wireguard-go), the real
devplane on the lab bridge.

1. An admin action (new node, endpoint change, removed node) reaches every node's device through the signed
   event stream, long before the (10 min) reconcile interval.
2. Drift made by hand (a peer removed with `wg set`, the mesh address and a route deleted with `ip`) is corrected
   within one reconcile interval, and the devplane holds a drift report naming each correction.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from nacl.public import PrivateKey

from plexd.devplane.harness import Devplane
from plexd.lab import Lab, LabNode

PLEXD = str(Path(sys.executable).with_name("plexd"))


class Daemon:
    def __init__(self, lab: Lab, node: LabNode, dp: Devplane, workdir: Path, reconcile: str,
                 extra_config: str = "") -> None:
        self.lab = lab
        self.node = node
        self.dir = workdir / node.name
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "token").write_text(dp.admin.create_token())
        self.config = self.dir / "config.yaml"
        self.config.write_text(
            f"api: {dp.url}\ndata_dir: {self.dir / 'data'}\ntoken: {{file: {self.dir / 'token'}}}\n"
            f"hooks: {{dir: {self.dir / 'hooks'}}}\nmesh: {{interface: plexd0, backend: userspace}}\n"
            f"reconcile: {{interval: {reconcile}}}\nheartbeat: {{interval: 2s}}\n"
            "registration: {hostname: " + node.name + "}\n" + extra_config)
        self.runs = 0
        self._start()

    def _start(self) -> None:
        self.runs += 1
        self.log_path = self.dir / ("plexd.log" if self.runs == 1 else f"plexd-{self.runs}.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {"PATH": os.environ["PATH"], "PLEXD_CONFIG": str(self.config)}
        self.proc = self.lab.spawn(self.node.wrap([PLEXD, "up"]), env=env, stdout=self.log,
                                   stderr=subprocess.STDOUT)

    def restart(self) -> None:
        self.stop()
        self._start()

    def stop(self) -> float:
        """SIGTERM, wait for the exit (SIGKILL after 20 s); returns how long the shutdown took."""
        start = time.monotonic()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if not self.log.closed:
            self.log.close()
        return time.monotonic() - start

    def logged(self) -> str:
        return self.log_path.read_text()

    def node_id(self) -> str | None:
        ident = self.dir / "data" / "identity.json"
        if not ident.exists():
            return None
        import json

        return json.loads(ident.read_text())["node_id"]


def wg_peers(lab: Lab, node: LabNode) -> dict[str, str]:
    """public key -> endpoint, as `wg show plexd0 dump` sees the live device."""
    out = lab.exec(node, ["wg", "show", "plexd0", "dump"], check=False)
    if out.returncode != 0:
        return {}
    lines = out.stdout.splitlines()[1:]
    return {f[0]: f[2] for f in (line.split("\t") for line in lines)}


def wait_until(pred, timeout: float, what: str, daemons=()) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if pred():
            return time.monotonic() - start
        time.sleep(0.1)
    logs = "\n".join(f"--- {d.node.name}\n{d.logged()[-3000:]}" for d in daemons)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


@pytest.fixture
def lab_dp(tmp_path, request):
    lab = Lab().up(getattr(request, "param", 3))
    dp = None
    daemons: list[Daemon] = []
    try:
        dp = Devplane(tmp_path / "dp", listen=f"{lab.bridge_address}:0", keepalive="5s")
        dp.start()
        yield lab, dp, daemons, tmp_path
    finally:
        for d in daemons:
            d.stop()
        if dp is not None:
            dp.stop()
        lab.down()
        assert lab.leaks() == []


def start_mesh(lab, dp, daemons, tmp_path, reconcile: str, count: int = 3) -> None:
    for node in lab.nodes[:count]:
        daemons.append(Daemon(lab, node, dp, tmp_path, reconcile))
    keys = lambda: {n["public_key"] for n in dp.admin.nodes()}  # noqa: E731
    wait_until(lambda: len(dp.admin.nodes()) == count, 30, "registration", daemons)
    for d in daemons:
        wait_until(lambda d=d: len(wg_peers(lab, d.node)) == count - 1 and set(wg_peers(lab, d.node)) < keys(),
                   30, f"{d.node.name} to list the other nodes", daemons)


def register_ghost(dp: Devplane, hostname: str) -> tuple[dict, str]:
    """A node that exists only in the control plane (no tunnel, so no handshake protects its endpoint)."""
    token = dp.admin.create_token()
    pub = base64.b64encode(bytes(PrivateKey.generate().public_key)).decode()
    r = httpx.post(f"{dp.url}/v1/register", headers={"Authorization": f"Bearer {token}"},
                   json={"token": token, "public_key": pub, "hostname": hostname}, timeout=10)
    r.raise_for_status()
    return r.json(), pub


def test_admin_actions_reach_every_device_through_the_stream(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    start_mesh(lab, dp, daemons, tmp_path, reconcile="10m")
    nodes = [d.node for d in daemons]

    # a new node (a 4th plexd) appears on every device without waiting for a reconcile
    lab.add_node()
    new = Daemon(lab, lab.nodes[3], dp, tmp_path, reconcile="10m")
    daemons.append(new)
    wait_until(lambda: new.node_id() is not None, 30, "the 4th node to register", daemons)
    new_key = dp.admin.node(new.node_id())["public_key"]
    took = wait_until(lambda: all(new_key in wg_peers(lab, n) for n in nodes), 15, "the new node everywhere",
                      daemons)
    assert took < 15

    # an endpoint changed by the admin is applied through the stream
    ghost, ghost_key = register_ghost(dp, "px-ghost")
    wait_until(lambda: all(ghost_key in wg_peers(lab, n) for n in nodes), 15, "the ghost peer", daemons)
    dp.admin.set_node_endpoint(ghost["node_id"], "192.0.2.77:51820")
    wait_until(lambda: all(wg_peers(lab, n).get(ghost_key) == "192.0.2.77:51820" for n in nodes), 15,
               "the new endpoint everywhere", daemons)

    # a removed node disappears from every device
    dp.admin.forget_node(ghost["node_id"])
    wait_until(lambda: all(ghost_key not in wg_peers(lab, n) for n in nodes), 15, "the removal everywhere",
               daemons)
    # and none of that came from a reconcile: no drift was reported (events are not drift)
    for d in daemons[:3]:
        assert dp.admin.drift(d.node_id()) == []


def test_drift_made_by_hand_is_corrected_and_reported(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    start_mesh(lab, dp, daemons, tmp_path, reconcile="3s")
    a, b, c = daemons
    node_a = a.node_id()
    info = {n["id"]: n for n in dp.admin.nodes()}
    b_id, c_id = b.node_id(), c.node_id()
    mesh_ip_a = info[node_a]["mesh_ip"]
    drift_before = len(dp.admin.drift(node_a))

    lab.exec(a.node, ["wg", "set", "plexd0", "peer", info[b_id]["public_key"], "remove"])
    # plexd routes the peers' allowed IPs with the fewest prefixes (adjacent mesh IPs share one): delete the
    # route that covers c's mesh IP, whatever its length
    route_c = next(str(ipaddress.ip_network(r.split()[0]))  # `ip route` prints a /32 as the bare address
                   for r in lab.exec(a.node, ["ip", "route", "show", "dev", "plexd0"]).stdout.splitlines()
                   if ipaddress.ip_address(info[c_id]["mesh_ip"]) in ipaddress.ip_network(r.split()[0]))
    lab.exec(a.node, ["ip", "route", "del", route_c, "dev", "plexd0"])
    lab.exec(a.node, ["ip", "addr", "del", f"{mesh_ip_a}/32", "dev", "plexd0"])

    def corrected() -> list[dict]:
        return [c for report in dp.admin.drift(node_a)[drift_before:] for c in report["corrections"]]

    def all_named() -> bool:
        text = " | ".join(f"{c['type']}: {c['detail']}" for c in corrected())
        return b_id in text and mesh_ip_a in text and f"route {route_c} missing" in text

    took = wait_until(all_named, 10, "a drift report naming each correction", daemons)
    assert took <= 3 + 4  # within one reconcile interval (plus the cycle itself)
    types = {c["type"] for c in corrected()}
    assert "peer_added" in types and "address_added" in types and "route_added" in types, corrected()
    # the peer correction is the [C] type (§4.4) with a detail naming the peer
    assert {"type": "peer_added", "detail": f"peer {b_id}: missing from the device"} in corrected()
    # and the machine is whole again
    assert info[b_id]["public_key"] in wg_peers(lab, a.node)
    addrs = lab.exec(a.node, ["ip", "-o", "addr", "show", "dev", "plexd0"]).stdout
    assert mesh_ip_a in addrs
    routes = lab.exec(a.node, ["ip", "route", "show", "dev", "plexd0"]).stdout
    assert route_c.removesuffix("/32") in routes


def wg_endpoint(lab: Lab, node: LabNode, key: str) -> str | None:
    return wg_peers(lab, node).get(key)


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_cursor_and_nonces_survive_a_plexd_up_restart(lab_dp):
    """A real `plexd up` restarted with its data_dir: it resumes after its Last-Event-ID (the event published
    while it was down arrives, nothing before it is re-read) and still refuses a nonce it saw before the restart.

    Every change is one the devplane really holds (nodes registered, an endpoint set by the admin), so a state
    pull agrees with the events; the one raw event re-sends a real change with a chosen nonce."""
    lab, dp, daemons, tmp_path = lab_dp
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, reconcile="10m", extra_config="shutdown: {deregister: false}\n")
    daemons.append(d)
    wait_until(lambda: d.node_id() is not None and "event stream connected" in d.logged(), 30, "the stream", [d])
    node_id = d.node_id()

    a, a_key = register_ghost(dp, "px-ghost-a")
    wait_until(lambda: a_key in wg_peers(lab, d.node), 15, "the first node on the device", [d])
    dp.admin.set_node_endpoint(a["node_id"], "192.0.2.10:51820")
    wait_until(lambda: wg_endpoint(lab, d.node, a_key) == "192.0.2.10:51820", 15, "the admin's endpoint", [d])
    first = dp.admin.publish_event(node_id, "peer_endpoint_changed",
                                   {"peer_id": a["node_id"], "endpoint": "192.0.2.10:51820"},
                                   nonce="px-restart-nonce")
    wait_until(lambda: f"event {first}:" in d.logged(), 15, "the nonce'd event to be applied", [d])

    took = d.stop()
    assert d.proc.returncode == 0 and took < 10, (d.proc.returncode, took)  # shutdown never hangs
    b, b_key = register_ghost(dp, "px-ghost-b")  # its peer_added is published while the daemon is down
    d.restart()
    wait_until(lambda: "event stream connected" in d.logged(), 30, "the stream after the restart", [d])
    again = dp.admin.publish_event(node_id, "peer_endpoint_changed",
                                   {"peer_id": a["node_id"], "endpoint": "192.0.2.99:51820"},
                                   nonce="px-restart-nonce")
    c, c_key = register_ghost(dp, "px-ghost-c")
    wait_until(lambda: c_key in wg_peers(lab, d.node), 15, "the last node on the device", [d])
    wait_until(lambda: f"event {again} (peer_endpoint_changed) rejected" in d.logged(), 15, "the replay", [d])

    log = d.logged()
    assert f"resuming after {first}" in log  # the persisted cursor
    assert f"peer_added {b['node_id']}" in log  # published while down, replayed by the devplane
    assert first not in log.replace(f"resuming after {first}", "")  # never re-read
    assert f"event {again} (peer_endpoint_changed) rejected [duplicate_nonce]" in log
    assert f"event {again}:" not in log
    assert wg_endpoint(lab, d.node, a_key) == "192.0.2.10:51820"  # the refused event changed nothing
    assert f"peer_added {c['node_id']}" in log
    assert {a_key, b_key, c_key} <= set(wg_peers(lab, d.node))
