"""Issue #14 item 5: workers an hour fast and an hour slow.

Workers run under libfaketime with only the wall clock skewed (tests/support/skew.py).

1. Leases: given workers +1h, -1h and correct running tasks side by side; then
   every active lease's deadline is the Redis server's time plus the ttl, and each task
   is accepted once.
2. Re-queue ETAs: given the fast worker alone while the lease store is down, so it
   re-queues its deliveries for later; when it shuts down warmly (its held copies go back
   to the queue) and the correct and slow workers take over as the store returns; then
   the copies run within seconds, not an hour later.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.adversarial.runner import Counts, Run, log_count, wait_until
from tests.support.skew import skewed_env

NAME = "skewed-clocks"
DEPENDS = "leases on the Redis server's clock, and re-queue ETAs from it (celery_leases/protocol/clock.py)"


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory, ADV_UNAVAILABLE_DELAY="1") as run:
        run.server("main")
        leases = run.server("leases", appendonly=True)
        run.wire("main", leases="leases")
        # acks_late: a worker holds at most its two tasks unacknowledged, so the six 6 s tasks
        # spread two per worker and all run at once (with early acks a worker that acked its
        # two could take a third, which then starts only after the others have finished).
        fast = run.worker("fast", "threads", 2, skew="+1h", ADV_ACKS_LATE="1")
        slow = run.worker("slow", "threads", 2, skew="-1h", ADV_ACKS_LATE="1")
        run.worker("correct", "prefork", 2, ADV_ACKS_LATE="1")
        store = run.store()

        # 1. Leases: deadlines by the server clock, whatever the worker's clock says.
        # Long enough bodies that every lease is still held when it is read on a loaded machine.
        leased = [run.submit(6.0) for _ in range(6)]
        wait_until(lambda: sum(1 for e in run.starts() if e["task"] in leased) == 6, 20,
                   "all six to start")
        bad, read = [], 0
        for task_id in leased:
            record, now = store.get(task_id), store.server_time_ms()
            if record is None or record.state != "active":
                continue  # finished already: its deadline says nothing about a running lease
            read += 1
            # An hour's skew would put it 3,600,000 ms off; a late renewal only a little below 0.
            if not -run.ttl * 1000 < record.deadline - now <= run.ttl * 1000 + 500:
                bad.append((task_id, record.deadline - now))
        assert read >= 4, f"only {read} of the six leases were still active when read"
        writers = {e["worker"] for e in run.starts() if e["task"] in leased}

        # 2. Re-queue ETAs: the fast worker alone while the store is down.
        slow.kill()
        run.workers[-1].kill()  # the correct worker (idle by now: the six ran on three workers)
        wait_until(lambda: all(store.get(t) and store.get(t).state == "succeeded" for t in leased),
                   30, "the six to finish")
        leases.stop()
        requeued = [run.submit(0.1) for _ in range(4 if long else 2)]
        # Each task re-queued at least once: a second delivery of it reached the fast worker.
        wait_until(lambda: all(log_count(fast, f"[{t}] received") >= 2 for t in requeued), 30,
                   "the fast worker to re-queue each task")
        fast.stop(timeout=20)  # warm: its held ETA copies go back to the queue
        leases.start()
        run.worker("slow2", "threads", 2, skew="-1h")
        run.worker("correct2", "prefork", 2)
        run.mark_fault_end()
        counts = run.settle(timeout=25, quiet=1.0)
        counts.extra["deadlines off the server clock"] = len(bad)
        if bad:
            counts.why["deadlines off the server clock"] = [f"ms from the server clock: {bad}"]
        counts.extra["workers that ran leases"] = len(writers)
        return counts


def test_workers_an_hour_fast_and_slow_change_nothing(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"deadlines off the server clock": 0})


SLEEPER = "import json, time; m = time.monotonic(); w = time.time(); time.sleep(0.3); " \
          "print(json.dumps({'wall': w, 'slept': time.monotonic() - m}))"


def test_a_skewed_process_sleeps_normally_and_its_wall_clock_is_off():
    # Given a Python process under libfaketime an hour fast, wall clock only
    env = skewed_env("+1h")
    # When it sleeps
    done = subprocess.run([sys.executable, "-c", SLEEPER], env=env, capture_output=True, text=True,
                          timeout=20, check=False)
    # Then the sleep returns on time (libfaketime's monotonic bug is avoided), and the clock is off
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert 0.29 <= out["slept"] < 2.0
    assert 3500 < out["wall"] - time.time() < 3700


def test_without_libfaketime_a_skew_test_skips_locally_and_fails_under_ci(monkeypatch):
    import pytest

    import tests.support.skew
    # Given no libfaketime anywhere
    monkeypatch.setattr(tests.support.skew, "faketime_library", lambda: None)
    # When a skew test asks for a skewed environment, Then it skips locally
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        tests.support.skew.skewed_env("+1h")
    # And fails under CI, naming what to install
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="libfaketime"):
        tests.support.skew.skewed_env("+1h")
