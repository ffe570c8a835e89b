"""A soft or cold shutdown that cuts a leased task off: the task comes back and runs once more.

Celery's cold shutdown (SIGQUIT; the end of ``worker_soft_shutdown_timeout``)
cancels the running tasks. Plain Celery leaves a cancelled ``acks_late``
message unacknowledged, and kombu's Redis transport restores it when the
channel closes ("Restoring 1 unacknowledged message(s)"). A leased worker does
the same, and releases the lease, so that the restored copy runs at once on
the next worker. An early-acknowledged task has no message left to restore:
its released lease is what brings it back (recovery). Either way the body runs
once more, not twice.
"""
from __future__ import annotations

import signal
import time

import pytest

import celery_leases
from celery_leases import testing
from celery_leases.testing import wait_for
from tests.support.workers import ROOT, starts

TASKS = "tests.support.apps.leased_app"
#: The shutdown under test: a soft shutdown of 1 s, then the cold shutdown cancels what still runs.
SHUTDOWN_CONF = {"worker_soft_shutdown_timeout": 1.0, "task_reject_on_worker_lost": False}


@pytest.fixture
def launch(celery_env, tmp_path, request):
    """Factory: a started worker of the test app with ``conf`` applied (the suite's ``start_worker``
    takes no settings beyond the app's environment)."""
    started: list = []
    testing.report_worker_logs(request.node, started)

    def start(name: str, conf: dict | None = None, **env: str) -> testing.Worker:
        worker = testing.Worker(TASKS, name=name, log_dir=tmp_path, conf=conf, env={**celery_env, **env},
                                concurrency=1, cwd=ROOT, pythonpath=[str(ROOT)])
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.kill()


def cold_shutdown_mid_task(launch, client_app, history, acks_late: str):
    """Worker A starts a 6 s task and gets SIGQUIT: 1 s of soft shutdown, then the cold shutdown
    cancels the task. Returns (A, the result, A's start event)."""
    a = launch("a", SHUTDOWN_CONF, LEASES_TEST_ACKS_LATE=acks_late)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("again", 6.0)).delay()
    wait_for(lambda: starts(history, result.id), 15, what="A to start the task")
    store = celery_leases.store(client_app)
    wait_for(lambda: store.get(result.id).started, 10, what="A's start mark")
    a.signal(signal.SIGQUIT, main_only=True)
    wait_for(lambda: not a.running, 30, what="A's cold shutdown to end")
    assert "Cold shutdown" in a.log()
    return a, result, starts(history, result.id)[0]


@pytest.mark.parametrize("recovery", ["no recovery", "recovery"])
def test_cold_shutdown_restores_the_unacked_message_and_the_task_runs_once_more(
        recovery, launch, client_app, history, redis_client, key_prefix):
    # Given an acks_late task cut off by worker A's cold shutdown
    a, result, first = cold_shutdown_mid_task(launch, client_app, history, acks_late="1")
    # Then, as in plain Celery, A gave its message back to the broker before it exited
    assert "Restoring 1 unacknowledged message(s)" in a.log()
    assert redis_client.llen(key_prefix) == 1
    assert result.state != "SUCCESS"
    # And worker B (with or without recovery running: the copy recovery might add changes nothing)
    # runs the task again, for the original waiter
    launch("b", LEASES_TEST_ACKS_LATE="1", LEASES_TEST_WORKER_RECOVERY="1" if recovery == "recovery" else "0")
    assert result.get(timeout=30) == "again"
    assert_ran_once_more(client_app, history, result, first)


def test_cold_shutdown_of_an_early_acked_task_its_lease_brings_it_back_once(
        launch, client_app, history, redis_client, key_prefix):
    # Given a task acknowledged when it started (no acks_late), cut off by A's cold shutdown
    a, result, first = cold_shutdown_mid_task(launch, client_app, history, acks_late="0")
    # Then the broker has nothing to give back (plain Celery would lose the task here)
    assert redis_client.llen(key_prefix) == 0
    # And the released lease lets recovery (worker B's) re-run it at once, once
    launch("b", LEASES_TEST_WORKER_RECOVERY="1")
    assert result.get(timeout=30) == "again"
    assert_ran_once_more(client_app, history, result, first)


def assert_ran_once_more(client_app, history, result, first) -> None:
    """One second body under a higher token and no third, charged as one recovery of a
    started task (leases_max_recoveries bounds a task cut off again and again)."""
    time.sleep(3)
    runs = starts(history, result.id)
    assert len(runs) == 2, runs
    assert int(runs[1][3]["token"]) > int(first[3]["token"])
    record = celery_leases.store(client_app).get(result.id)
    assert (record.state, record.recoveries) == ("succeeded", 1)


def test_a_warm_shutdown_that_hangs_logs_the_stacks_before_the_kill(client_app, start_worker, history):
    # Given a worker running a 30 s task
    worker = start_worker("a", concurrency=1)
    stuck = client_app.signature(f"{TASKS}.sleep_then_echo", ("stuck", 30.0)).delay()
    wait_for(lambda: starts(history, stuck.id), 20, what="the task to start")
    # When its warm shutdown does not end within 2 s
    began = time.monotonic()
    worker.stop(timeout=2)
    # Then it was killed, and its log holds every thread's stack (Celery's SIGUSR1 handler),
    # the main thread's and the lease heartbeat's among them
    assert not worker.running and time.monotonic() - began < 15
    assert worker.proc.returncode == -signal.SIGKILL
    log = worker.log()
    assert "MainThread" in log and "celery-leases-heartbeat" in log, worker.log_tail()
