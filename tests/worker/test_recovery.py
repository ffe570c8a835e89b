"""Recovery on real workers: a killed worker's tasks run again under the same id."""
from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from celery import chord

import celery_leases
from celery_leases import LeaseExpired
from tests.support.services import broker_env
from tests.support.workers import lapsed_leases
from celery_leases.testing import wait_for, wait_for_lease

TASKS = "tests.support.apps.leased_app"


@pytest.fixture(params=["redis", "amqp"])
def celery_env(request, celery_env, redis_server_url, key_prefix):
    """Every recovery test runs on a Redis broker and on RabbitMQ (leases and results on Redis)."""
    with broker_env(celery_env, request.param, redis_server_url, key_prefix) as env:
        yield env


def runs(history, task_id, event="start"):
    return [h for h in history() if h[0] == event and h[1] == task_id]


@pytest.mark.parametrize("acks_late", ["0", "1"])
def test_whole_worker_killed_task_reruns_for_the_original_waiter(acks_late, client_app, start_worker,
                                                                  history):
    # Given worker A running a task, and worker B that runs the fallback recovery
    a = start_worker("a", LEASES_TEST_ACKS_LATE=acks_late)
    # (6 s: A still runs it once B started, however slowly B starts on a loaded machine)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("rerun", 6.0)).delay()
    wait_for(lambda: runs(history, result.id), 10, what="A to start the task")
    start_worker("b", LEASES_TEST_ACKS_LATE=acks_late, LEASES_TEST_WORKER_RECOVERY="1")
    # (killed once its start mark is in: only a running task is charged a recovery)
    store = celery_leases.store(client_app)
    wait_for(lambda: store.get(result.id).started, 10, what="A's start mark")
    # When A (main process and children) is SIGKILLed mid-task
    a.kill()
    killed_at = time.time()
    # Then the original waiter gets the re-run's result
    assert result.get(timeout=30) == "rerun"
    second = runs(history, result.id)[1]
    assert second[2] not in (a.pid, *a.children())
    # And the re-run started within ttl + recovery interval + 2 s of the kill

    record = celery_leases.store(client_app).get(result.id)
    assert record.recoveries == 1 and record.state == "succeeded"
    acquired_at = record.history[-1][2] / 1000.0
    assert acquired_at - killed_at <= 2.0 + 1.0 + 2.0, (acquired_at - killed_at)



def test_poison_pill_is_dead_after_max_recoveries(celery_env, start_worker, history, key_prefix):
    # Given a task that SIGKILLs its whole worker every time it runs, max_recoveries = 2,
    # and a dead-letter queue
    from tests.support.apps.leased_app import create_app
    dead_letters = f"{key_prefix}-dead"
    client_app = create_app({**celery_env, "LEASES_TEST_DLQ": dead_letters})
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.kill_own_worker").delay()
    generation = 0
    for attempt in range(3):
        worker = start_worker(f"w{attempt}", LEASES_TEST_MAX_RECOVERIES="2")
        wait_for(lambda: worker.proc.poll() is not None, 15, what=f"run {attempt + 1} to kill its worker")
        worker.kill()
        # recovery (this test plays beat): after the ttl the lease is claimed
        wait_for(lambda: store.recover().recovered + store.stats().get("dead", 0), 10,
                 what="the lease to be recovered or buried")
        record = store.get(result.id)
        if record.state == "dead":
            break
        assert record.generation == generation + 1
        generation = record.generation
    # Then it ran 1 + max_recoveries times, is dead after exactly 2 recoveries, and get() raises
    assert len(runs(history, result.id)) == 3
    record = store.get(result.id)
    assert record.state == "dead" and record.recoveries == 2
    with pytest.raises(LeaseExpired):
        result.get(timeout=10)
    # And its original message waits in the dead-letter queue for inspection
    with client_app.connection_for_read() as conn:
        channel = conn.default_channel
        message = wait_for(lambda: channel.basic_get(dead_letters, no_ack=True), 5,
                           what="the dead letter")
        assert message.headers["id"] == result.id and message.headers["lease_dead"] is True
        try:
            channel.queue_delete(dead_letters)
        except Exception:  # noqa: BLE001 - best effort cleanup (RabbitMQ keeps durable queues)
            pass


