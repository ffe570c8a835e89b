"""Issue #14 item 3: a poison pill on the threads pool, with innocents.

Given a threads worker (one thread, prefetch 4) with innocents prefetched behind a task
that SIGKILLs its whole worker each time it runs, and a supervisor that restarts the
worker after each death; when the pill uses up its recoveries; then the pill ends dead
(its waiter gets ``LeaseExpired``), and every innocent, leased by the dying worker but
never started there, succeeds once: only a lease that was running when its worker died
counts a recovery. (One thread, so no innocent is ever running at a death: one running
beside the pill at every death would rightly be charged each time.)
"""
from __future__ import annotations

import time

from tests.adversarial.runner import Counts, Run

NAME = "poison-pill-threads"
DEPENDS = "only a lease that was running when its worker died counts a recovery (docs/recovery.md)"


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory, ADV_MAX_RECOVERIES="2") as run:
        run.server("main")
        run.wire("main")
        workers = [run.worker("t0", "threads", 1, ADV_PREFETCH="4")]
        run.submit(name="adv.poison", args=(), expect="dead")
        for _ in range(12 if long else 8):
            run.submit(0.2)
        deadline = time.time() + (90 if long else 45)
        restarts = 0
        while time.time() < deadline and run.waiters is not None and \
                len(run.waiters.first) < len(run.expect):
            if workers[-1].proc.poll() is not None:  # died: restart it, as systemd would
                restarts += 1
                workers.append(run.worker(f"t{restarts}", "threads", 1, ADV_PREFETCH="4"))
            time.sleep(0.2)
        run.mark_fault_end()
        counts = run.settle(timeout=5, quiet=1.0)
        counts.extra["worker deaths"] = restarts
        started = {e["task"] for e in run.starts()}
        counts.extra["innocents never run"] = sum(
            1 for t, e in run.expect.items() if e.outcome == "success" and t not in started)
        return counts


def test_a_poison_pill_takes_no_innocent_down(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"innocents never run": 0})
