"""Real ``celery worker`` subprocesses for integration tests.

Each worker runs ``tests/support/apps/leased_app.py`` (or another app module) with its
environment; tests SIGKILL, SIGSTOP and SIGCONT them like an operator or the
kernel would. The launcher is the pytest plugin's, so the suite tests what users get.
"""
from __future__ import annotations

import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from celery_leases import testing
from celery_leases.testing import wait_for


ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


class Worker(testing.Worker):
    """The plugin's launcher (:class:`celery_leases.testing.Worker`) with the suite's defaults.

    ``env`` configures the app module (tests/support/apps/leased_app.py reads its
    broker, prefix and ttl from it); the worker runs in the repository root,
    which is on its ``PYTHONPATH``; ``extra`` are more ``celery worker`` options.
    """

    def __init__(self, name: str, env: dict, *, pool: str = "prefork", concurrency: int = 2,
                 app: str = "tests.support.apps.leased_app", log_dir: Path, extra: tuple = ()) -> None:
        super().__init__(app, name=name, env={"LEASES_TEST_POOL": pool, **env}, pool=pool,
                         concurrency=concurrency, args=extra, log_dir=log_dir, cwd=ROOT,
                         pythonpath=[str(ROOT)])


def starts(history, task_id: str) -> list:
    """The ``start`` events of ``task_id`` in a test's history (tests/conftest.py ``history``)."""
    return [h for h in history() if h[0] == "start" and h[1] == task_id]


def run_counts(history) -> Counter:
    """Task id -> how many times its body started, in a test's history."""
    return Counter(h[1] for h in history() if h[0] == "start")


def results_of(results, store, timeout: float) -> list:
    """Each result's value, waiting at most ``timeout`` seconds in all; a task that failed or
    did not finish fails the test with its error, its lease record and its parked entry."""
    deadline = time.monotonic() + timeout
    values = []
    for result in results:
        try:
            values.append(result.get(timeout=max(0.1, deadline - time.monotonic())))
        except Exception as exc:  # noqa: BLE001 - reported with the store's view of the task
            raise AssertionError(f"task {result.id}: {exc!r}; lease record {store.get(result.id)}; "
                                 f"parked {store.parked_entry(result.id)}") from exc
    return values


def assert_ran_once_with_a_lease(history, results) -> None:
    """Each of ``results``' tasks started exactly once, under a fencing token (a lease)."""
    ids = {r.id for r in results}
    started = [h for h in history() if h[0] == "start" and h[1] in ids]
    assert Counter(h[1] for h in started) == dict.fromkeys(ids, 1), started
    assert all(int(h[3]["token"]) > 0 for h in started), started


#: The two lines a worker logs when a lease it held lapsed: its heartbeat found the lease
#: gone, or the store refused the outcome (task.py, worker/lost.py).
_LAPSE = re.compile(r"task (?:\S+\[)?([^\s\]:]+)\]?: (?:lease \(token (\d+)\) lost"
                    r"|outcome '\w+' of token (\d+) refused)")


def lapsed_leases(*workers: "Worker") -> set:
    """(task id, token) of each lease these workers logged as lapsed under them.

    A host that stalls (or whose clock steps) for longer than the ttl lets a live
    owner's lease expire; recovery then rightly runs the task again. A test that
    counts recoveries adds these: every recovery beyond the expected ones must be
    one of them, never unexplained.
    """
    found = set()
    for worker in workers:
        for match in _LAPSE.finditer(worker.log()):
            found.add((match.group(1), int(match.group(2) or match.group(3))))
    return found


def busy_with_backlog(start_worker, app, history, waiting: int, start_timeout: float = 20):
    """A single-process worker busy with a 4 s task (the blocker), and ``waiting`` short
    tasks published behind it (``sleep_then_echo(i, 0.05)``; one may be prefetched).

    Returns (worker, blocker, the short tasks' results).
    """
    tasks = "tests.support.apps.leased_app"
    worker = start_worker("a", concurrency=1)
    blocker = app.signature(f"{tasks}.sleep_then_echo", ("block", 4.0)).delay()
    wait_for(lambda: starts(history, blocker.id), start_timeout, what="the blocker to start")
    short = [app.signature(f"{tasks}.sleep_then_echo", (i, 0.05)).delay() for i in range(waiting)]
    return worker, blocker, short


def stale_owner_race(a: "Worker", start_b, store, history, task_id: str, first, timeout: float = 20):
    """The seed's race: worker A, running ``task_id`` (its start event ``first``), is paused
    (SIGSTOP) past its ttl; recovery re-publishes the task and worker B (``start_b()``)
    runs the copy with a higher token; A is resumed and finishes its body.

    Returns (B, B's start event); the caller checks whose outcome stands.
    """
    a.signal(signal.SIGSTOP)
    try:
        b = start_b()
        wait_for(lambda: store.expired(), 10, what="A's lease to expire")
        assert store.recover().recovered == 1
        wait_for(lambda: len(starts(history, task_id)) == 2, timeout, what="B to start the copy")
        second = starts(history, task_id)[1]
        assert int(second[3]["token"]) > int(first[3]["token"])
    finally:
        a.signal(signal.SIGCONT)
    wait_for(lambda: [h for h in history() if h[0] == "end" and h[2] == first[2]], 15,
              what="A to finish its body")
    return b, second
