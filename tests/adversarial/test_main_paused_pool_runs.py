"""Issue #14, a case that must hold: a worker's main process paused while its pool keeps running.

Given worker A (prefork) running tasks with link callbacks, worker B idle; when only A's
main process is SIGSTOPped past the ttl (its children finish their bodies, unrenewed) and
resumed after B re-ran the recovered tasks; then A's outcomes are refused, B's win, and
each callback runs once.
"""
from __future__ import annotations

import signal
import time

from tests.adversarial.runner import Counts, Run, wait_until

NAME = "main-paused-pool-runs"
DEPENDS = None


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory) as run:
        run.server("main")
        run.wire("main")
        a = run.worker("a", "prefork", 2)
        parents = []
        for _ in range(2):
            task_id = f"{NAME[:12]}-{len(run.expect) + 1:05d}"
            parents.append(run.submit(4.0, task_id=task_id,
                                      link=run.client.signature("adv.callback", kwargs={"parent": task_id})))
        wait_until(lambda: len(run.starts()) >= 2, 15, "A to start both")
        a.signal(signal.SIGSTOP, main_only=True)
        try:
            run.worker("b", "prefork", 2)
            wait_until(lambda: sum(1 for e in run.history() if e["ev"] == "accepted") >= 2, 30,
                       "B's copies to be accepted")
            time.sleep(1.0)
        finally:
            a.signal(signal.SIGCONT, main_only=True)
        run.mark_fault_end()
        counts = run.settle(timeout=20, quiet=4.0)
        callbacks = [e["task"] for e in run.history() if e["ev"] == "callback"]
        counts.extra["callbacks not once"] = sum(1 for p in parents if callbacks.count(p) != 1)
        counts.extra["bodies"] = len([e for e in run.starts()])
        return counts


def test_a_paused_main_process_lets_one_outcome_stand(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"callbacks not once": 0})
