"""The chaos smoke: `python -m bench chaos` (bench/chaos.py), short, in the suite. One connected `plexd up` under
its running workload (peers joining and leaving, actions, reports, policy changes) meets 20 faults at random
moments, each kind at least once (plexd killed at a random moment and at a named point, wireguard-go killed or
stopped, the control plane failing, silent or
restarted, data_dir full or read-only, the firewall flushed and the interface deleted by hand, plexd's wall clock
stepped an hour ahead or behind with libfaketime), and after each the
promises hold: converged again after the heal, no action run twice or left without its one result, no drift record
twice, no report lost, the node id kept, no secret in a log. The long run (200 trials) is the bench's, and so is
the recovery goal (p99 <= 10 s): here the bound is liveness (60 s), since a timed limit on a CI machine running the
VM tiers beside this test failed once at 10.3 s (5 s of any plexd kill is the unit's RestartSec). The table with
recovery p50/p99 is printed for the record.
"""

from __future__ import annotations

import pytest
from waiting import LOAD_FACTOR

from bench.chaos import FAKETIME, faults, run_trials, table

pytestmark = pytest.mark.root

TRIALS = 20
RECOVER = 60  # seconds after a heal to converge again: liveness, not the bench's 10 s figure


@pytest.mark.timeout(int(1200 * LOAD_FACTOR))
async def test_twenty_faults_at_random_moments_break_no_promise() -> None:
    assert FAKETIME is not None, "libfaketime is not installed (make setup installs it): no clock faults"
    kinds = list(faults(0))
    run = await run_trials(TRIALS, kinds, seed=20261202, outage=5, recover=RECOVER)
    print(table(run.trials))
    assert len(run.trials) == TRIALS and {t.fault for t in run.trials} == set(kinds)
    failed = [f"{t.fault}: {'; '.join(t.problems)}" for t in run.trials if t.problems]
    assert failed == [], "\n".join(failed) + "\n" + table(run.trials)
    # the workload really ran between the faults: peers joined, reports, actions and policies went through
    assert run.workload["peer"] >= TRIALS and run.workload["report"] >= TRIALS, run.workload
    assert run.workload["action"] >= 5 and run.workload["policy"] >= 2, run.workload
