"""LeasedTask on real `celery worker` processes, a real Redis broker and result backend."""
from __future__ import annotations

import signal
import time

import pytest
from celery import chain, chord

import celery_leases
from celery_leases.testing import wait_for, wait_for_lease
from tests.support.workers import stale_owner_race, starts

TASKS = "tests.support.apps.leased_app"


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_long_task_keeps_its_lease_past_the_ttl(pool, client_app, start_worker, history):
    # Given a worker of each pool and a 2 s lease ttl
    start_worker("a", pool=pool, concurrency=1)
    store = celery_leases.store(client_app)
    # When a task runs for 8 s (four times the ttl)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("v", 8.0)).delay()
    wait_for(lambda: starts(history, result.id), 10, what="the task to start")
    time.sleep(3.0)
    # Then, mid-run, the lease is still active with a deadline in the future
    record = store.get(result.id)
    assert record.state == "active"
    assert record.deadline > store.server_time_ms()
    assert store.expired() == []
    # And it succeeds once, never having lost its lease
    assert result.get(timeout=15) == "v"
    assert len(starts(history, result.id)) == 1
    end = [h for h in history() if h[0] == "end"][0]
    assert end[3]["lost"] == "False"
    assert store.get(result.id).state == "succeeded"


def test_stale_owner_cannot_overwrite_the_new_owner(client_app, start_worker, history, redis_client):
    # Given worker A running a task with a link callback
    a = start_worker("a")
    store = celery_leases.store(client_app)
    callback = client_app.signature(f"{TASKS}.note_callback")
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("from-a", 4.0)).apply_async(link=callback)
    first = wait_for(lambda: starts(history, result.id), 10, what="A to start")[0]
    # When A is paused past its ttl and the lease is recovered, worker B runs the
    # recovered copy with a higher token, and A resumes and finishes first (B still
    # has ~4 s to go)
    b, second = stale_owner_race(a, lambda: start_worker("b"), store, history, result.id, first)
    # Then a waiter on the original AsyncResult gets B's outcome
    assert result.get(timeout=15) == "from-a"
    record = store.get(result.id)
    assert record.state == "succeeded" and record.token == int(second[3]["token"])
    # And A's outcome was refused: one accepted outcome, and A's callback never fired
    time.sleep(1.0)
    callbacks = [h for h in history() if h[0] == "callback"]
    assert len(callbacks) == 1, callbacks
    assert "refused" in a.log() and "lost" in a.log()
    assert store.stats()["refused"] >= 1
    b.stop()


def test_stale_owner_result_never_reaches_the_backend(client_app, start_worker, history):
    # Given A paused mid-task and the task recovered, but nobody running it yet
    a = start_worker("a")
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("stale", 1.5)).delay()
    wait_for(lambda: starts(history, result.id), 10, what="A to start")
    a.signal(signal.SIGSTOP)
    wait_for(lambda: store.expired(), 5, what="A's lease to expire")
    assert store.recover().recovered == 1
    # When A resumes and finishes while the recovered copy still waits in the queue
    a.signal(signal.SIGCONT)
    wait_for(lambda: [h for h in history() if h[0] == "end"], 10, what="A to finish")
    time.sleep(0.5)
    # Then the backend holds nothing from A (A's own worker may now run the copy)
    meta = client_app.backend.get_task_meta(result.id)
    if meta["status"] == "SUCCESS":
        # only the recovered execution may have written it
        assert len(starts(history, result.id)) == 2
    else:
        assert meta["status"] in ("PENDING", "STARTED")
    assert result.get(timeout=15) == "stale"


def test_pool_child_killed_stores_no_failure_and_releases_the_lease(client_app, start_worker, history):
    # Given a prefork worker (early ack) running a task
    start_worker("a", LEASES_TEST_TTL="30")
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.kill_own_child", (1.0,)).delay()
    wait_for(lambda: starts(history, result.id), 10, what="the task to start")
    # When its pool child is SIGKILLed mid-task
    wait_for(lambda: store.get(result.id).owner == "" , 10, what="the lease to be released")
    # Then the lease is released at once (no 30 s ttl wait) and no FAILURE is stored
    record = store.get(result.id)
    assert record.state == "active" and record.deadline <= store.server_time_ms()
    assert client_app.backend.get_task_meta(result.id)["status"] != "FAILURE"
    # And recovery re-runs it; the waiter gets the re-run's result
    store.recover()
    assert result.get(timeout=15) == "survived"
    assert store.get(result.id).recoveries == 1