def test_two_recoverers_over_500_expired_leases_rerun_each_once(client_app, start_worker, history):
    # Given worker A that received 500 tasks (prefetched: each holds a lease) and is killed
    a = start_worker("a", concurrency=1, LEASES_TEST_PREFETCH="600", LEASES_TEST_TTL="1")
    store = celery_leases.store(client_app)
    blocker = client_app.signature(f"{TASKS}.sleep_then_echo", ("block", 30.0)).delay()
    wait_for(lambda: runs(history, blocker.id), 10, what="the blocker to start")
    results = [client_app.signature(f"{TASKS}.add", (i, i)).delay() for i in range(500)]
    wait_for(lambda: store.stats().get("acquired", 0) >= 501, 20, what="A to lease all 500")
    a.kill()
    wait_for(lambda: len(store.expired(1000)) >= 501, 10, what="the leases to expire")
    # When two recoverers race over them
    published: dict = {}
    lock = threading.Lock()

    def recoverer():
        own = celery_leases.LeaseStore.from_url(client_app.conf.leases_redis_url,
                                                prefix=client_app.conf.leases_key_prefix)
        inner = store.publish

        def publish(claim):
            inner(claim)
            with lock:
                published[claim.task_id] = published.get(claim.task_id, 0) + 1
        own.recover(publish=publish)

    threads = [threading.Thread(target=recoverer) for _ in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    # Then each lease was re-published once, and each task re-runs exactly once on worker B
    assert len(published) == 501 and set(published.values()) == {1}
    start_worker("b", concurrency=4, LEASES_TEST_TTL="1")
    assert [r.get(timeout=60) for r in results] == [2 * i for i in range(500)]
    for r in results:
        assert len(runs(history, r.id)) == 1


def test_recoverer_dying_between_claim_and_publish_is_covered_by_the_next_pass(
        client_app, start_worker, history):
    # Given an abandoned task whose lease a recoverer claimed but never published
    a = start_worker("a", LEASES_TEST_TTL="1")
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("again", 0.5)).delay()
    wait_for(lambda: runs(history, result.id), 10, what="A to start")
    store = celery_leases.LeaseStore.from_url(client_app.conf.leases_redis_url,
                                              prefix=client_app.conf.leases_key_prefix,
                                              ttl=1, publish_grace=1.0)
    # (killed once its start mark is in: only a running task is charged a recovery)
    wait_for(lambda: store.get(result.id).started, 5, what="A's start mark")
    a.kill()
    wait_for(lambda: store.expired(), 5, what="the lease to expire")

    def crash(claim):
        raise RuntimeError("recoverer died before publishing")

    report = store.recover(publish=crash)
    assert report.publish_failed == 1 and store.get(result.id).state == "recovering"
    # When the next pass runs after the publish grace period
    time.sleep(1.2)
    report = celery_leases.store(client_app).recover()
    # Then the task is re-published (one more generation, no extra recovery counted) and runs
    assert report.recovered == 1
    start_worker("b")
    assert result.get(timeout=20) == "again"
    record = celery_leases.store(client_app).get(result.id)
    assert record.recoveries == 1 and record.generation == 2


def test_eta_task_recovered_keeps_its_eta(client_app, start_worker, history):
    # Given a task with an ETA 8 s ahead, received (and leased) by worker A
    a = start_worker("a")
    store = celery_leases.store(client_app)
    eta = datetime.now(timezone.utc) + timedelta(seconds=8)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("late", 0.0)).apply_async(eta=eta)
    wait_for_lease(client_app, result.id, 10)  # active: tracking records it as queued at publish
    # When A is killed before the ETA and B recovers the task
    a.kill()
    start_worker("b", LEASES_TEST_WORKER_RECOVERY="1")
    # Then it runs once, not before its ETA
    assert result.get(timeout=30) == "late"
    started = runs(history, result.id)
    assert len(started) == 1
    record = store.get(result.id)
    # A only held it, waiting for its ETA: recovered without a recovery charged to it
    assert (record.recoveries, record.unstarted_recoveries) == (0, 1)
    assert record.finished_at / 1000.0 >= eta.timestamp() - 0.05


def test_chord_member_recovered_callback_runs_once_with_all_results(client_app, start_worker, history):
    # Given a chord whose members run on worker A
    a = start_worker("a", concurrency=3)
    store = celery_leases.store(client_app)
    header = [client_app.signature(f"{TASKS}.sleep_then_echo", (i, 3.0)) for i in (1, 2, 3)]
    result = chord(header, client_app.signature(f"{TASKS}.tsum")).delay()
    wait_for(lambda: len([h for h in history() if h[0] == "start"]) >= 3, 10, what="members to start")
    # When A dies mid-chord and B recovers the members
    a.kill()
    b = start_worker("b", concurrency=3, LEASES_TEST_WORKER_RECOVERY="1")
    # Then the callback runs once, with every member's result
    assert result.get(timeout=30) == 6
    time.sleep(1.0)
    sums = [h for h in history() if h[0] == "start" and h[1] == result.id]
    assert len(sums) == 1
    # Three recoveries (A's members), plus one per lease that lapsed under B if the host
    # stalled past the ttl: a lapse is recovered too, and logged by B as lost or refused
    lapsed = lapsed_leases(a, b)
    assert store.stats().get("recovered") == 3 + len(lapsed), lapsed


def test_warm_shutdown_releases_unstarted_leases_at_once(client_app, start_worker, history):
    # Given worker A running one task with three more prefetched (each leased), ttl 30 s
    a = start_worker("a", concurrency=1, LEASES_TEST_PREFETCH="4", LEASES_TEST_TTL="30")
    store = celery_leases.store(client_app)
    running = client_app.signature(f"{TASKS}.sleep_then_echo", ("first", 2.0)).delay()
    wait_for(lambda: runs(history, running.id), 10, what="A to start")
    queued = [client_app.signature(f"{TASKS}.add", (i, 0)).delay() for i in range(3)]
    wait_for(lambda: store.stats().get("acquired", 0) >= 4, 10, what="A to lease the prefetched tasks")
    # When A shuts down warmly (SIGTERM): it finishes the running task and stops
    a.stop(timeout=30)
    assert running.get(timeout=5) == "first"
    # Then the prefetched leases were released (not left for the 30 s ttl), and worker B
    # runs each of them once, without counting a recovery
    for r in queued:
        record = store.get(r.id)
        assert record.owner == "" and record.deadline <= store.server_time_ms() + 1
    start_worker("b", LEASES_TEST_TTL="30", LEASES_TEST_WORKER_RECOVERY="1")
    assert [r.get(timeout=20) for r in queued] == [0, 1, 2]
    for r in queued:
        assert len(runs(history, r.id)) == 1
        assert store.get(r.id).recoveries == 0
