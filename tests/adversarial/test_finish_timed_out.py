"""Issue #14 item 2: a finish that timed out under a SIGSTOPped store (needs H4's fix).

Given the lease store on its own redis-server and tasks about to finish; when that server
is SIGSTOPped for 10 s (longer than the finish's two tries at the store's 2 s socket
timeout, so each finish times out while Redis keeps the commands buffered) and then
resumed; then every task's outcome is settled (read back, or re-run), every waiter
returns, each task accepted once.
"""
from __future__ import annotations

import time

from tests.adversarial.runner import Counts, Run, pause

NAME = "finish-timed-out"
DEPENDS = "H4 (a finish whose reply was lost is settled by reading the record back)"


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory) as run:
        run.server("main")
        leases = run.server("leases")
        run.wire("main", leases="leases")
        run.worker("p", "prefork", 4)
        for rnd in range(3 if long else 1):
            ids = [run.submit(0.8 + 0.1 * i) for i in range(6)]
            time.sleep(0.7)  # bodies started; they end during the pause
            pause(leases.process.pid, 12.0 if long else 10.0)
        run.mark_fault_end()
        return run.settle(timeout=60 if long else 25, quiet=2.0)


def test_a_finish_that_timed_out_loses_no_task(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean()
