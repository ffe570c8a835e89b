"""Finishes sent in the background (worker/background.py): a success nobody reads, on a
threads pool of more than one thread, is queued and sent after the task returned, several
in one write.

The class against a real redis-server first (what it promises: every finish lands or is
reported, refusals and errors one by one, an outage retried within the bound, nothing
left at a stop), then real workers: the tasks run once each and end succeeded; a threads
worker killed right after such a task returned has it run again (its finish never
landed); on a pool of one task per process (solo, a threads pool of one), and with
``leases_background_finishes = False``, the finish stays waited and nothing runs again.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid

import pytest
import redis

import celery_leases
from celery_leases import LeaseStore
from celery_leases.exceptions import LeaseError, LeaseLost, LeaseUnavailable
from celery_leases.protocol.transitions import AcquireRequest, FinishRequest
from celery_leases.testing import wait_for
from celery_leases.worker.background import BackgroundFinishes
from celery_leases.worker.finishing import before_each_body

pytestmark = pytest.mark.slow

OWNER = "w1"
TASKS = "tests.support.apps.leased_app"


@pytest.fixture
def server(own_server):
    return own_server("leases")


@pytest.fixture
def store(server, key_prefix):
    client = redis.Redis.from_url(server.url, socket_timeout=1)
    yield LeaseStore(client, prefix=key_prefix, ttl=30)
    client.close()


@pytest.fixture
def finishes(store):
    made = []

    def make(**kwargs) -> BackgroundFinishes:
        sender = BackgroundFinishes(store, **kwargs)
        sender.start()
        made.append(sender)
        return sender

    yield make
    for sender in made:
        sender.stop(timeout=2)


class Reports:
    """What the finishes reported, by task id."""

    def __init__(self) -> None:
        self.by_task: dict[str, LeaseError] = {}
        self.lock = threading.Lock()

    def __call__(self, task_id: str):
        def report(exc: LeaseError) -> None:
            with self.lock:
                self.by_task[task_id] = exc
        return report


def acquired(store: LeaseStore, n: int) -> dict[str, int]:
    out = {}
    for _ in range(n):
        task_id = uuid.uuid4().hex
        out[task_id] = store.acquire(task_id, OWNER, name="t").token
    return out


def queue_all(sender: BackgroundFinishes, leases: dict[str, int], reports: Reports, bound: float = 30) -> None:
    for task_id, token in leases.items():
        assert sender.add(task_id, OWNER, token, "succeeded", bound, reports(task_id))


def test_queued_finishes_land_together(store, finishes):
    sender, reports = finishes(gather=0.05), Reports()
    leases = acquired(store, 30)
    queue_all(sender, leases, reports)
    wait_for(lambda: sender.accepted == 30, 10, "30 finishes accepted")
    assert {store.get(t).state for t in leases} == {"succeeded"}
    assert reports.by_task == {}
    # Queued within the gathering delay, they went out in far fewer writes than finishes.
    assert sender.writes <= 3, sender.writes


def test_a_refused_finish_is_reported_and_its_neighbours_land(store, finishes):
    sender, reports = finishes(gather=0.05), Reports()
    leases = acquired(store, 3)
    stale = next(iter(leases))
    queue_all(sender, {**leases, stale: leases[stale] - 1 if leases[stale] > 1 else 999}, reports)
    wait_for(lambda: sender.accepted + sender.refusals == 3, 10, "3 finishes answered")
    assert sender.refusals == 1 and isinstance(reports.by_task[stale], LeaseLost)
    assert store.get(stale).state == "active"  # the owner's lease stands
    assert {store.get(t).state for t in leases if t != stale} == {"succeeded"}


def test_a_finish_the_store_cannot_verify_is_reported_and_its_neighbours_land(store, finishes):
    sender, reports = finishes(gather=0.05), Reports()
    leases = acquired(store, 3)
    broken = next(iter(leases))
    store.client.delete(store.keys.record(broken))
    store.client.set(store.keys.record(broken), "not a hash")
    queue_all(sender, leases, reports)
    wait_for(lambda: sender.accepted + sender.refusals == 3, 10, "3 finishes answered")
    assert sender.accepted == 2 and list(reports.by_task) == [broken]
    assert "unverifiable" not in str(reports.by_task[broken])  # (the reason is the store's own)
    assert store.keys.record(broken) in str(reports.by_task[broken])


def test_an_outage_is_retried_until_the_store_answers(store, finishes, server):
    sender, reports = finishes(gather=0.01), Reports()
    leases = acquired(store, 5)
    sender.server.read()  # (the worker reads the store's clock at start: a finish is bounded by it)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        queue_all(sender, leases, reports)
        time.sleep(2.5)  # past the client's 1 s timeout: at least one write went unanswered
        assert sender.accepted == 0
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    wait_for(lambda: sender.accepted == 5, 15, "the 5 finishes accepted once the store answers")
    assert {store.get(t).state for t in leases} == {"succeeded"}
    assert reports.by_task == {} and sender.withheld == 0


def test_past_its_bound_an_unanswered_finish_is_withheld_and_reported(store, finishes, server):
    sender, reports = finishes(gather=0.01), Reports()
    leases = acquired(store, 2)
    sender.server.read()
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        queue_all(sender, leases, reports, bound=1.0)
        wait_for(lambda: len(reports.by_task) == 2, 20, "both finishes withheld")
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert sender.withheld == 2 and sender.accepted == 0
    assert all("withheld" in exc.reason for exc in reports.by_task.values())
    # A copy that reaches the server late changes nothing (the not-after of each finish).
    time.sleep(0.5)
    assert {store.get(t).state for t in leases} == {"active"}


def test_an_unexpected_error_reports_its_finishes_and_the_thread_goes_on(store, finishes, monkeypatch):
    sender, reports = finishes(gather=0.05), Reports()
    broken, good = acquired(store, 1), acquired(store, 1)
    real = store.finish_many
    monkeypatch.setattr(store, "finish_many", lambda reqs: (_ for _ in ()).throw(RuntimeError("a bug")))
    queue_all(sender, broken, reports)
    wait_for(lambda: len(reports.by_task) == 1, 10, "the finish reported")
    (task_id,) = broken
    assert "withheld" in reports.by_task[task_id].reason and "a bug" in reports.by_task[task_id].reason
    monkeypatch.setattr(store, "finish_many", real)
    queue_all(sender, good, reports)
    wait_for(lambda: sender.accepted == 1, 10, "the next finish accepted: the thread went on")
    assert sender.running


def test_stop_sends_what_is_queued_and_then_takes_no_more(store, finishes):
    sender, reports = finishes(gather=5.0), Reports()  # (a long gather: only the stop sends them)
    leases = acquired(store, 4)
    queue_all(sender, leases, reports)
    sender.stop(timeout=5)
    assert sender.accepted == 4 and {store.get(t).state for t in leases} == {"succeeded"}
    task_id, token = next(iter(acquired(store, 1).items()))
    assert not sender.add(task_id, OWNER, token, "succeeded", 30, reports(task_id))


def test_flush_sends_what_is_queued_from_the_callers_thread(store, finishes):
    """(An isolated run flushes before it starts: none of its neighbours' finishes is then
    on its way when it runs alone.)"""
    sender, reports = finishes(gather=5.0), Reports()
    leases = acquired(store, 3)
    queue_all(sender, leases, reports)
    sender.flush()
    assert sender.accepted == 3 and sender.queued == 0
    assert {store.get(t).state for t in leases} == {"succeeded"}


def test_only_the_process_that_started_it_queues(store, finishes):
    sender, reports = finishes(), Reports()
    task_id, token = next(iter(acquired(store, 1).items()))
    sender.pid = -1  # as a forked child (prefork) sees it: that process finishes and waits itself
    assert not sender.add(task_id, OWNER, token, "succeeded", 30, reports(task_id))
    unstarted = BackgroundFinishes(store)
    assert not unstarted.add(task_id, OWNER, token, "succeeded", 30, reports(task_id))


# -- the solo pool: the finishes ride with the next acquire ---------------------------


class Loop:
    """The solo pool's event loop as BackgroundFinishes uses it (``call_later``); the test
    runs the timers that are due."""

    def __init__(self) -> None:
        self.timers: list = []

    def call_later(self, delay: float, fn) -> None:
        self.timers.append((time.monotonic() + delay, fn))

    def run_due(self) -> int:
        now = time.monotonic()
        due = [t for t in self.timers if t[0] <= now]
        self.timers = [t for t in self.timers if t[0] > now]
        for _, fn in due:
            fn()
        return len(due)


@pytest.fixture
def riding(store):
    made = []

    def make(**kwargs) -> tuple[BackgroundFinishes, Loop]:
        loop = Loop()
        sender = BackgroundFinishes(store, hub=loop, **kwargs)
        sender.start()
        made.append(sender)
        return sender, loop

    yield make
    for sender in made:
        sender.stop(timeout=2)


def acquire_riding(store: LeaseStore, sender: BackgroundFinishes, task_id: str):
    req = AcquireRequest(task_id, OWNER, name="t")
    return sender.ride(lambda reqs: store.acquire_with_finishes(req, reqs))


def test_on_solo_the_queued_finishes_ride_with_the_next_acquire(store, riding):
    (sender, loop), reports = riding(), Reports()
    leases = acquired(store, 3)
    queue_all(sender, leases, reports)
    assert len(loop.timers) == 1  # armed once, for what no acquire takes
    store.finish_many([FinishRequest("warm", OWNER, 0, "succeeded")] * 2)  # (the script cached)
    before = store.calls.direct.writes

    acq = acquire_riding(store, sender, "next")

    assert acq.owned and store.calls.direct.writes - before == 1  # one round trip for all four
    assert sender.accepted == 3 and sender.queued == 0 and reports.by_task == {}
    assert {store.get(t).state for t in leases} == {"succeeded"}
    loop.run_due()  # (the timer finds nothing left)
    assert sender.writes == 1


def test_on_solo_what_no_acquire_takes_goes_out_from_the_loop(store, riding):
    (sender, loop), reports = riding(gather=0.01), Reports()
    leases = acquired(store, 2)
    queue_all(sender, leases, reports)
    time.sleep(0.02)
    assert loop.run_due() == 1
    assert sender.accepted == 2 and {store.get(t).state for t in leases} == {"succeeded"}


def test_on_solo_a_refused_finish_is_reported_and_the_acquire_stands(store, riding):
    (sender, _), reports = riding(), Reports()
    leases = acquired(store, 2)
    stale = next(iter(leases))
    queue_all(sender, {**leases, stale: leases[stale] + 100}, reports)
    acq = acquire_riding(store, sender, "next")
    assert acq.owned and sender.accepted == 1 and isinstance(reports.by_task[stale], LeaseLost)
    assert store.get(stale).state == "active"


def test_on_solo_an_outage_fails_the_acquire_and_the_loop_sends_the_finishes_again(store, riding, server):
    (sender, loop), reports = riding(gather=0.01), Reports()
    leases = acquired(store, 2)
    queue_all(sender, leases, reports)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(LeaseUnavailable):
            acquire_riding(store, sender, "next")
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    # The acquire is the receipt's to retry; the finishes wait for their backoff, then the loop
    assert sender.queued == 2 and sender.accepted == 0 and len(loop.timers) == 1  # (armed at the queueing)
    wait_for(lambda: loop.run_due() and sender.accepted == 2, 10, "the finishes sent again")
    assert {store.get(t).state for t in leases} == {"succeeded"} and reports.by_task == {}


def test_on_solo_stop_sends_what_is_queued(store, riding):
    (sender, _), reports = riding(gather=5.0), Reports()
    leases = acquired(store, 3)
    queue_all(sender, leases, reports)
    sender.stop()
    assert sender.accepted == 3 and {store.get(t).state for t in leases} == {"succeeded"}
    task_id, token = next(iter(acquired(store, 1).items()))
    assert not sender.add(task_id, OWNER, token, "succeeded", 30, reports(task_id))


def test_on_solo_no_body_starts_while_a_finish_before_it_is_on_its_way(store, riding):
    """A plain task's body, or an ETA that came due, starts without an acquire: what is queued
    goes out before it (``before_each_body``, on the pool's ``on_apply``)."""
    (sender, _), reports = riding(gather=5.0), Reports()
    seen = []

    class Pool:
        def on_apply(self, target, *args, **kwargs):
            seen.append({store.get(t).state for t in leases})
            return target()

    pool = Pool()
    before_each_body(pool, sender)
    leases = acquired(store, 2)
    queue_all(sender, leases, reports)
    assert pool.on_apply(lambda: "ran") == "ran"
    assert seen == [{"succeeded"}] and sender.queued == 0


# -- real workers ---------------------------------------------------------------


def runs(history, task_id: str) -> list:
    return [h for h in history() if h[0] == "start" and h[1] == task_id]


@pytest.mark.parametrize("pool", ["threads", "solo", "prefork"])
def test_unread_successes_run_once_and_end_succeeded(client_app, start_worker, history, pool):
    worker = start_worker("a", pool=pool, concurrency=4)
    warm = client_app.signature(f"{TASKS}.add_ignored", (0, 0)).delay()
    store = celery_leases.store(client_app)
    wait_for(lambda: store.get(warm.id).state == "succeeded", 30, "the worker up")
    worker.pause()  # (a backlog: each next task is there when the one before ends)
    results = [client_app.signature(f"{TASKS}.add_ignored", (i, i)).delay() for i in range(40)]
    worker.resume()
    wait_for(lambda: all(store.get(r.id).state == "succeeded" for r in results), 30,
             "40 unread successes finished")
    assert [len(runs(history, r.id)) for r in results] == [1] * 40
    assert "refused" not in worker.log()
    worker.stop()
    match = re.search(r"background finishes: (\d+) accepted, 0 refused, 0 withheld, in (\d+) write\(s\); "
                      r"(\d+) rode with an acquire", worker.log())
    assert match, worker.log_tail()
    accepted, writes, carried = map(int, match.groups())
    assert accepted == 41
    if pool == "solo":  # one finish a write, riding with the next task's acquire
        assert carried >= 1, (writes, carried)
    elif pool == "prefork":  # finished by the main process, in the acquirer's writes
        assert writes < 41, (writes, carried)
    else:  # several finishes a write
        assert writes < 41 and carried == 0


@pytest.mark.parametrize("pool, concurrency, background, runs_expected", [
    ("threads", 2, "1", None),  # the finish may be on its way: it runs again, or it landed
    ("threads", 2, "0", 1),   # leases_background_finishes = False: the finish was waited for
    ("solo", 1, "1", 2),      # queued to ride with the next acquire: the task runs again
    ("solo", 1, "0", 1),
    ("prefork", 1, "1", 2),   # the pool process died before it reported the success
    ("prefork", 1, "0", 1),
    ("threads", 1, "1", 1),   # a threads pool of one: waited
])
def test_a_worker_killed_right_after_an_unread_success(client_app, start_worker, history, pool,
                                                      concurrency, background, runs_expected):
    """With the finish in the background, a death just after the task returned (before the
    finish went out) leaves the lease to expire: the task runs again, and exactly one run's
    outcome is accepted. A waited finish had landed before the task returned: no second run."""
    store = celery_leases.store(client_app)
    start_worker("a", pool=pool, concurrency=concurrency, LEASES_TEST_BACKGROUND=background)
    result = client_app.signature(f"{TASKS}.add_ignored_then_die", (1, 2)).delay()
    wait_for(lambda: any(h[0] == "died" and h[1] == result.id for h in history()), 30, "the worker killed")
    start_worker("b", pool="threads", concurrency=2, LEASES_TEST_WORKER_RECOVERY="1",
                 LEASES_TEST_BACKGROUND=background)
    wait_for(lambda: store.get(result.id).state == "succeeded", 30, "the task succeeded")
    if runs_expected != 2:
        time.sleep(3)  # (a ttl and a recovery interval: nothing runs it again)
    starts = runs(history, result.id)
    if runs_expected is None:
        # The finishing thread races the kill (it sends 2 ms after the body): either the
        # finish landed and nothing runs again, or it did not and the task ran again.
        assert len(starts) in (1, 2), starts
    else:
        assert len(starts) == runs_expected, starts
    assert store.get(result.id).token == int(starts[-1][3]["token"])


@pytest.mark.parametrize("pool", ["solo", "prefork"])
@pytest.mark.parametrize("pill", ["kill_own_child", "plain_kill_once"])
def test_a_pill_after_an_unread_success_charges_it_nothing(client_app, start_worker, history, pill, pool):
    """Solo: the innocent's finish rode with the pill's acquire (a leased pill) or went out
    before its body (a plain one). Prefork: the main process finishes it, and outlives the
    pool process the pill kills. Either way the innocent has ended succeeded, charged
    nothing, and it never runs again."""
    store = celery_leases.store(client_app)
    start_worker("a", pool=pool, concurrency=1, LEASES_TEST_WORKER_RECOVERY="1" if pool == "prefork" else "0")
    innocent = client_app.signature(f"{TASKS}.add_ignored", (1, 2)).delay()
    wait_for(lambda: runs(history, innocent.id), 30, "the innocent ran")
    pill_result = client_app.signature(f"{TASKS}.{pill}").delay()
    wait_for(lambda: len(runs(history, pill_result.id)) == 1, 30, "the pill ran")
    time.sleep(0.5)  # (the worker is dead: nothing more lands)
    record = store.get(innocent.id)
    assert record.state == "succeeded" and record.recoveries == 0
    if pool == "solo":  # (the whole worker died; a prefork worker runs the pill again itself)
        start_worker("b", pool="solo", concurrency=1, LEASES_TEST_WORKER_RECOVERY="1")
    if pill == "kill_own_child":
        wait_for(lambda: store.get(pill_result.id).state == "succeeded", 30, "the pill's second run")
    time.sleep(3)  # (a ttl and a recovery interval: nothing runs the innocent again)
    assert len(runs(history, innocent.id)) == 1
