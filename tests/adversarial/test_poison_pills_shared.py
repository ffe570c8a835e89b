"""Poison pills on pools whose tasks share one process (threads, gevent): blame the pill alone.

Given two ``-c 4`` workers of a shared-process pool, restarted by a supervisor whenever
they die (as systemd would), and poison pills (each SIGKILLs its whole worker, some after
0.3 s, some within milliseconds of starting) mixed with one-second innocents in plain
sends, groups, chains and chords, in an order drawn from a seed; when every waiter has
its answer; then no innocent is dead (each succeeded once), every case ended as expected,
and each pill ended dead after exactly ``leases_max_recoveries`` recoveries of its own:
deaths it shared with other tasks were charged as uncertain and isolated it, never counted.
"""
from __future__ import annotations

import random
import time

import pytest

from tests.adversarial.runner import Counts, Expect, Run

NAME = "poison-pills-shared"
DEPENDS = "isolation of tasks whose blame is uncertain (docs/recovery.md)"
MAX_RECOVERIES = 1


def _work(run: Run, seconds: float, expect: str = "success", name: str = "adv.work"):
    """A signature with a known id whose waiter is subscribed: an innocent, or a pill."""
    run._seq += 1
    task_id = f"{run.name[:12]}-{run._seq:05d}"
    if name == "adv.poison":
        run.expect[task_id] = Expect("dead")
        sig = run.client.signature(name, args=(seconds,), immutable=True)
    else:
        run.expect[task_id] = Expect(expect, run._seq)
        sig = run.client.signature(name, args=(run._seq, seconds), immutable=True)
    run.waiters.add(task_id)
    return sig.set(task_id=task_id)


def scenario(directory, long: bool = False, pool: str = "threads", seed: int = 1) -> Counts:
    from celery import chain, chord, group

    rng = random.Random(seed)
    # A message a worker took from the broker and died with before its acquire comes back through
    # its publish record after leases_delivery_timeout (docs/recovery.md): 10 s here, so that a
    # pill that kills its worker in that window does not hold a case for the default 600 s.
    with Run(f"{NAME}-{pool}-{seed}", directory, ADV_MAX_RECOVERIES=str(MAX_RECOVERIES),
             ADV_DELIVERY_TIMEOUT="10") as run:
        run.server("main")
        run.wire("main")
        workers = {f"{pool}{n}": run.worker(f"{pool}{n}", pool, 4) for n in range(2)}
        run.client  # noqa: B018 - builds the waiters
        pill = lambda: _work(run, rng.choice((0.3, 0.005)), name="adv.poison")  # noqa: E731
        innocent = lambda: _work(run, rng.choice((0.5, 1.0, 1.5)))  # noqa: E731
        cases = []
        for _ in range(6 if long else 3):
            cases.append(lambda: pill().apply_async())
        for _ in range(4 if long else 2):
            cases.append(lambda: group([innocent(), pill(), innocent()]).apply_async())
        for _ in range(3 if long else 1):
            cases.append(lambda: chain(innocent(), innocent()).apply_async())
            cases.append(lambda: chord([innocent(), innocent(), innocent()], innocent()).apply_async())
            cases.append(lambda: chain(innocent(), pill()).apply_async())
        for _ in range(16 if long else 10):
            cases.append(lambda: innocent().apply_async())
        rng.shuffle(cases)
        for case in cases:
            case()
        pills = [t for t, e in run.expect.items() if e.outcome == "dead"]
        deadline = time.time() + (420 if long else 200)
        restarts = 0
        while time.time() < deadline and len(run.waiters.first) < len(run.expect):
            for name, worker in list(workers.items()):
                if worker.proc.poll() is not None:  # died: restart it, as systemd would
                    restarts += 1
                    workers[name] = run.worker(f"{name}-{restarts}", pool, 4)
            time.sleep(0.2)
        run.mark_fault_end()
        counts = run.settle(timeout=5, quiet=1.0)
        store = run.store()
        counts.extra["worker deaths"] = restarts
        innocents = [store.get(t) for t, e in run.expect.items() if e.outcome == "success"]
        counts.extra["innocents dead"] = sum(
            1 for record in innocents if getattr(record, "state", None) == "dead")
        # The margin: an innocent dies past 4 x (max_recoveries + 1) uncertain deaths.
        counts.extra["most uncertain deaths of an innocent"] = max(
            (getattr(record, "unstarted_recoveries", 0) for record in innocents), default=0)
        counts.extra["most waited deaths of an innocent"] = max(
            (getattr(record, "waited_deaths", 0) for record in innocents), default=0)
        starts = {}
        for event in run.starts():
            starts[event["task"]] = starts.get(event["task"], 0) + 1
        wrong = []
        for task_id in pills:
            record = store.get(task_id)
            if record is None or record.state != "dead" or record.recoveries != MAX_RECOVERIES:
                wrong.append(f"{task_id}: {record}")
            elif starts.get(task_id, 0) > MAX_RECOVERIES + 1 + record.unstarted_recoveries:
                wrong.append(f"{task_id}: {starts.get(task_id)} runs for {record}")
        counts.extra["pills not dead by their own deaths"] = len(wrong)
        if wrong:
            counts.why["pills"] = wrong
        return counts


@pytest.mark.slow
@pytest.mark.parametrize("pool,seed", [("threads", 1), pytest.param("threads", 2, marks=pytest.mark.long)])
def test_pills_take_no_innocent_down_on_a_shared_process_pool(tmp_path, pool, seed):
    counts = scenario(tmp_path, pool=pool, seed=seed)
    print(counts.line())
    counts.assert_clean(**{"innocents dead": 0, "pills not dead by their own deaths": 0})
