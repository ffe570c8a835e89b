"""Duplicate deliveries meet the lease: only the rightful owner runs the body."""
from __future__ import annotations

import time

import celery_leases
from celery_leases.testing import wait_for

TASKS = "tests.support.apps.leased_app"


def runs(history, task_id):
    return [h for h in history() if h[0] == "start" and h[1] == task_id]


def restore_unacked(app, visibility_timeout: float) -> None:
    """Do what a live kombu consumer does periodically: put unacked messages past the
    visibility timeout back in their queues."""
    with app.connection_for_read(transport_options={"visibility_timeout": visibility_timeout}) as conn:
        conn.default_channel.qos.restore_visible(num=10000, interval=1)


def test_kombu_restore_after_crash_and_lease_recovery_run_once(client_app, start_worker, history):
    # Given worker A that prefetched 5 tasks behind a blocker (each leased, unacked) and was killed,
    # with kombu keeping its unacked copies (held deliveries off: as for every message whose
    # publisher did not record it, docs/celery.md)
    env = {"LEASES_TEST_PREFETCH": "10", "LEASES_TEST_VISIBILITY": "2", "LEASES_TEST_TTL": "1",
           "LEASES_TEST_HELD": "0"}
    a = start_worker("a", concurrency=1, **env)
    store = celery_leases.store(client_app)
    blocker = client_app.signature(f"{TASKS}.sleep_then_echo", ("block", 20.0)).delay()
    wait_for(lambda: runs(history, blocker.id), 10, what="the blocker to start")
    results = [client_app.signature(f"{TASKS}.add", (i, 1)).delay() for i in range(5)]
    wait_for(lambda: store.stats().get("acquired", 0) >= 6, 10, what="A to lease the prefetched tasks")
    a_pids = {a.pid, *a.children()}
    a.kill()
    # When the lease recovery re-publishes them AND kombu restores the unacked originals
    wait_for(lambda: len(store.expired()) >= 6, 10, what="the leases to expire")
    assert store.recover().recovered == 6
    time.sleep(2.1)
    restore_unacked(client_app, 2)
    # Then worker B sees both copies of each task, and each body runs exactly once
    start_worker("b", concurrency=2, **env)
    assert [r.get(timeout=30) for r in results] == [i + 1 for i in range(5)]
    assert blocker.get(timeout=30) == "block"
    time.sleep(1.5)
    for r in results + [blocker]:
        assert len([h for h in runs(history, r.id) if h[2] not in a_pids]) == 1
    # the 5 prefetched originals were restored and refused as stale (the blocker had been
    # acked when it started, early ack, so kombu had no copy of it to restore)
    assert store.stats().get("stale_deliveries", 0) == 5


def test_visibility_timeout_redelivery_while_owner_runs_is_not_run(client_app, start_worker, history):
    # Given acks_late and a visibility timeout shorter than the task, on two workers that let
    # kombu keep its unacked copy (held deliveries off, as for a message without a publish record)
    env = {"LEASES_TEST_ACKS_LATE": "1", "LEASES_TEST_VISIBILITY": "1", "LEASES_TEST_HELD": "0"}
    start_worker("a", concurrency=1, **env)
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("once", 5.0)).delay()
    wait_for(lambda: runs(history, result.id), 10, what="A to start")
    start_worker("b", concurrency=1, **env)
    # When the broker redelivers the still-running task (kombu's restore of unacked messages)
    time.sleep(1.2)
    restore_unacked(client_app, 1)
    wait_for(lambda: store.stats().get("busy_deliveries", 0) >= 1, 10,
             what="the redelivered copy to meet the live lease")
    # Then the copy is not run: the task runs once and succeeds once
    assert result.get(timeout=20) == "once"
    time.sleep(1.0)
    assert len(runs(history, result.id)) == 1
    assert store.get(result.id).state == "succeeded"


def test_reject_on_worker_lost_requeue_runs_once(client_app, start_worker, history):
    # Given acks_late + task_reject_on_worker_lost, and a task that kills its pool child once
    start_worker("a", concurrency=1, LEASES_TEST_ACKS_LATE="1", LEASES_TEST_WORKER_RECOVERY="1")
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.kill_own_child", (0.2,)).delay()
    # When the child dies, Celery requeues the message at once and the lease is released at once
    assert result.get(timeout=20) == "survived"
    # Then the requeued copy took over the released lease; a recovery pass finds nothing to
    # re-publish, so the body ran exactly twice (the killed run and the accepted run)
    time.sleep(2.5)
    assert len(runs(history, result.id)) == 2
    record = store.get(result.id)
    # One death: a recovery, or an unstarted one if the child died (0.2 s in) before its
    # batched start mark reached the store, as on a loaded machine
    assert record.state == "succeeded" and record.recoveries + record.unstarted_recoveries == 1
    assert store.stats().get("taken_over", 0) == 1 and store.stats().get("recovered", 0) == 0