def test_retry_twice_then_succeed_has_one_accepted_outcome(client_app, start_worker, history):
    start_worker("a")
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.retry_twice").delay()
    assert result.get(timeout=15) == "done"
    runs = starts(history, result.id)
    tokens = [int(h[3]["token"]) for h in runs]
    assert [h[3]["retries"] for h in runs] == ["0", "1", "2"]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    record = store.get(result.id)
    assert record.state == "succeeded" and record.token == tokens[-1]
    assert [t for t, _, _ in record.history] == tokens
    stats = store.stats()
    assert stats.get("succeeded") == 1 and stats.get("retried") == 2


def test_chain_and_chord_complete(client_app, start_worker, history):
    start_worker("a", concurrency=2)
    add = client_app.signature(f"{TASKS}.add")
    tsum = client_app.signature(f"{TASKS}.tsum")
    assert chain(add.clone((1, 2)), add.clone((10,)), add.clone((100,))).delay().get(timeout=20) == 113
    assert chord([add.clone((i, i)) for i in range(5)], tsum).delay().get(timeout=20) == 20


def test_lost_lease_mid_chain_does_not_send_the_rest_twice(client_app, start_worker, history):
    # Given a chain whose first task is paused past its ttl, recovered and re-run elsewhere
    a = start_worker("a")
    store = celery_leases.store(client_app)
    sig = chain(client_app.signature(f"{TASKS}.sleep_then_echo", ("x", 3.0)),
                client_app.signature(f"{TASKS}.note_callback"))
    result = sig.delay()
    first_id = result.parent.id
    wait_for(lambda: starts(history, first_id), 10, what="the first task to start")
    a.signal(signal.SIGSTOP)
    wait_for(lambda: store.expired(), 5, what="the lease to expire")
    store.recover()
    b = start_worker("b")
    a.signal(signal.SIGCONT)
    # Then the chain completes and its second task ran exactly once
    assert result.get(timeout=20) == "x"
    time.sleep(1.0)
    assert len([h for h in history() if h[0] == "callback"]) == 1
    b.stop()


def test_progress_timeout_takes_the_lease_from_a_stuck_task(client_app, start_worker, history):
    # Given a task with a 1 s progress timeout that stops calling heartbeat()
    start_worker("a", LEASES_TEST_TTL="10")
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.stuck", (3,)).delay()
    # Then, although its worker renews it, it loses its lease and sees it
    end = wait_for(lambda: [h for h in history() if h[0] == "end"], 15, what="the task to end")
    assert end[0][3]["lost"] == "True"
    assert store.get(result.id).owner == ""
    assert store.stats().get("stalled") == 1


def test_unbound_and_ignore_result_tasks_are_leased(client_app, start_worker, history):
    start_worker("a")
    store = celery_leases.store(client_app)
    unbound = client_app.signature(f"{TASKS}.add_unbound", (2, 3)).delay()
    assert unbound.get(timeout=10) == 5
    assert store.get(unbound.id).state == "succeeded"
    ignored = client_app.signature(f"{TASKS}.add_ignored", (2, 3)).delay()
    wait_for(lambda: store.get(ignored.id) and store.get(ignored.id).state == "succeeded", 10,
             what="the ignore_result task to finish its lease")
    assert client_app.backend.get_task_meta(ignored.id)["status"] == "PENDING"


def test_time_limits(client_app, start_worker, history):
    start_worker("a")
    store = celery_leases.store(client_app)
    # a hard limit kills the child; the main process writes the FAILURE under the owner's token
    hard = client_app.signature(f"{TASKS}.hard_limited").delay()
    with pytest.raises(Exception, match="TimeLimitExceeded"):
        hard.get(timeout=15)
    assert store.get(hard.id).state == "failed"
    # a soft limit is an exception inside the body, handled like any other
    soft = client_app.signature(f"{TASKS}.soft_limited").delay()
    assert soft.get(timeout=15) == "soft limit handled"
    assert store.get(soft.id).state == "succeeded"


def test_revoked_task_ends_its_lease(client_app, start_worker, history):
    start_worker("a")
    store = celery_leases.store(client_app)
    # Given a task held by the worker until its countdown
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("never", 0)).apply_async(countdown=4)
    wait_for_lease(client_app, result.id, 10)  # active: publish tracking records it queued first
    # When it is revoked
    client_app.control.revoke(result.id)
    # Then it never runs, REVOKED is stored and the lease is ended
    wait_for(lambda: store.get(result.id).state == "revoked", 10, what="the lease to end revoked")
    time.sleep(4.5)
    assert starts(history, result.id) == []
    assert client_app.backend.get_task_meta(result.id)["status"] == "REVOKED"


