"""Publish tracking on RabbitMQ, real processes: a queue purged or deleted with tasks in it.

The broker is the shared RabbitMQ (tests/support/services.py: skipped locally when
it is not there, a failure under CI); each test touches only its own queue, named
after its key prefix, and deletes it on exit. Leases, results and the tasks'
history live on the session's Redis.
"""
from __future__ import annotations

import time

import pytest
from kombu import Connection

import celery_leases
from tests.support.services import broker_env
from tests.support.workers import assert_ran_once_with_a_lease, busy_with_backlog, results_of, run_counts

TASKS = "tests.support.apps.leased_app"
TIMEOUT = 3.0


@pytest.fixture
def celery_env(celery_env, redis_server_url, key_prefix):
    """RabbitMQ as the broker; the test's queue (its key prefix) removed afterwards."""
    with broker_env(celery_env, "amqp", redis_server_url, key_prefix) as env:
        # A 6 s ttl: these tests are about deliveries, and a loaded host that starves the
        # heartbeat past a 2 s ttl would add take-overs (and recoveries) they do not test.
        yield {**env, "LEASES_TEST_WORKER_RECOVERY": "1", "LEASES_TEST_DELIVERY_TIMEOUT": str(TIMEOUT),
               "LEASES_TEST_TTL": "6"}


def test_every_task_runs_once_after_its_queue_was_purged(client_app, celery_env, key_prefix,
                                                         start_worker, history):
    # Given a worker busy with a 4 s task and 12 short tasks waiting in its RabbitMQ queue
    worker, blocker, short = busy_with_backlog(start_worker, client_app, history, 12)
    store = celery_leases.store(client_app)
    assert {store.get(r.id).state for r in short} <= {"queued", "active"}  # active: prefetched
    # When the queue (this test's own, and only it) is purged
    with Connection(celery_env["LEASES_TEST_BROKER"]) as conn:
        purged = conn.default_channel.queue_purge(key_prefix)
    assert purged >= 10  # the worker may hold one prefetched message: purge leaves unacked ones
    # Then every waiter gets its result
    assert results_of(short, store, timeout=60) == list(range(12))
    assert results_of([blocker], store, timeout=30) == ["block"]
    # And every task ran exactly once, with a lease; the purged ones were re-published
    assert_ran_once_with_a_lease(history, short + [blocker])
    assert store.stats()["undelivered_republished"] >= purged
    assert {store.get(r.id).state for r in short} == {"succeeded"}
    time.sleep(TIMEOUT + 1.5)  # a late duplicate would show up here
    assert run_counts(history)[short[0].id] == 1
    worker.stop()


def test_every_task_runs_once_after_its_queue_was_deleted(client_app, celery_env, key_prefix,
                                                          start_worker, history):
    # Given 8 tasks published while no worker runs
    results = [client_app.signature(f"{TASKS}.add", (i, 1)).delay() for i in range(8)]
    # When their queue is deleted (a worker declares it again when it starts)
    with Connection(celery_env["LEASES_TEST_BROKER"]) as conn:
        assert conn.default_channel.queue_delete(key_prefix) == 8
    worker = start_worker("a", concurrency=2)
    # Then every waiter gets its result, each task ran once with a lease
    store = celery_leases.store(client_app)
    assert results_of(results, store, timeout=60) == [i + 1 for i in range(8)]
    assert_ran_once_with_a_lease(history, results)
    assert store.stats()["undelivered_republished"] == 8
    worker.stop()
