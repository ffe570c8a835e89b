"""Issue #14 item 2: a finish that timed out under a SIGSTOPped store.

Given the lease store on its own redis-server and tasks about to finish; when that server
is SIGSTOPped for 6 s (far longer than the finish's tries at the store's 0.5 s socket
timeout, so each finish times out while Redis keeps the commands buffered, but shorter
than the 15 s ttl, so Redis applies the buffered finishes when it resumes) and then
resumed; then every task's outcome is settled (read back, or re-run), every waiter
returns, each task accepted once.
"""
from __future__ import annotations

import time

from tests.adversarial.runner import Counts, Run, pause, wait_until

NAME = "finish-timed-out"
DEPENDS = "a finish whose reply was lost is settled by asking again (protocol/settle.py)"


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory, ttl=15.0) as run:
        run.server("main")
        leases = run.server("leases")
        run.wire("main", leases="leases", leases_query="socket_timeout=0.5&socket_connect_timeout=0.5")
        run.worker("p", "prefork", 4)
        for _ in range(3 if long else 1):
            # Warm up: every pool process holds its connection to the store before the stall
            # (a connection opened during it would time out in its handshake, before any
            # command is buffered, and the stall would prove nothing).
            warm = run.submit_many(16, 0.05)
            wait_until(lambda: run.waiters is not None and all(t in run.waiters.first for t in warm),
                       20, "the warm-up tasks")
            for i in range(6):
                run.submit(0.8 + 0.1 * i)
            time.sleep(0.7)  # bodies started; they end during the pause
            pause(leases.process.pid, 12.0 if long else 6.0)
        run.mark_fault_end()
        return run.settle(timeout=60 if long else 30, quiet=2.0)


def test_a_finish_that_timed_out_loses_no_task(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean()