def test_expired_recovered_copy_ends_the_lease_and_stale_owner_is_refused(client_app, start_worker,
                                                                          history):
    # Given a task with `expires` that started in time on worker A, which is then paused
    a = start_worker("a")
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("late", 3.0)).apply_async(expires=2.5)
    wait_for(lambda: starts(history, result.id), 10, what="A to start")
    a.signal(signal.SIGSTOP)
    wait_for(lambda: store.expired(), 6, what="the lease to expire")
    time.sleep(max(0.0, 2.6 - 2.0))
    store.recover()
    # When worker B receives the recovered copy after `expires` passed
    start_worker("b")
    wait_for(lambda: store.get(result.id).state == "revoked", 10, what="the expired copy to end the lease")
    # Then it is not run, and A's late outcome is refused when it resumes
    a.signal(signal.SIGCONT)
    wait_for(lambda: [h for h in history() if h[0] == "end"], 10, what="A to finish its body")
    time.sleep(0.5)
    assert len(starts(history, result.id)) == 1
    assert client_app.backend.get_task_meta(result.id)["status"] == "REVOKED"
    assert store.get(result.id).state == "revoked"


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_task_with_a_progress_timeout_waits_behind_a_busy_slot_without_losing_its_lease(
        pool, client_app, start_worker, history):
    # Given a worker with one slot, busy for 4 s, and a task with a 1 s progress timeout
    # prefetched behind it (its lease taken at receipt)
    worker = start_worker("a", pool=pool, concurrency=1, LEASES_TEST_PREFETCH="4",
                          LEASES_TEST_WORKER_RECOVERY="1")
    head = client_app.signature(f"{TASKS}.sleep_then_echo", ("head", 4.0)).delay()
    wait_for(lambda: starts(history, head.id), 30, what="the head task to start")
    steady = client_app.signature(f"{TASKS}.stuck", (5, False)).delay()
    # When it waits four times its progress timeout to start, Then it keeps its lease, runs
    # once when the slot frees, and finishes: the timeout bounds the body, not the wait
    assert head.get(timeout=30) == "head" and steady.get(timeout=30) == "steady"
    record = celery_leases.store(client_app).get(steady.id)
    assert len(starts(history, steady.id)) == 1
    assert (record.state, record.recoveries, record.unstarted_recoveries) == ("succeeded", 0, 0), record
    assert "no progress within" not in worker.log()


def test_on_lost_terminate_kills_a_stuck_task(client_app, start_worker, history):
    # Given leases_on_lost='terminate' and a task that stops reporting progress
    worker = start_worker("a", LEASES_TEST_TTL="10", LEASES_TEST_ON_LOST="terminate")
    client_app.signature(f"{TASKS}.stuck", (0,)).delay()
    # Then the worker terminates its pool process once the lease is lost
    wait_for(lambda: "terminating pool process" in worker.log(), 15, what="the termination")
    time.sleep(1.0)
    assert [h for h in history() if h[0] == "end"] == []


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_prefetched_messages_are_leased_at_once_while_the_pool_is_busy(pool, client_app, start_worker, history):
    # Given a worker with one process (thread) that prefetches four messages, busy with a long task
    start_worker("a", pool=pool, concurrency=1, LEASES_TEST_PREFETCH="4")
    store = celery_leases.store(client_app)
    first = client_app.signature(f"{TASKS}.sleep_then_echo", ("first", 3.0)).delay()
    wait_for(lambda: starts(history, first.id), 10, what="the first task to start")
    # When three more arrive, which it prefetches while the pool has no free process
    # (acquires may then wait a few ms to go out together, never until the pool frees)
    sent = time.monotonic()
    waiting = [client_app.signature(f"{TASKS}.sleep_then_echo", (f"w{i}",)).delay() for i in range(3)]

    def leased() -> bool:
        records = [store.get(r.id) for r in waiting]
        return all(r is not None and r.state == "active" for r in records)

    wait_for(leased, 1.5, what="the prefetched tasks to hold leases")
    # Then all three hold leases well before the first task ends, none of them started yet
    assert time.monotonic() - sent < 1.5
    assert all(not starts(history, r.id) for r in waiting)
    # And they all run in turn, once each
    assert first.get(timeout=15) == "first"
    assert [r.get(timeout=15) for r in waiting] == ["w0", "w1", "w2"]
    assert all(len(starts(history, r.id)) == 1 for r in waiting)
