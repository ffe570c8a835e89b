"""Publish tracking on real processes: the broker forgets, the backlog is deep, the publisher dies.

The broker is a redis-server of its own without persistence (the common setup);
leases, results and the tasks' history live on the session's server.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

import celery_leases
from celery_leases.publishing.tracking import queued_tasks
from celery_leases.testing.servers import free_port
from tests.support.workers import ROOT, busy_with_backlog, run_counts

TASKS = "tests.support.apps.leased_app"
TIMEOUT = 3.0


@pytest.fixture
def celery_env(celery_env, broker_server, redis_server_url):
    """Broker on its own server; leases, results and history on the session server."""
    return {**celery_env, "LEASES_TEST_BROKER": broker_server.url, "LEASES_TEST_BACKEND": redis_server_url,
            "LEASES_TEST_LEASES_URL": redis_server_url, "LEASES_TEST_WORKER_RECOVERY": "1",
            "LEASES_TEST_DELIVERY_TIMEOUT": str(TIMEOUT)}


def test_every_task_runs_once_after_the_broker_restarted_empty(client_app, broker_server, start_worker,
                                                                history, key_prefix):
    # Given a worker busy with a 4 s task, 20 short tasks waiting in the broker (one prefetched)
    # and 3 ETA tasks due in 8 s
    worker, blocker, short = busy_with_backlog(start_worker, client_app, history, 20)
    eta = time.time() + 8.0
    held = [client_app.signature(f"{TASKS}.sleep_then_echo", (f"eta{i}",)).apply_async(eta=eta_dt(eta))
            for i in range(3)]
    store = celery_leases.store(client_app)
    assert {store.get(r.id).state for r in short + held} <= {"queued", "active"}
    # When the broker's server is killed and restarted empty (no persistence)
    broker_server.kill()
    broker_server.restart()
    # (the worker, reconnecting, may have declared its bindings already, and put back the
    # messages it held in memory, lease-held deliveries: the prefetched one and the 3 ETA
    # ones; the 19 waiting in the broker are gone)
    assert broker_server.client().llen(key_prefix) <= 4
    # Then every waiter gets its result
    for i, result in enumerate(short):
        assert result.get(timeout=60) == i
    assert [r.get(timeout=60) for r in held] == ["eta0", "eta1", "eta2"]
    assert blocker.get(timeout=30) == "block"
    # And every task ran exactly once, the ETA tasks never before their ETA
    counts = run_counts(history)
    assert {r.id: counts[r.id] for r in short + held + [blocker]} == dict.fromkeys(
        [r.id for r in short + held + [blocker]], 1)
    for h in history():
        if h[0] == "start" and h[1] in {r.id for r in held}:
            assert float(h[3]["at"]) >= eta - 0.05, h
    # And the lost ones were re-published by the undelivered step, counted
    assert store.stats()["undelivered_republished"] >= 18
    assert {store.get(r.id).state for r in short + held} == {"succeeded"}
    worker.stop()


def eta_dt(when: float):
    from datetime import datetime, timezone
    return datetime.fromtimestamp(when, tz=timezone.utc)


def test_a_deep_backlog_drained_slower_than_the_timeout_runs_each_task_once(client_app, start_worker,
                                                                            history):
    # Given 16 tasks of 0.5 s published before one single-process worker starts:
    # draining them takes about 8 s, nearly three delivery timeouts
    sig = client_app.signature
    results = [sig(f"{TASKS}.sleep_then_echo", (i, 0.5)).delay() for i in range(16)]
    started = time.monotonic()
    worker = start_worker("a", concurrency=1)
    # Then every waiter gets its result and no task ran twice or went dead
    assert [r.get(timeout=90) for r in results] == list(range(16))
    drained = time.monotonic() - started
    counts = run_counts(history)
    assert [counts[r.id] for r in results] == [1] * 16
    store = celery_leases.store(client_app)
    assert {store.get(r.id).state for r in results} == {"succeeded"}
    assert all(store.get(r.id).recoveries == 0 for r in results)
    # And copies are bounded: at most one per timeout period of waiting, per task
    republished = store.stats().get("undelivered_republished", 0)
    assert republished <= 16 * (drained / TIMEOUT + 1), (republished, drained)
    worker.stop()


PUBLISHER = """
import os, signal, sys
from kombu.messaging import Producer
from tests.support.apps.leased_app import create_app
app = create_app(os.environ)
# A first publish goes through (it loads the script: later records are sent without waiting)
app.signature("tests.support.apps.leased_app.add", (1, 1)).apply_async(task_id=sys.argv[1] + "-warm")
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
Producer.publish = die
app.signature("tests.support.apps.leased_app.sleep_then_echo", ("orphan",)).apply_async(task_id=sys.argv[1])
"""


def test_a_publisher_killed_between_record_and_publish_runs_its_task_once(celery_env, client_app, broker_server,
                                                                          start_worker, history):
    # Given a publisher SIGKILLed after the task was recorded and before its message was sent
    task_id = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-c", PUBLISHER, task_id], cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env}, timeout=60)
    assert proc.returncode == -9
    store = celery_leases.store(client_app)
    assert store.get(task_id).state == "queued"
    assert broker_server.client().llen(celery_env["LEASES_TEST_PREFIX"]) == 1  # the warm-up task only
    # When a worker runs recovery passes
    worker = start_worker("a", concurrency=1)
    # Then, after the delivery timeout, the task runs once, from the recorded message
    assert client_app.AsyncResult(task_id).get(timeout=30) == "orphan"
    time.sleep(TIMEOUT + 1.5)
    assert run_counts(history)[task_id] == 1
    record = store.get(task_id)
    assert (record.state, record.generation) == ("succeeded", 1)
    worker.stop()


def test_publishing_records_leased_tasks_only(client_app):
    # A leased task is queued at publish; the plugin's own (unleased) recovery task is not
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.add", (1, 2)).apply_async(countdown=30, expires=60)
    record = store.get(result.id)
    assert (record.state, record.name) == ("queued", f"{TASKS}.add")
    raw = store.client.hgetall(store.keys.record(result.id))
    assert int(raw[b"due"]) > store.server_time_ms() + 25_000
    assert int(raw[b"expires"]) > int(raw[b"due"])
    assert queued_tasks(client_app).count() >= 1
    plain = client_app.send_task("celery_leases.recover")
    assert store.get(plain.id) is None


def test_a_task_past_its_expires_while_undelivered_is_revoked_for_its_waiters(client_app, broker_server,
                                                                              start_worker, history):
    from celery.exceptions import TaskRevokedError
    # Given a task that expires in 1 s, whose message the broker then loses
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("never",)).apply_async(expires=1.0)
    broker_server.kill()
    broker_server.restart()
    # When a worker runs recovery passes past the delivery timeout
    worker = start_worker("a", concurrency=1)
    # Then the waiter gets REVOKED, as Celery stores it for an expired message, and it never ran
    with pytest.raises(TaskRevokedError):
        result.get(timeout=30)
    store = celery_leases.store(client_app)
    assert store.get(result.id).state == "revoked"
    assert run_counts(history)[result.id] == 0
    assert store.stats()["undelivered_expired"] == 1
    worker.stop()


def test_republished_undelivered_tasks_are_a_metric_and_a_stats_counter(client_app):
    prometheus_client = pytest.importorskip("prometheus_client")
    from celery_leases.cli.show import _stats
    from celery_leases.ops.metrics import enable_prometheus
    from celery_leases.signals import undelivered_republished
    registry = prometheus_client.CollectorRegistry()
    metrics = enable_prometheus(client_app, registry)
    try:
        undelivered_republished.send(sender=client_app, task_id="t", generation=1)
        assert registry.get_sample_value("celery_leases_undelivered_republished_total") == 1.0
    finally:
        metrics.disable()
    counters = _stats(celery_leases.store(client_app), False)["counters"]
    assert {"queued", "undelivered_republished", "undelivered_expired"} <= set(counters)


def test_a_publish_that_raises_leaves_no_record(celery_env, redis_server_url):
    from tests.support.apps.leased_app import create_app
    # Given a broker nobody listens on: apply_async raises (no publish retries)
    app = create_app({**celery_env, "LEASES_TEST_BROKER": f"redis://127.0.0.1:{free_port()}/0"})
    store = celery_leases.store(app)
    from kombu.exceptions import OperationalError
    for _ in range(2):  # the first publish records synchronously, later ones pipelined
        task_id = uuid.uuid4().hex
        with pytest.raises(OperationalError):
            app.signature(f"{TASKS}.add", (1, 2)).apply_async(task_id=task_id, retry=False)
        # Then the caller, told the task was not sent, is right: no record will run it later
        assert store.get(task_id) is None
    app.close()


def test_a_group_and_a_chord_header_are_recorded_in_one_batch(client_app, start_worker, history,
                                                               monkeypatch):
    from celery import chord, group
    store = celery_leases.store(client_app)
    sig = client_app.signature
    sig(f"{TASKS}.add", (0, 0)).apply_async(countdown=60)  # the first record loads the script
    pool = store.client.connection_pool
    taken = []
    get_connection = pool.get_connection
    monkeypatch.setattr(pool, "get_connection", lambda *a, **kw: taken.append(1) or get_connection(*a, **kw))
    # When a group of 10 and a chord with a header of 5 are published (no worker yet)
    grouped = group(sig(f"{TASKS}.add", (i, 1)) for i in range(10)).apply_async()
    assert len(taken) == 1  # every member's record on one connection, replies read at the end
    chorded = chord([sig(f"{TASKS}.add", (i, i)) for i in range(5)], sig(f"{TASKS}.tsum"))()
    # Then each member is queued in the store before any worker received it
    assert {store.get(r.id).state for r in grouped.results} == {"queued"}
    assert {store.get(r.id).state for r in chorded.parent.results} == {"queued"}
    monkeypatch.undo()
    # And a worker runs each once, the chord's body with the header's results
    worker = start_worker("a", concurrency=2)
    assert grouped.get(timeout=30) == [i + 1 for i in range(10)]
    assert chorded.get(timeout=30) == sum(2 * i for i in range(5))
    counts = run_counts(history)
    assert [counts[r.id] for r in grouped.results + chorded.parent.results] == [1] * 15
    worker.stop()


def test_a_worker_acquires_a_recorded_task_without_sending_its_message(client_app, start_worker, history,
                                                                        broker_server, key_prefix):
    import json

    from celery_leases.publishing.publish_id import RECORDED_HEADER, recorded_headers
    # Given a task recorded at publish, its message waiting in the broker (no worker yet)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("x", 2.0)).apply_async()
    store = celery_leases.store(client_app)
    assert store.get(result.id).state == "queued"
    (raw,) = broker_server.client().lrange(key_prefix, 0, -1)
    headers = json.loads(raw)["headers"]
    assert headers[RECORDED_HEADER] == recorded_headers(headers)
    # and a mark on the recorded message that no delivered copy carries
    message = store.keys.message(result.id)
    envelope = json.loads(store.client.hget(message, "envelope"))
    store.client.hset(message, "envelope", json.dumps({**envelope, "mark": "recorded"}))
    # When a worker takes it
    start_worker("a", pool="threads", concurrency=2)
    deadline = time.monotonic() + 30
    while not any(h[0] == "start" and h[1] == result.id for h in history()):
        assert time.monotonic() < deadline, "the task never started"
        time.sleep(0.05)
    # Then its lease holds the recorded message, not one the worker sent
    assert store.get(result.id).state == "active"
    assert json.loads(store.client.hget(message, "envelope"))["mark"] == "recorded"
    assert result.get(timeout=30) == "x"
