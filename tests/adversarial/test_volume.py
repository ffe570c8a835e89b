"""Issue #14, a case that must hold: 20,000 tasks on two workers (long form; the quick form sends 400).

Given two workers (prefork and threads) and a burst of short tasks; then every task is
accepted once, and once retention passes nothing is left behind in the lease store.
"""
from __future__ import annotations

from tests.adversarial.runner import Counts, Run

NAME = "volume"
DEPENDS = None


def scenario(directory, long: bool = False) -> Counts:
    tasks = 20_000 if long else 400
    with Run(NAME, directory, ADV_PREFETCH="8") as run:
        run.server("main")
        run.wire("main")
        run.worker("p", "prefork", 2)
        run.worker("t", "threads", 8)
        for _ in range(0, tasks, 1000):
            run.submit_many(min(1000, tasks - len(run.expect)))
        run.mark_fault_end()
        counts = run.settle(timeout=1800 if long else 90)
        store = run.store()
        counts.extra["active leases left"] = sum(store.client.zcard(shard.deadlines)
                                                 for shard in store.keys.all_shards())
        return counts


def test_a_burst_of_tasks_on_two_workers_runs_each_once(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"active leases left": 0})
