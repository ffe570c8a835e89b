"""Issue #14 item 6: outcomes that finish just after the lease store restarted empty.

Given the lease store on its own redis-server without persistence and tasks running;
when that server restarts (empty) a moment before the bodies end, before the heartbeat
re-creates the records of the live leases; then the outcomes are accepted (the finish
re-asserts the lease as the heartbeat does), and no task is lost.
"""
from __future__ import annotations

import time

from tests.adversarial.runner import Counts, Run

NAME = "store-restarted-empty"
DEPENDS = "a finish after an empty restart re-asserts the live lease (reassert.lua)"


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory, ttl=3.0, records_may_vanish=True) as run:
        run.server("main")
        leases = run.server("leases")
        run.wire("main", leases="leases")
        run.worker("p", "prefork", 4)
        for _ in range(3 if long else 1):
            for i in range(8):
                run.submit(1.6 + 0.05 * i)
            time.sleep(1.4)
            leases.stop()
            leases.start()  # empty: no AOF, no RDB
            time.sleep(4.0)
        run.mark_fault_end()
        return run.settle(timeout=40, quiet=2.0)


def test_an_outcome_just_after_the_store_restarted_empty_is_not_lost(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean()
