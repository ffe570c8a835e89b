"""Issue #14, a case that must hold: one Redis (broker, results and leases) restarted with AOF on.

Given two workers (prefork, threads) running a stream of tasks on one Redis with
``appendfsync always``; when that Redis is stopped and started again mid-stream;
then no worker exits, and every task is accepted once, its waiter told the truth.
"""
from __future__ import annotations

import time

from tests.adversarial.runner import Counts, Run

NAME = "redis-restart-aof"
DEPENDS = None


def scenario(directory, long: bool = False) -> Counts:
    tasks = 200 if long else 30
    with Run(NAME, directory) as run:
        server = run.server("main", appendonly=True)
        run.wire("main")
        workers = [run.worker("p", "prefork", 2), run.worker("t", "threads", 4)]
        ids = [run.submit(0.3) for _ in range(tasks // 2)]
        time.sleep(1.0)
        server.stop()
        time.sleep(1.0)
        server.start()
        ids += [run.submit(0.3) for _ in range(tasks - len(ids))]
        run.mark_fault_end()
        counts = run.settle(timeout=60 if long else 40)
        counts.extra["worker exits"] = sum(w.proc.poll() is not None for w in workers)
        return counts


def test_a_redis_restart_with_aof_loses_nothing(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"worker exits": 0})
