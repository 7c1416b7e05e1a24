"""The local Prometheus endpoint (plexd.node.metrics) of a real daemon, scraped inside its node and parsed by the
real client library's parser: the families are there, and they move when a drift is corrected."""

from __future__ import annotations

import sys

import pytest
from lab_daemon import Daemon, pinging_pair, wait_until, wg_peers
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from plexd import __version__
from plexd.devplane.lab import Lab

LISTEN = "127.0.0.1:9586"

SCRAPE = """
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", 9586, timeout=10)
c.request(sys.argv[1], sys.argv[2])
r = c.getresponse()
print(r.status, r.getheader("Content-Type"))
sys.stdout.write(r.read().decode())
"""

RAW = """
import socket, sys
s = socket.create_connection(("127.0.0.1", 9586), timeout=10)
s.sendall(sys.argv[1].encode("latin-1"))
print(s.recv(200).split(b"\\r\\n")[0].decode())
"""


def request(lab: Lab, d: Daemon, method: str = "GET", path: str = "/metrics") -> tuple[str, str]:
    out = lab.exec(d.node, [sys.executable, "-c", SCRAPE, method, path]).stdout
    head, _, body = out.partition("\n")
    return head, body


def scrape(lab: Lab, d: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, labels) -> value, from the real parser."""
    head, body = request(lab, d)
    assert head == f"200 {CONTENT_TYPE_LATEST}", head
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


@pytest.mark.parametrize("lab_dp", [2], indirect=True)
def test_the_metrics_endpoint_is_parsed_by_prometheus_and_counts_a_corrected_drift(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    a, b = pinging_pair(lab, dp, daemons, tmp_path, reconcile="1h",
                        a_config=f"metrics: {{enabled: true, listen: '{LISTEN}'}}\n")
    wait_until(lambda: "metrics endpoint on" in a.logged(), 10, "the endpoint", daemons)
    before = scrape(lab, a)
    assert before[("plexd_info", (("version", __version__),))] == 1
    assert before[("plexd_event_stream_state", (("state", "connected"),))] == 1
    assert before[("plexd_events_accepted_total", ())] >= 1
    assert before[("plexd_policy_enforced", ())] == 1 and before[("plexd_peers_desired", ())] == 1
    peer = (("peer", b.node_id()),)
    assert before[("plexd_peer_receive_bytes_total", peer)] > 0  # the first ping went through
    assert 0 <= before[("plexd_peer_last_handshake_age_seconds", peer)] < 180
    assert before[("plexd_queue_depth", (("queue", "actions_outbox"),))] == 0
    assert before[("plexd_queue_depth", (("queue", "drift_reports"),))] == 0  # lanes of the uplink outbox
    assert before[("plexd_queue_dropped_total", (("queue", "session_reports"),))] == 0
    for stream in ("metrics", "logs", "audit"):  # the telemetry queues (plexd.telemetry) are scraped too
        assert before[("plexd_queue_dropped_total", (("queue", f"telemetry_{stream}"),))] == 0
    full = (("kind", "full"),)
    assert before[("plexd_converge_duration_seconds_count", full)] >= 1

    # Drift made by hand (the peer removed), corrected by one reconcile: the counters move by exactly that.
    b_key = dp.admin.node(b.node_id())["public_key"]
    lab.exec(a.node, ["wg", "set", "plexd0", "peer", b_key, "remove"])
    assert b_key not in wg_peers(lab, a.node)
    a.cli("reconcile", "--once")
    after = scrape(lab, a)
    added = ("plexd_corrections_total", (("type", "peer_added"),))
    # drift alone: the start's bring-up and b arriving by event were counted as "drift corrected" too
    assert before.get(added, 0) == 0 and not any(k[0] == "plexd_corrections_total" for k in before), before
    assert after[added] == 1
    assert after[("plexd_reconcile_cycles_total", ())] == before[("plexd_reconcile_cycles_total", ())] + 1
    assert after[("plexd_converge_duration_seconds_count", full)] > before[("plexd_converge_duration_seconds_count",
                                                                            full)]
    assert a.status()["metrics"] == {"listen": LISTEN, "scrapes": 2}

    # Anything but a GET of /metrics gets a clear status and the daemon goes on.
    assert request(lab, a, "GET", "/")[0].startswith("404")
    assert request(lab, a, "POST", "/metrics")[0].startswith("405")
    for raw in ("NONSENSE\r\n\r\n", "GET /metrics HTTP/1.1\r\nX: " + "y" * 10000 + "\r\n\r\n"):
        assert lab.exec(a.node, [sys.executable, "-c", RAW, raw]).stdout.startswith("HTTP/1.1 400"), raw[:20]
    assert scrape(lab, a)[("plexd_info", (("version", __version__),))] == 1
