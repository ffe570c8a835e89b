"""An accepted outcome never ends without its result: a process killed between the finish and
Celery's result write leaves the result kept in the store, and recovery writes it.

Real ``celery worker`` processes, a real result backend on a redis-server of the test's own
(SIGSTOPped so the write blocks after the finish was accepted), real SIGKILLs.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

import celery_leases
from celery_leases.protocol import unwritten
from celery_leases.testing.servers import wait_for
from tests.support.workers import starts


@pytest.fixture
def backend_server(own_server):
    return own_server("backend")


@pytest.fixture
def celery_env(redis_server_url: str, key_prefix: str, backend_server) -> dict:
    return {"LEASES_TEST_BROKER": redis_server_url, "LEASES_TEST_PREFIX": key_prefix,
            "LEASES_TEST_BACKEND": backend_server.url, "LEASES_TEST_LEASES_URL": redis_server_url,
            "LEASES_TEST_TTL": "2", "LEASES_TEST_RECOVERY_INTERVAL": "1"}


def add(app):
    return app.tasks["tests.support.apps.leased_app.add"]


def _killed_after_its_outcome_was_accepted(start_worker, client_app, backend_server, task):
    """Run ``task`` on a worker whose backend is stopped; SIGKILL its pool process once the
    lease record holds the accepted outcome (the process is then blocked in Celery's write)."""
    worker = start_worker("a", concurrency=1)
    store = celery_leases.store(client_app)
    # Sent first (the client subscribes to the result on the backend), due a second later.
    result = task()
    os.kill(backend_server.process.pid, signal.SIGSTOP)
    try:
        record = wait_for(lambda: (r := store.get(result.id)) is not None and r.state in
                          ("succeeded", "failed") and r, 20, "the outcome accepted")
        time.sleep(0.2)  # the process is now inside Celery's write, blocked on the backend
        for child in worker.children():
            os.kill(child, signal.SIGKILL)
    finally:
        os.kill(backend_server.process.pid, signal.SIGCONT)
    return store, result, record


def _recover_until_written(client_app, store, task_id: str) -> int:
    written = 0

    def written_now() -> bool:
        nonlocal written
        written += celery_leases.store(client_app).recover().results_written or 0
        return client_app.backend.get_task_meta(task_id, cache=False)["status"] != "PENDING"
    wait_for(written_now, 20, f"recovery writing the kept result of {task_id}")
    return written


def test_a_success_whose_process_died_before_celery_stored_it_gets_its_result(
        start_worker, client_app, backend_server, history):
    # Given a worker whose pool process is killed after its success was accepted,
    # before Celery wrote the result (the backend was stopped)
    store, result, record = _killed_after_its_outcome_was_accepted(
        start_worker, client_app, backend_server, lambda: add(client_app).apply_async((2, 3), countdown=1))
    assert record.state == "succeeded"
    assert client_app.backend.get_task_meta(result.id, cache=False)["status"] == "PENDING"

    # When recovery runs (the kept result is due one ttl after the finish)
    wrote = _recover_until_written(client_app, store, result.id)

    # Then the waiter gets the task's own result, the body ran once, and the write is counted
    assert result.get(timeout=10) == 5
    assert wrote == 1
    assert len(starts(history, result.id)) == 1
    assert store.get(result.id).state == "succeeded"
    assert store.stats()["results_written"] == 1
    assert unwritten.count(store) == 0


def test_a_failure_whose_process_died_before_celery_stored_it_gets_its_exception(
        start_worker, client_app, backend_server):
    # Given a task whose body raised TypeError, killed before Celery stored the failure
    store, result, record = _killed_after_its_outcome_was_accepted(
        start_worker, client_app, backend_server, lambda: add(client_app).apply_async(("a", 1), countdown=1))
    assert record.state == "failed"

    # When recovery runs
    _recover_until_written(client_app, store, result.id)

    # Then the waiter gets the exception the body raised, with its traceback
    with pytest.raises(TypeError):
        result.get(timeout=10)
    assert result.state == "FAILURE"
    assert "TypeError" in (result.traceback or "")


def test_results_celery_wrote_are_confirmed_without_a_round_trip_and_never_rewritten(
        start_worker, client_app):
    # Given a worker with one pool process running tasks one after another
    start_worker("a", concurrency=1)
    store = celery_leases.store(client_app)
    results = [add(client_app).delay(i, 1) for i in range(8)]
    assert [r.get(timeout=20) for r in results] == [i + 1 for i in range(8)]

    # Then each finish carried the confirmation of the one before: only the last is kept
    assert unwritten.count(store) == 1
    # And recovery, once it is due, finds that one written and writes nothing
    time.sleep(2.2)
    report = celery_leases.store(client_app).recover()
    assert report.results_written == 0
    assert unwritten.count(store) == 0
    assert store.stats().get("results_written", 0) == 0


def test_a_process_that_exits_confirms_what_no_finish_carried(start_worker, client_app):
    # Given a worker whose pool process ran tasks; the last one's confirmation is pending
    worker = start_worker("a", concurrency=1)
    store = celery_leases.store(client_app)
    results = [add(client_app).delay(i, 2) for i in range(3)]
    assert [r.get(timeout=20) for r in results] == [2, 3, 4]
    assert unwritten.count(store) == 1
    # When the worker shuts down warmly (its pool process exits)
    worker.stop()
    # Then the process confirmed it on its way out: nothing is left for recovery to check
    assert unwritten.count(store) == 0


@pytest.mark.parametrize("age, left", [(60.0, True), (7200.0, False)])
def test_a_kept_result_recovery_cannot_write_is_retried_then_given_up(celery_env, age, left, caplog):
    # Given a kept result, due, for an app whose result backend does not answer
    from tests.support.apps.leased_app import create_app
    app = create_app({**celery_env, "LEASES_TEST_BACKEND": "redis://127.0.0.1:1/0"})
    try:
        store = celery_leases.store(app)
        acq = store.acquire("t-unwritable", "w")
        kept = unwritten.pack("SUCCESS", "proj.add", None, b"5", at=time.time() - age)
        store.finish("t-unwritable", "w", acq.token, "succeeded", kept=kept, kept_due=0.001)
        time.sleep(0.01)
        # When a recovery pass tries to write it
        report = store.recover()
        # Then the failure is reported and named; a recent one is kept for the next try,
        # one past the give-up age is dropped, logged as given up
        assert [task_id for task_id, _ in report.errors] == ["t-unwritable"]
        assert report.results_written == 0
        assert unwritten.count(store) == (1 if left else 0)
        assert ("given up" in caplog.text) is not left
        assert "t-unwritable" in caplog.text
    finally:
        app.close()
