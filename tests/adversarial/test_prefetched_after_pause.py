"""Issue #14 item 7: prefetched copies after a paused main process.

Given worker A (prefork, one process, prefetch 4) running a long task with four more
prefetched and leased, and worker B idle; when A's main process is SIGSTOPped past the
ttl (its leases expire, recovery re-publishes them, B runs them all) and then resumed;
then A runs no body of a task that already succeeded elsewhere, and each task is accepted once.
"""
from __future__ import annotations

import signal

from celery_leases.testing import wait_for_lease
from tests.adversarial.runner import Counts, Run, wait_until

NAME = "prefetched-after-pause"
DEPENDS = "a resumed worker checks a long-held request's lease before its body starts"


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory) as run:
        run.server("main")
        run.wire("main")
        a = run.worker("a", "prefork", 1, ADV_PREFETCH="4")
        first = run.submit(3.0)
        for _ in range(4):
            run.submit(0.2)
        for task_id in run.expect:  # owned, not merely recorded: tracking records it queued at publish
            wait_for_lease(run.client, task_id, 20)
        wait_until(lambda: any(e["task"] == first for e in run.starts()), 10, "A to start the first")
        a.signal(signal.SIGSTOP, main_only=True)
        try:
            run.worker("b", "prefork", 2)
            wait_until(lambda: sum(1 for e in run.history() if e["ev"] == "accepted"
                                   and e["worker"] == "b") >= 4, 30, "B to run the recovered copies")
        finally:
            a.signal(signal.SIGCONT, main_only=True)
        run.mark_fault_end()
        counts = run.settle(timeout=30, quiet=4.0)
        history = run.history()
        finished = {e["task"]: e["t"] for e in history if e["ev"] == "accepted"}
        counts.extra["bodies after success"] = sum(
            1 for e in history if e["ev"] == "start" and e["task"] in finished
            and e["t"] > finished[e["task"]])
        return counts


def test_prefetched_copies_of_finished_tasks_do_not_run(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"bodies after success": 0})
