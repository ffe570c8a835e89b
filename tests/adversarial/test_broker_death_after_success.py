"""Issue #14 item 4: the broker dies while link callbacks are sent after an accepted success.

Given tasks with a link callback, the broker on its own redis-server (AOF on); when the
broker is killed just before the bodies return and comes back 20 s later (past the
publish's retries: one retry here, each try about 6 s of reconnecting); then each task's
success stands in the backend (never FAILURE(OperationalError) beside a ``succeeded``
lease), and each callback runs exactly once.
"""
from __future__ import annotations

import time

from tests.adversarial.runner import Counts, Run

NAME = "broker-death-after-success"
DEPENDS = "callbacks of an accepted success sent by the task, with bounded retries, or reported"


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory, ADV_PUBLISH_RETRIES="1") as run:
        broker = run.server("broker", appendonly=True)
        run.server("main")
        run.wire("broker", backend="main")
        run.worker("p", "prefork", 4)
        parents = []
        for _ in range(3 if long else 1):
            for _ in range(4):
                task_id = f"{NAME[:12]}-{len(run.expect) + 1:05d}"
                link = run.client.signature("adv.callback", kwargs={"parent": task_id})
                parents.append(run.submit(1.5, task_id=task_id, link=link))
            time.sleep(1.3)  # the bodies are about to return
            broker.kill()
            time.sleep(20.0)
            broker.start()
            time.sleep(2.0)
        run.mark_fault_end()
        counts = run.settle(timeout=60, quiet=3.0)  # the consumer reconnects with growing pauses
        # The parents settle at once (their results live on "main"); their callbacks wait in the
        # broker until the worker's consumer is back, which takes longer on a loaded machine.
        deadline = time.monotonic() + 90
        while True:
            callbacks = [e["task"] for e in run.history() if e["ev"] == "callback"]
            if all(p in callbacks for p in parents) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(3.0)  # a duplicate callback would show up here
        callbacks = [e["task"] for e in run.history() if e["ev"] == "callback"]
        counts.extra["callbacks missing"] = sum(1 for p in parents if p not in callbacks)
        counts.extra["callbacks duplicated"] = sum(1 for p in parents if callbacks.count(p) > 1)
        return counts


def test_a_broker_death_after_an_accepted_success_loses_no_callback(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"callbacks missing": 0, "callbacks duplicated": 0})
