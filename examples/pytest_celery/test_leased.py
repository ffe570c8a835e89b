"""Leased tasks on pytest-celery's celery_setup: one run, and a run that survives a SIGKILL."""
from celery_leases.testing import pytest_celery as leases
from celery_leases.testing import wait_for, wait_for_lease
from tasks import slow_add


def test_a_leased_task_runs_and_its_lease_ends(celery_setup):
    result = slow_add.s(1, 2).apply_async(queue=celery_setup.worker.worker_queue)
    assert result.get(timeout=30) == 3
    assert leases.lease_record(celery_setup, result.id).state == "succeeded"


def test_a_leased_task_survives_a_sigkill_of_its_worker(celery_setup):
    # Given a task running on the worker, under a lease
    worker = celery_setup.worker
    result = slow_add.s(2, 3, seconds=2).apply_async(queue=worker.worker_queue)
    first = wait_for_lease(celery_setup.app, result.id)
    # When the worker is SIGKILLed mid-task, and its lease runs out
    worker.kill()
    assert worker.container.status == "exited"
    assert leases.expire_worker_leases(celery_setup, [result.id]) == 1
    assert leases.run_recovery(celery_setup.app).recovered == 1
    # Then a worker started again runs the task, under a new token, and the waiter gets its result
    worker.restart()
    assert result.get(timeout=60) == 5
    assert leases.lease_record(celery_setup, result.id).token > first.token


def test_sigterm_is_a_warm_shutdown_and_a_restarted_broker_keeps_its_data(celery_setup):
    # Given a task queued for a worker that SIGTERM stopped (a warm shutdown)
    worker = celery_setup.worker
    worker.kill(signal="SIGTERM")
    worker.wait_for_log("Warm shutdown", timeout=15)
    # (once it has exited: a worker still shutting down takes the message in its last read and
    # gives it back as it closes, which would race the broker's restart below)
    wait_for(lambda: worker.container.status == "exited", 30, what="the worker to exit")
    result = slow_add.s(4, 5).apply_async(queue=worker.worker_queue)
    # When the broker restarts, and then the worker
    celery_setup.broker.restart()
    worker.restart()
    # Then the queued task runs
    assert result.get(timeout=60) == 9
