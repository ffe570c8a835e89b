"""Deterministic checks of cases the chaos suite's random schedule reaches only by chance.

Each is the smallest setup that shows its case on a real worker and a real Redis, in
about 15 s: the requests Celery drops on a broker reconnect release their leases, a
threads worker's queued requests keep theirs, and a duplicate refused on the owner's own
worker leaves the owner's lease renewed (docs/chaos.md, "Known limitations").
"""
from __future__ import annotations

import time

import pytest

import celery_leases
from chaos.app import TASK_NAME, create_app
from chaos.cluster import Cluster
from chaos.history import by_task, read_history
from chaos.run import _finished
from celery_leases.testing import wait_for, wait_for_lease


@pytest.fixture
def one_worker(tmp_path):
    """Factory: a Cluster (leases mode) with one worker of the given pool, and its client app."""
    made = []

    def make(pool: str, concurrency: int, prefetch: int = 4):
        cluster = Cluster(tmp_path / f"{pool}{len(made)}", "leases", 1, prefetch=prefetch,
                          pools=[(pool, concurrency)])
        made.append(cluster)
        cluster.start()
        app = create_app(cluster.client_env())
        submit = create_app(cluster.client_env(), results=False)
        made.extend([app, submit])
        return cluster, app, submit

    yield make
    for thing in reversed(made):
        (thing.close if hasattr(thing, "close") else thing.shutdown)()


def executions(cluster: Cluster) -> dict[str, int]:
    return {task: sum(e["ev"] == "start" for e in events)
            for task, events in by_task(read_history(cluster.history_dir)).items()}


def test_prefetched_tasks_run_after_a_broker_reconnect(one_worker):
    # Given a prefork worker running one long task with four more prefetched (each leased)
    cluster, app, submit = one_worker("prefork", 1)
    ids = [f"pre{i}" for i in range(5)]
    for i, task_id in enumerate(ids):
        submit.send_task(TASK_NAME, args=(i, 3.0 if i == 0 else 0.2), task_id=task_id)
    for task_id in ids:  # owned, not merely recorded (publish tracking records it queued)
        wait_for_lease(app, task_id, 20)
    # When Redis restarts under it (AOF on: nothing is lost) and the worker reconnects
    cluster.redis_restart("graceful", 0.5)
    # Then every task runs, once, well within ttl + recovery interval + task time
    wait_for(lambda: _finished(app, "leases", ids) == set(ids), 12, interval=0.5,
             what="all five tasks to finish")
    assert all(n == 1 for n in executions(cluster).values())


def test_duplicate_delivery_on_the_owners_worker_keeps_the_lease_renewed(one_worker):
    # Given a threads worker running a task longer than the lease ttl (3 s)
    cluster, app, submit = one_worker("threads", 2, prefetch=1)
    submit.send_task(TASK_NAME, args=(0, 7.0), task_id="dup")
    wait_for(lambda: executions(cluster).get("dup"), 10, what="the task to start")
    # When a second copy of its message reaches the same worker (a broker redelivery),
    # which refuses it: another owner holds a live lease
    submit.send_task(TASK_NAME, args=(0, 7.0), task_id="dup")
    wait_for(lambda: any(e["ev"] == "acquire" and e.get("skip") for e in read_history(cluster.history_dir)),
             10, what="the duplicate to be refused")
    # Then the owner's lease stays renewed: the task runs once, never recovered
    wait_for(lambda: _finished(app, "leases", ["dup"]), 20, interval=0.5, what="the task to finish")
    time.sleep(1.0)
    record = celery_leases.store(app).get("dup")
    assert record.recoveries == 0
    assert executions(cluster)["dup"] == 1


def test_queued_requests_of_a_threads_worker_run_once_after_a_broker_reconnect(one_worker):
    # Given a threads worker running one task longer than ttl + recovery interval, with four
    # more queued in its thread pool
    cluster, app, submit = one_worker("threads", 1)
    ids = [f"q{i}" for i in range(5)]
    for i, task_id in enumerate(ids):
        submit.send_task(TASK_NAME, args=(i, 6.0 if i == 0 else 0.2), task_id=task_id)
    for task_id in ids:  # owned, not merely recorded (publish tracking records it queued)
        wait_for_lease(app, task_id, 20)
    # When Redis restarts under it and the worker reconnects
    cluster.redis_restart("graceful", 0.5)
    # Then every task runs once: the thread pool kept the queued requests, so they keep their leases
    wait_for(lambda: _finished(app, "leases", ids) == set(ids), 20, interval=0.5,
             what="all five tasks to finish")
    time.sleep(1.5)
    assert all(n == 1 for n in executions(cluster).values()), executions(cluster)
