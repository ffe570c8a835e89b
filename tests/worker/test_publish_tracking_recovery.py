"""Publish tracking on real processes covers the copies recovery and retries publish, and bounds copies.

The broker is a redis-server of its own without persistence (the common setup);
leases, results and the tasks' history live on the session's server. A copy
re-published by recovery, or a retry handed over, that the broker then loses is
re-published after the delivery timeout and runs once; a task that stays
undelivered gets copies at timeout * (1, 2, 4, ...) intervals, not one per timeout.
"""
from __future__ import annotations

import json

import time

import pytest

import celery_leases
from celery_leases.testing import wait_for
from tests.support.workers import starts

TASKS = "tests.support.apps.leased_app"
TIMEOUT = 3.0


@pytest.fixture
def broker(own_server):
    return own_server("broker")


@pytest.fixture
def tracked_env(celery_env, broker, redis_server_url):
    """Broker on its own server; leases, results and history on the session server."""
    return {**celery_env, "LEASES_TEST_BROKER": broker.url, "LEASES_TEST_BACKEND": redis_server_url,
            "LEASES_TEST_LEASES_URL": redis_server_url, "LEASES_TEST_WORKER_RECOVERY": "1",
            "LEASES_TEST_DELIVERY_TIMEOUT": str(TIMEOUT)}


@pytest.fixture
def tracked_app(tracked_env):
    from tests.support.apps.leased_app import create_app
    app = create_app(tracked_env)
    yield app
    app.close()


@pytest.fixture
def start_tracked_worker(start_worker, tracked_env):
    def start(name: str, **kw):
        env = {k: v for k, v in tracked_env.items() if k.startswith("LEASES_TEST_")}
        return start_worker(name, **kw, **env)
    return start


def lose_everything_in(broker, key_prefix, lost: str | None = None) -> None:
    """SIGKILL the broker's server and start it again empty (no persistence). A worker may put
    back at once what it held in memory (lease-held deliveries: its prefetched messages), never
    what waited in the broker: ``lost``'s message, if given, is not there."""
    broker.kill()
    broker.restart()
    ids = [json.loads(raw)["headers"]["id"] for raw in broker.client().lrange(key_prefix, 0, -1)]
    assert len(ids) <= 1 and lost not in ids, ids


def test_a_recovered_task_whose_copy_the_broker_lost_runs_once_after_the_timeout(
        tracked_app, broker, start_tracked_worker, history, key_prefix):
    # Given a task whose worker was SIGKILLed while running it
    worker = start_tracked_worker("a", concurrency=1)
    result = tracked_app.signature(f"{TASKS}.sleep_then_echo", ("x", 2.0)).delay()
    wait_for(lambda: starts(history, result.id), 15, what="the task to start")
    worker.kill()
    # And recovery re-published it once its lease expired (generation 1), the publish confirmed
    store = celery_leases.store(tracked_app)
    wait_for(lambda: store.recover().recovered, 15, what="recovery to re-publish the task", interval=0.2)
    recovered_at = time.time()
    assert (store.get(result.id).state, store.get(result.id).generation) == ("recovering", 1)
    # When the broker's server is restarted empty: that copy is gone
    lose_everything_in(broker, key_prefix, lost=result.id)
    # Then, with a worker up, the task still runs, once, with a lease, after the delivery timeout
    start_tracked_worker("b", concurrency=1)
    assert result.get(timeout=30) == "x"
    runs = starts(history, result.id)
    assert len(runs) == 2, runs  # the killed run, and one run of the copy re-published
    assert all(int(run[3]["token"]) > 0 for run in runs)
    assert float(runs[1][3]["at"]) >= recovered_at + TIMEOUT - 0.3, (runs, recovered_at)
    record = store.get(result.id)
    assert (record.state, record.generation) == ("succeeded", 2)
    assert store.stats()["undelivered_republished"] >= 1


