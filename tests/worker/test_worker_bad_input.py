"""Bad input at the worker: clear errors naming the setting; no task run without a lease."""
from __future__ import annotations

import time

import pytest

import celery_leases
from celery_leases.testing.servers import RedisServer
from tests.support.workers import Worker

TASKS = "tests.support.apps.leased_app"


def test_worker_with_unreachable_lease_store_waits_at_start_naming_the_setting(celery_env, tmp_path):
    # (it waits like Celery waits for its broker; the retries and the exit: tests/worker/test_misuse.py)
    worker = Worker("bad", {**celery_env, "LEASES_TEST_LEASES_URL": "redis://127.0.0.1:1/0"},
                    log_dir=tmp_path)
    with pytest.raises(RuntimeError) as failure:
        worker.start(timeout=8)
    worker.kill()
    assert "not ready" in str(failure.value)
    assert "Cannot connect to redis://127.0.0.1:1/0 (leases_redis_url)" in str(failure.value)


def test_worker_with_broken_setting_fails_at_start_naming_it(celery_env, tmp_path):
    worker = Worker("bad", {**celery_env, "LEASES_TEST_TTL": "-3"}, log_dir=tmp_path)
    with pytest.raises(RuntimeError) as failure:
        worker.start(timeout=30)
    worker.kill()
    assert "leases_ttl" in str(failure.value)


def test_store_down_when_a_task_arrives_it_is_not_run_and_not_lost(celery_env, start_worker, history,
                                                                    redis_server_url, tmp_path):
    # Given a lease store on its own Redis (broker and results elsewhere), and a running worker
    lease_redis = RedisServer(dir=tmp_path)
    lease_redis.start()
    try:
        env = {**celery_env, "LEASES_TEST_LEASES_URL": lease_redis.url}
        from tests.support.apps.leased_app import create_app
        app = create_app(env)
        worker = start_worker("a", **{k: v for k, v in env.items() if k.startswith("LEASES_TEST_")},
                              LEASES_TEST_UNAVAILABLE_DELAY="1")
        # When the lease store goes down and a task arrives
        lease_redis.stop()
        result = app.signature(f"{TASKS}.add_unbound", (20, 22)).delay()
        time.sleep(2.5)
        # Then it has not run (no result), and it is re-queued about once per second,
        # not in a tight loop (an ETA copy is received at once; it is retried when due)
        assert app.backend.get_task_meta(result.id)["status"] == "PENDING"
        receipts = worker.log().count(f"[{result.id}] received")
        assert 1 <= receipts <= 6, receipts
        # ... and once the store is back, the delayed copy runs it under a lease
        lease_redis.start()
        assert result.get(timeout=20) == 42
        assert celery_leases.store(app).get(result.id).state == "succeeded"
        app.close()
    finally:
        lease_redis.stop()


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_record_corrupted_under_a_running_task_lets_no_outcome_out_and_parks_it_once(
        pool, celery_env, start_worker, client_app, history):
    # Given a leased task running on a worker that also runs recovery, with a callback and an errback
    import redis as redis_py
    from celery_leases import CorruptRecord, DeliveryParked
    from tests.support.workers import starts
    start_worker("w", pool=pool, LEASES_TEST_WORKER_RECOVERY="1")
    store = celery_leases.store(client_app)
    tasks = client_app.tasks
    note = tasks[f"{TASKS}.note_callback"]
    r = tasks[f"{TASKS}.sleep_then_echo"].apply_async(
        ("v", 1.5), link=note.si("called back"), link_error=note.si("errback"))
    deadline = time.monotonic() + 30
    while not starts(history, r.id):
        assert time.monotonic() < deadline, "the task did not start"
        time.sleep(0.05)
    # When its lease record is corrupted while the body runs (a token no script can read)
    redis_py.Redis.from_url(client_app.conf.leases_redis_url).hset(store.keys.record(r.id), "token", "x")
    # Then the body's outcome never reaches the backend (nothing the store could not verify
    # may leave the worker) and no callback runs for it; recovery parks the task instead,
    # which its waiter learns once, naming the key and field
    seen = []
    while time.monotonic() < deadline:
        meta = client_app.backend.get_task_meta(r.id)
        seen.append((meta["status"], type(meta["result"]).__name__))
        if meta["status"] == "FAILURE":
            break
        time.sleep(0.1)
    assert ("FAILURE", "DeliveryParked") in seen and ("SUCCESS", "str") not in seen, seen
    assert not any(kind == CorruptRecord.__name__ for _, kind in seen), seen
    with pytest.raises(DeliveryParked) as parked:
        r.get(timeout=5)
    assert parked.value.task_id == r.id and parked.value.field == "token"
    assert parked.value.key == store.keys.record(r.id)
    time.sleep(2.0)  # a second errback, or a late callback, would have come by now
    callbacks = [h[3]["value"] for h in history() if h[0] == "callback"]
    assert callbacks == ["errback"], callbacks
    assert len(starts(history, r.id)) == 1
    assert client_app.backend.get_task_meta(r.id)["status"] == "FAILURE"
