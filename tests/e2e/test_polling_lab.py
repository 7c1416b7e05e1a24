"""The polling fallback end to end (docs/decisions.md, Lifecycle: reconnecting the event stream, step 5): the real
devplane refuses the event stream for longer than `sse.polling_after`; the daemon then pulls the full state on the
reconcile schedule and a change made meanwhile reaches the device through those pulls; when the stream is back, polling
stops."""

from __future__ import annotations

import re

import pytest
from lab_daemon import Daemon, register_ghost, wait_until, wg_peers

POLL = "polling while the event stream is down"


def applied_by(d: Daemon, peer_id: str) -> list[str]:
    """The reasons of the reconcile cycles whose log line says they applied peer `peer_id` from the state."""
    return re.findall(r'"msg": "reconcile \(([^)]*)\) applied [^"]*peer_added: peer ' + re.escape(peer_id), d.logged())


def cycles(d: Daemon) -> int:
    return d.status().get("reconcile", {}).get("cycles", 0)


def stream_state(d: Daemon) -> str:
    """connected / polling / offline; "" until the daemon answers on its socket."""
    return d.status().get("event_stream", {}).get("state", "")


@pytest.mark.parametrize("lab_dp", [1], indirect=True)
def test_a_refused_stream_falls_back_to_polling_that_applies_changes_and_stops_when_the_stream_is_back(lab_dp):
    lab, dp, daemons, tmp_path = lab_dp
    d = Daemon(lab, lab.nodes[0], dp, tmp_path, reconcile="3s",
               extra_config="sse: {polling_after: 2s, backoff_base: 200ms, backoff_max: 1s}\n")
    daemons.append(d)
    wait_until(lambda: stream_state(d) == "connected", 30, "the event stream", [d])

    dp.admin.set_faults(events_status=503)  # the open stream ends, every reconnect is refused
    wait_until(lambda: stream_state(d) == "polling", 20, "polling mode", [d])
    assert "polling the full state every 3 s until the stream is back" in d.logged() or \
        "polling the full state every 3.0 s until the stream is back" in d.logged()

    ghost, ghost_key = register_ghost(dp, "ghost")  # its peer_added event cannot reach a refused stream
    wait_until(lambda: ghost_key in wg_peers(lab, d.node), 20, "the new peer through a state pull", [d])
    wait_until(lambda: applied_by(d, ghost["node_id"]), 10, "the log line of the cycle that applied it", [d])
    assert any(POLL in reasons for reasons in applied_by(d, ghost["node_id"])), applied_by(d, ghost["node_id"])
    assert f"peer_added {ghost['node_id']}" not in d.logged()  # no event carried it

    dp.admin.clear_faults()
    wait_until(lambda: stream_state(d) == "connected", 20, "the stream to come back", [d])
    assert "event stream is back; leaving polling mode" in d.logged()
    settled = cycles(d) + 2  # a poll asked for just before the reconnect has run by then
    wait_until(lambda: cycles(d) >= settled, 20, "two reconcile cycles after the stream is back", [d])
    after = len(d.logged())
    ghost2, ghost2_key = register_ghost(dp, "ghost2")
    wait_until(lambda: ghost2_key in wg_peers(lab, d.node), 20, "a peer through the stream again", [d])
    wait_until(lambda: cycles(d) >= settled + 2, 20, "two more cycles", [d])
    assert f"peer_added {ghost2['node_id']}" in d.logged()  # carried by its event this time
    assert POLL not in d.logged()[after:]  # and nothing polls any more