def test_a_retry_the_broker_lost_runs_again_after_its_countdown_and_the_timeout(
        tracked_app, broker, start_tracked_worker, history, key_prefix):
    # Given one single-process worker busy with short tasks queued behind a task that retries
    # (countdown 0.2 s): the retry's message waits in the broker behind them
    start_tracked_worker("a", concurrency=1)
    sig = tracked_app.signature
    retried = sig(f"{TASKS}.retry_twice").delay()
    blockers = [sig(f"{TASKS}.sleep_then_echo", (i, 0.5)).delay() for i in range(4)]
    wait_for(lambda: starts(history, retried.id), 15, what="the first attempt to start")
    store = celery_leases.store(tracked_app)
    # (hand_over runs before Celery publishes the retry: wait for the retry's message itself)

    def waiting_retry():
        for raw in broker.client().lrange(key_prefix, 0, -1):
            headers = json.loads(raw)["headers"]
            if headers["id"] == retried.id and store.get(retried.id).state == "recovering":
                return int(headers["retries"])
        return None
    # (the first retry's, or on a slow machine, where the worker got there first, the second one's)
    lost = wait_for(waiting_retry, 5, what="the retry to be handed over and its message waiting in the broker")
    due_ms = int(store.client.hget(store.keys.record(retried.id), "due"))  # the hand-over + countdown
    # When the broker's server is restarted empty: the retry's message is gone
    lose_everything_in(broker, key_prefix, lost=retried.id)
    # Then every task still runs to its result (without publish tracking of the hand-over
    # the retry would wait for leases_publish_grace, 30 s, before its copy)
    assert retried.get(timeout=20) == "done"
    assert [b.get(timeout=20) for b in blockers] == [0, 1, 2, 3]
    # And the attempt whose retry was lost ran again from its stored message once, after its
    # countdown plus the delivery timeout, then every later attempt once, each with a lease
    runs = starts(history, retried.id)
    again = lost - 1  # the attempt that retried, re-run from its stored message
    assert [int(run[3]["retries"]) for run in runs] == [*range(lost), again, *range(lost, 3)], (lost, runs)
    assert all(int(run[3]["token"]) > 0 for run in runs)
    owners = store.get(retried.id).history  # (token, owner, acquired_at ms), oldest first
    assert len(owners) == 4 and owners[lost][2] >= due_ms + TIMEOUT * 1000, (owners, due_ms, lost)
    assert [len(starts(history, b.id)) for b in blockers] == [1, 1, 1, 1]
    assert store.get(retried.id).state == "succeeded"
    assert store.stats()["undelivered_republished"] >= 1


def test_a_task_kept_undelivered_gets_copies_at_doubling_intervals(tracked_env, broker):
    # Given a task sent to a queue no worker consumes, with a delivery timeout of 1 s
    from tests.support.apps.leased_app import create_app
    app = create_app({**tracked_env, "LEASES_TEST_DELIVERY_TIMEOUT": "1"})
    store = celery_leases.store(app)
    queue = f"{app.conf.leases_key_prefix}-nobody"
    result = app.signature(f"{TASKS}.add", (1, 2)).apply_async(queue=queue)
    published_at = store.server_time_ms() / 1000
    # When recovery passes run every 0.1 s until the fourth copy, and 3 s after it
    copies: list[float] = []
    quiet_until = time.monotonic() + 30
    while time.monotonic() < quiet_until:
        if store.recover().undelivered:
            copies.append(store.server_time_ms() / 1000 - published_at)
            if len(copies) == 4:
                quiet_until = time.monotonic() + 3
        time.sleep(0.1)
    # Then the nth copy came 2^(n-1) timeouts after the one before: 1, 1, 2 and 4 s (the next
    # 8 s after the fourth), not one per timeout: each waits twice as long as the one before,
    # up to 8 timeouts. Never early; late by at most what a loaded host adds to a pass.
    assert len(copies) == 4, copies
    waits = [b - a for a, b in zip([0.0] + copies, copies)]  # since the previous copy
    for got, want in zip(waits, [1.0, 1.0, 2.0, 4.0]):
        assert want - 0.1 <= got <= want + 1.5, (waits, copies)
    record = store.get(result.id)
    assert (record.state, record.generation, record.recoveries) == ("queued", 4, 0)
    assert store.stats()["undelivered_republished"] == 4
    # And every copy reached the broker (with the original: 5 messages waiting in that queue)
    assert broker.client().llen(queue) == 5
    app.close()


def test_a_job_written_to_a_paused_child_keeps_its_lease_across_a_broker_reconnect(
        tracked_app, broker, start_tracked_worker, history, key_prefix):
    # Given a single-process prefork worker whose idle pool process is paused (SIGSTOP)
    import os
    import signal
    worker = start_tracked_worker("a", concurrency=1)
    sig = tracked_app.signature
    assert sig(f"{TASKS}.sleep_then_echo", ("warm", 0.0)).delay().get(timeout=20) == "warm"
    (child,) = worker.children()
    os.kill(child, signal.SIGSTOP)
    try:
        # And a task the worker leased and wrote to that process's pipe, which the process
        # has not read yet (so the worker's pool never saw it accepted)
        result = sig(f"{TASKS}.sleep_then_echo", ("once", 0.2)).delay()
        store = celery_leases.store(tracked_app)
        wait_for(lambda: store.get(result.id).state == "active", 15, what="the task to be leased")
        time.sleep(0.5)  # the pool writes the job to the idle process's pipe
        # When the broker's server restarts: the consumer restarts and its pool drops the jobs
        # it had not seen accepted, while the paused process will still run the one it was given
        lose_everything_in(broker, key_prefix)
        time.sleep(1.0)  # the consumer reconnects, and gets back the message it held in memory
    finally:
        os.kill(child, signal.SIGCONT)
    # Then the task runs once: the process that was given it keeps the lease, and the copy
    # the worker put back is refused while that lease is held
    assert result.get(timeout=30) == "once"
    time.sleep(2.0)
    assert len(starts(history, result.id)) == 1, starts(history, result.id)
    assert store.get(result.id).state == "succeeded"
