"""`plexd doctor`'s checks, each verdict from controlled inputs, and the runner that keeps a broken or hanging check
to its own line.

Stand-ins, where the real part cannot be arranged on these machines: the kernel's WireGuard module (the host
kernel has none: `kernel_wireguard`), systemd as PID 1 (`systemd_booted` and recorded `systemctl` /
`systemd-analyze` answers), a NAT of each type (recorded discoveries), a foreign interface or a route in the mesh
range (recorded `ip -j` answers: the host's own network is not ours to change) and the control plane's answers
(`Reach` values; the real steps against real servers are in tests/integration/test_doctor_cli.py). The trusted
directories and /dev/net/tun are real.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest

from plexd.config import settings
from plexd.machine.nft import FirewallError
from plexd.nat.discovery import Discovery
from plexd.nat.stun import Mapped
from plexd.node import doctor_checks as c
from plexd.node.doctor import CHECKS, Check, Report, run_checks, run_doctor
from plexd.node.doctor_checks import FAIL, OK, WARN, Context, Ran, Result
from plexd.node.doctor_reach import Reach, call_with_timeout


def config(tmp_path, text: str = ""):
    path = tmp_path / "config.yaml"
    path.write_text(f"api: {{url: https://cp.example:8443}}\ndata_dir: {tmp_path / 'data'}\n"
                    f"hooks: {{dir: {tmp_path / 'hooks'}}}\n{text}")
    return settings.load(str(path), env={})


def ctx(tmp_path, text: str = "", **parts) -> Context:
    return Context(config(tmp_path, text), **parts)


def answers(table: dict[str, Ran | str]):
    """A command runner answering from `table` (argv joined by spaces -> Ran or stdout)."""
    asked = []

    def run(argv, timeout=None):
        key = " ".join(argv)
        asked.append(key)
        found = table.get(key)
        if found is None:
            return Ran(1, "", f"unexpected command {key}")
        return found if isinstance(found, Ran) else Ran(0, found, "")

    run.asked = asked
    return run


# -- the WireGuard backend ----------------------------------------------------------------------------------------


def test_wireguard_kernel_module_is_ok(tmp_path):
    found = c.check_wireguard(ctx(tmp_path, kernel_wireguard=lambda: True))
    assert found.verdict == OK and "kernel WireGuard" in found.detail


def test_wireguard_kernel_backend_without_module_fails(tmp_path):
    found = c.check_wireguard(ctx(tmp_path, "mesh: {backend: kernel}\n", kernel_wireguard=lambda: False))
    assert found.verdict == FAIL and "modprobe wireguard" in found.fix


def test_wireguard_userspace_needs_its_binary(tmp_path):
    found = c.check_wireguard(ctx(tmp_path, kernel_wireguard=lambda: False, which=lambda name: None))
    assert found.verdict == FAIL and "wireguard-go is not on PATH" in found.detail
    assert "apt-get install wireguard-go" in found.fix


def test_wireguard_userspace_needs_a_tun_device(tmp_path):
    plain = tmp_path / "tun"
    plain.write_text("")
    for path, why in ((tmp_path / "missing", "does not exist"), (plain, "is not a character device")):
        found = c.check_wireguard(ctx(tmp_path, kernel_wireguard=lambda: False, which=lambda name: "/usr/bin/wg-go",
                                      tun_path=str(path)))
        assert found.verdict == FAIL and why in found.detail and "modprobe tun" in found.fix


@pytest.mark.skipif(not os.path.exists("/dev/net/tun") or os.geteuid() != 0, reason="needs /dev/net/tun and root")
def test_wireguard_userspace_with_the_real_tun_device(tmp_path):
    found = c.check_wireguard(ctx(tmp_path, "mesh: {backend: userspace}\n", which=lambda name: "/usr/bin/wg-go",
                                  kernel_wireguard=lambda: pytest.fail("userspace never asks the kernel")))
    assert found == Result(OK, "userspace /usr/bin/wg-go with /dev/net/tun")


# -- nftables and capabilities ------------------------------------------------------------------------------------


def test_nftables_verdicts(tmp_path):
    def broken():
        raise FirewallError("the kernel refuses nftables (Operation not permitted); is nf_tables loaded?")

    assert c.check_nftables(ctx(tmp_path, nftables_probe=lambda: None)).verdict == OK
    found = c.check_nftables(ctx(tmp_path, nftables_probe=broken))
    assert found.verdict == FAIL and "Operation not permitted" in found.detail and "nf_tables" in found.fix
    off = c.check_nftables(ctx(tmp_path, "policy: {enabled: false}\n", nftables_probe=broken))
    assert off.verdict == WARN and "policy.enabled is false" in off.detail


@pytest.mark.parametrize("capeff,verdict,named", [
    ("0000000000003000", OK, "CAP_NET_ADMIN and CAP_NET_RAW are effective"),  # bits 12 and 13
    ("000001fffeffffff", OK, "CAP_NET_ADMIN and CAP_NET_RAW are effective"),  # root's
    ("0000000000000000", FAIL, "lacks CAP_NET_ADMIN and CAP_NET_RAW"),
    ("0000000000001000", FAIL, "lacks CAP_NET_RAW"),
    ("0000000000002000", FAIL, "lacks CAP_NET_ADMIN"),
])
def test_capabilities_from_capeff(tmp_path, capeff, verdict, named):
    status = tmp_path / "status"
    status.write_text(f"Name:\tplexd\nCapInh:\t0000000000000000\nCapEff:\t{capeff}\n")
    found = c.check_capabilities(ctx(tmp_path, proc_status=str(status)))
    assert found.verdict == verdict and named in found.detail
    assert bool(found.fix) == (verdict == FAIL)


def test_capabilities_unreadable(tmp_path):
    found = c.check_capabilities(ctx(tmp_path, proc_status=str(tmp_path / "nope")))
    assert found.verdict == FAIL and "cannot read CapEff" in found.detail


# -- the control plane and the clock ------------------------------------------------------------------------------


def reached(**kw) -> Reach:
    base = {"url": "https://cp.example:8443", "address": "192.0.2.10", "status": 200, "tls": "verified",
            "server_date": 1000.0, "local_time": 1000.5, "seconds": 0.02}
    return Reach(**{**base, **kw})


def with_reach(tmp_path, found: Reach, text: str = "", **parts) -> Context:
    return ctx(tmp_path, text, probe_control_plane=lambda config: found, **parts)


def test_control_plane_verdicts(tmp_path):
    assert c.check_control_plane(with_reach(tmp_path, reached())).verdict == OK
    plain = c.check_control_plane(with_reach(tmp_path, reached(url="http://cp:8080", tls="")))
    assert plain.verdict == WARN and "plain http://" in plain.detail and "https://" in plain.fix
    unverified = c.check_control_plane(with_reach(tmp_path, reached(tls="unverified")))
    assert unverified.verdict == WARN and "without certificate verification" in unverified.detail
    refused = reached(step="TCP", error="TCP: connection refused by 192.0.2.10:8443", fix="is it running?", status=0)
    found = c.check_control_plane(with_reach(tmp_path, refused))
    assert found.verdict == FAIL and "TCP: connection refused" in found.detail and found.fix == "is it running?"


def test_the_control_plane_is_reached_once_for_every_check(tmp_path):
    calls = []
    context = ctx(tmp_path, probe_control_plane=lambda config: calls.append(1) or reached())
    run_checks(context, [Check("control_plane", c.check_control_plane), Check("clock", c.check_clock),
                         Check("mtu", c.check_mtu)])
    assert calls == [1]


@pytest.mark.parametrize("offset,verdict,words", [
    (0.0, OK, "in step with"),
    (3.0, OK, "about 3s behind"),
    (-12.0, WARN, "about 12s ahead of"),
    (120.0, FAIL, "about 120s behind"),
])
def test_clock_skew_against_the_date_header(tmp_path, offset, verdict, words):
    # local_time is 0.5 s after the Date's second began: the middle of the second a Date stands for
    found = c.check_clock(with_reach(tmp_path, reached(server_date=1000.0 + offset, local_time=1000.5)))
    assert found.verdict == verdict and words in found.detail
    assert ("timedatectl" in found.fix) == (verdict != OK)


def test_no_control_plane_configured(tmp_path):
    cfg = config(tmp_path)
    context = Context(replace(cfg, api=replace(cfg.api, url="")))  # reaches the real probe: it stops at the config
    cp, clock = c.check_control_plane(context), c.check_clock(context)
    assert cp.verdict == FAIL and "no control plane configured" in cp.detail and "plexd doctor --api URL" in cp.fix
    assert clock == Result(WARN, "not checked: no control plane configured", "see the control_plane line")
    assert c.check_mtu(context).verdict == WARN


def test_clock_not_checked_without_an_answer_or_a_date(tmp_path):
    down = c.check_clock(with_reach(tmp_path, reached(step="DNS", error="DNS: ...", server_date=None)))
    assert down.verdict == WARN and "not checked: the control plane did not answer (DNS)" in down.detail
    dateless = c.check_clock(with_reach(tmp_path, reached(server_date=None)))
    assert dateless.verdict == WARN and "no Date header" in dateless.detail


# -- the MTU along the path ---------------------------------------------------------------------------------------


def route_and_link(dev: str, mtu: int, cached: int = 0) -> dict[str, str]:
    hop = {"dst": "192.0.2.10", "gateway": "192.0.2.1", "dev": dev, "flags": [], "cache": []}
    if cached:
        hop["metrics"] = [{"mtu": cached}]
    return {"ip -j route get 192.0.2.10": json.dumps([hop]),
            f"ip -j link show dev {dev}": json.dumps([{"ifname": dev, "mtu": mtu}])}


@pytest.mark.parametrize("table,verdict,words,fix", [
    (route_and_link("eth0", 1500), OK, "via eth0 (MTU 1500) holds mesh.mtu 1420 + 80", ""),
    (route_and_link("eth0", 1400), FAIL, "cannot hold mesh.mtu 1420 + 80 bytes", "set mesh.mtu: 1320 (or less)"),
    (route_and_link("eth0", 1500, cached=1450), FAIL, "MTU 1450, a learnt path MTU", "set mesh.mtu: 1370"),
    (route_and_link("plexd0", 1420), FAIL, "routed through the mesh interface plexd0 itself", "uplink"),
])
def test_mtu_towards_the_control_plane(tmp_path, table, verdict, words, fix):
    found = c.check_mtu(with_reach(tmp_path, reached(), run=answers(table)))
    assert found.verdict == verdict and words in found.detail, found
    assert fix in found.fix and bool(found.fix) == bool(fix)


def test_mtu_with_a_smaller_mesh_mtu_fits(tmp_path):
    found = c.check_mtu(with_reach(tmp_path, reached(), "mesh: {mtu: 1320}\n", run=answers(route_and_link("e", 1400))))
    assert found.verdict == OK


def test_mtu_not_checked_without_an_address(tmp_path):
    found = c.check_mtu(with_reach(tmp_path, reached(step="DNS", address=""), run=answers({})))
    assert found.verdict == WARN and "not checked" in found.detail


# -- routes and an interface in the mesh's way --------------------------------------------------------------------


def main_table(*routes: dict) -> dict[str, str]:
    return {"ip -j -4 route show table main": json.dumps([{"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
                                                          *routes])}


@pytest.mark.parametrize("route,verdict,words", [
    ({"dst": "192.0.2.0/24", "dev": "eth0"}, OK, "no route in the main table claims policy.mesh_range"),
    ({"dst": "10.100.0.0/16", "dev": "plexd0"}, OK, "no route"),  # the mesh interface's own
    ({"dst": "10.100.5.0/24", "dev": "eth1"}, FAIL, "10.100.5.0/24 via eth1 (mesh range 10.100.0.0/16)"),
    ({"dst": "10.100.0.0/16", "dev": "docker0"}, FAIL, "10.100.0.0/16 via docker0"),
    ({"dst": "10.100.0.7", "type": "blackhole"}, FAIL, "10.100.0.7 blackhole"),
    ({"dst": "10.0.0.0/8", "dev": "vpn0"}, WARN, "10.0.0.0/8 via vpn0"),
])
def test_routes_in_the_mesh_range(tmp_path, route, verdict, words):
    found = c.check_mesh_routes(ctx(tmp_path, run=answers(main_table(route))))
    assert found.verdict == verdict and words in found.detail, found
    assert bool(found.fix) == (verdict != OK)


def test_routes_check_names_a_failing_ip(tmp_path):
    missing = {"ip -j -4 route show table main": Ran(127, "", "cannot run ip: No such file or directory")}
    found = c.check_mesh_routes(ctx(tmp_path, run=answers(missing)))
    assert found.verdict == FAIL and "ip route show failed" in found.detail and "iproute2" in found.fix


def link(kind: str | None) -> dict[str, str | Ran]:
    doc = {"ifname": "plexd0", "mtu": 1420}
    if kind:
        doc["linkinfo"] = {"info_kind": kind}
    return {"ip -j -d link show dev plexd0": json.dumps([doc])}


@pytest.mark.parametrize("table,verdict,words", [
    ({"ip -j -d link show dev plexd0": Ran(1, "", 'Device "plexd0" does not exist.')}, OK, "does not exist yet"),
    (link("wireguard"), OK, "is a wireguard device"),
    (link("tun"), OK, "is a tun device"),
    (link("dummy"), FAIL, "is a dummy device, not WireGuard"),
    (link(None), FAIL, "is a plain device"),
])
def test_an_existing_mesh_interface(tmp_path, table, verdict, words):
    found = c.check_mesh_interface(ctx(tmp_path, run=answers(table)))
    assert found.verdict == verdict and words in found.detail
    if verdict == FAIL:
        assert "ip link del plexd0" in found.fix


# -- trusted directories (real directories) -----------------------------------------------------------------------


def test_trusted_dirs_ok_and_not_yet_created(tmp_path):
    (tmp_path / "data").mkdir(mode=0o700)
    found = c.check_trusted_dirs(ctx(tmp_path))
    assert found.verdict == OK and f"data_dir {tmp_path / 'data'} and hooks.dir" in found.detail
    assert "(not created yet)" in found.detail  # hooks.dir


def test_trusted_dirs_writable_by_others_fails(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    hooks.chmod(0o777)
    found = c.check_trusted_dirs(ctx(tmp_path))
    assert found.verdict == FAIL and f"hooks.dir {hooks}" in found.detail and "writable by group or other" in \
        found.detail
    assert "chmod go-w" in found.fix


# -- STUN and the NAT type ----------------------------------------------------------------------------------------

PUBLIC = Mapped("203.0.113.7", 40000)


@pytest.mark.parametrize("found,verdict,words", [
    (Discovery(PUBLIC, "none", PUBLIC, "s1:3478"), OK, "no NAT"),
    (Discovery(PUBLIC, "full_cone", Mapped("10.0.0.2", 5), "s1:3478"), OK, "endpoint-independent"),
    (Discovery(PUBLIC, "symmetric", Mapped("10.0.0.2", 5), "s1:3478"), WARN, "the relay (a bridge) is needed"),
    (Discovery(PUBLIC, "unknown", Mapped("10.0.0.2", 5), "s1:3478"), WARN, "only one STUN server answered"),
    (Discovery(None, "unknown", failures=(("s1:3478", "no answer within 2s"),)), FAIL, "s1:3478: no answer"),
])
def test_stun_verdicts(tmp_path, found, verdict, words):
    got = c.check_stun(ctx(tmp_path, "nat_traversal: {stun_servers: ['192.0.2.50']}\n",
                           discover_nat=lambda config: found))
    assert got.verdict == verdict and words in got.detail
    assert bool(got.fix) == (verdict != OK)


def test_stun_not_configured_or_off_is_one_line(tmp_path):
    never = {"discover_nat": lambda config: pytest.fail("nothing to ask")}
    assert "no STUN servers configured" in c.check_stun(ctx(tmp_path, **never)).detail
    off = c.check_stun(ctx(tmp_path, "nat_traversal: {enabled: false, stun_servers: ['192.0.2.50']}\n", **never))
    assert off.verdict == OK and "nat_traversal.enabled: false" in off.detail


# -- systemd ------------------------------------------------------------------------------------------------------

SHOW = "systemctl show plexd.service --property=LoadState,ActiveState,SubState,UnitFileState"
SECURITY = "systemd-analyze security plexd.service --no-pager"


def unit(active: str = "active", sub: str = "running", load: str = "loaded", score: str = "2.3 OK") -> dict:
    return {SHOW: f"LoadState={load}\nActiveState={active}\nSubState={sub}\nUnitFileState=enabled\n",
            SECURITY: f"  NAME  DESCRIPTION  EXPOSURE\n→ Overall exposure level for plexd.service: {score} :-)\n"}


@pytest.mark.parametrize("table,verdict,words", [
    (unit(), OK, "plexd.service active (running), enabled; systemd-analyze security: 2.3 OK"),
    (unit("failed", "failed"), FAIL, "plexd.service failed (failed)"),
    (unit("activating", "auto-restart"), FAIL, "plexd.service activating (auto-restart)"),
    (unit("activating", "start"), WARN, "plexd.service activating (start)"),
    (unit("inactive", "dead"), WARN, "inactive (dead)"),
    (unit(score="6.1 MEDIUM"), WARN, "looser than the shipped unit"),
    (unit(load="not-found"), WARN, "plexd.service is not installed"),
])
def test_systemd_unit_state_and_score(tmp_path, table, verdict, words):
    found = c.check_systemd(ctx(tmp_path, systemd_booted=lambda: True, run=answers(table)))
    assert found.verdict == verdict and words in found.detail, found
    assert bool(found.fix) == (verdict != OK)


def test_systemd_not_pid_1_is_one_line_saying_so(tmp_path, monkeypatch):
    monkeypatch.delenv("PLEXD_TEST_NO_SYSTEMD", raising=False)
    comm = tmp_path / "comm"
    comm.write_text("tini\n")
    found = c.check_systemd(ctx(tmp_path, systemd_booted=lambda: False, pid1_comm=str(comm),
                                run=lambda *a, **k: pytest.fail("nothing to ask")))
    assert found == Result(OK, "not checked: systemd is not PID 1 here (PID 1 is tini)")


# -- the runner ---------------------------------------------------------------------------------------------------


def test_a_check_that_raises_or_hangs_is_its_own_failure(tmp_path):
    def boom(context):
        raise RuntimeError("boom")

    def hang(context):
        time.sleep(3)

    started = time.monotonic()
    out = run_checks(ctx(tmp_path), [Check("first", lambda context: Result(OK, "fine")), Check("boom", boom),
                                     Check("hang", hang, timeout=0.2), Check("odd", lambda context: "yes")])
    assert time.monotonic() - started < 1.5  # the hanging check is left behind, not waited for
    assert [(o.name, o.verdict) for o in out] == [("first", OK), ("boom", FAIL), ("hang", FAIL), ("odd", FAIL)]
    assert out[1].detail == "the check could not run: RuntimeError: boom"
    assert out[2].detail == "did not finish within 0.2s"
    assert "returned 'yes'" in out[3].detail


def test_report_exit_and_text(tmp_path):
    checks = [Check("a", lambda context: Result(OK, "fine", "never shown")),
              Check("bb", lambda context: Result(WARN, "hm", "do this"))]
    report = run_doctor(config(tmp_path), checks)
    assert report.ok and report.count(WARN) == 1
    lines = report.text().splitlines()
    assert lines[0] == "ok    a   fine"
    assert lines[1] == "warn  bb  hm -> fix: do this"
    assert lines[2].startswith("2 checks: 0 failed, 1 warning (config: ")
    failed = replace(report, outcomes=[*report.outcomes, replace(report.outcomes[0], verdict=FAIL)])
    assert not failed.ok and failed.to_json()["failed"] == 1
    doc = report.to_json()
    assert doc["ok"] is True and [x["name"] for x in doc["checks"]] == ["a", "bb"] and doc["checks"][0]["fix"] == ""


def test_the_check_list():
    names = [check.name for check in CHECKS]
    assert len(names) == len(set(names))
    assert {"wireguard", "nftables", "capabilities", "clock", "control_plane", "stun", "mtu", "mesh_routes",
            "mesh_interface", "trusted_dirs", "systemd"} == set(names)
    assert all(0 < check.timeout <= 15 for check in CHECKS)
    assert isinstance(Report(None, []).ok, bool)


def test_call_with_timeout():
    assert call_with_timeout(lambda: 7, 1) == 7
    with pytest.raises(TimeoutError):
        call_with_timeout(lambda: time.sleep(2), 0.1)
    with pytest.raises(OSError):
        call_with_timeout(lambda: (_ for _ in ()).throw(OSError("no")), 1)
