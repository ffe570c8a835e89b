"""The acquire at receipt fails closed (issues #14.1, #14.5, #15.1, #15.2).

Real redis-servers and real ``celery worker`` processes (prefork and threads):
malformed messages are parked and never wedge the worker; corrupt records are
parked, never run and never looped; an unreachable store re-queues with a
growing, capped delay; a re-queued copy's ETA is on the store's clock.
"""
from __future__ import annotations

import re
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import celery
import kombu
import pytest

import celery_leases
from celery_leases import LeasedTask, install
from celery_leases.config import get_config
from celery_leases.exceptions import DeliveryParked
from celery_leases.testing.servers import RedisServer
from celery_leases.worker.service import LeaseWorker
from celery_leases.testing import wait_for

TASKS = "tests.support.apps.leased_app"


def publish(app: celery.Celery, name: str, args: tuple = (), **headers: Any) -> str:
    """Publish a task message as Celery would, with some headers overridden; returns its real id."""
    task_id = str(uuid.uuid4())
    message = app.amqp.as_task_v2(task_id, name, args=args, kwargs={})
    fields = {**message.headers, **headers}
    for key, value in headers.items():
        if value is _DROP:
            fields.pop(key)
    with app.producer_or_acquire() as producer:
        producer.publish(message.body, exchange="", routing_key=app.conf.task_default_queue,
                         headers=fields, serializer="json", retry=True, **message.properties)
    return task_id


_DROP = object()

#: Messages a client can send that must never reach the acquirer as they are: (name, headers).
MALFORMED = [
    ("id null", {"id": None}),
    ("id float", {"id": 1.5}),
    ("id lone surrogate", {"id": "bad-\ud800-id"}),
    ("id empty", {"id": ""}),
    ("lease_generation not a number", {"lease_generation": "abc"}),
    ("lease_generation float", {"lease_generation": 1.5}),
    ("lease_generation negative", {"lease_generation": -1}),
    ("retries not a number", {"retries": "x"}),
    ("retries float", {"retries": 0.5}),
    ("lease_requeues not a number", {"lease_requeues": "x"}),
    ("lease_publish not a string", {"lease_publish": 7}),
    ("lease_publish with a space", {"lease_publish": "ab cd"}),
]


def _tokens_of_ordinary_tasks(app, history, results) -> None:
    """Each ordinary task ran exactly once, with its own record's token, all tokens distinct."""
    store = celery_leases.store(app)
    assert [r.get(timeout=30) for r in results] == [i + 1 for i in range(len(results))]
    starts = {}
    for event, task_id, _pid, fields in history():
        if event == "start":
            starts.setdefault(task_id, []).append(int(fields["token"]))
    tokens = []
    for r in results:
        assert len(starts.get(r.id, [])) == 1, (r.id, starts.get(r.id))
        record = store.get(r.id)
        assert record.state == "succeeded" and record.token == starts[r.id][0]
        tokens.append(record.token)
    assert len(set(tokens)) == len(tokens)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_malformed_messages_are_parked_and_ordinary_tasks_run_once_with_their_own_token(
        pool, client_app, start_worker, history):
    # Given a worker (2 processes, prefetch 2) and a stream that opens with every kind of
    # malformed message, more of them than the worker has prefetch slots
    worker = start_worker("a", pool=pool)
    bad_ids = []
    for _round in range(2):
        for _what, headers in MALFORMED:
            bad_ids.append(publish(client_app, f"{TASKS}.add", (1, 1), **headers))
    # ... one of them held for its ETA (Celery keeps it in its timer until then)
    eta = (datetime.now(timezone.utc) + timedelta(seconds=2)).isoformat()
    bad_ids.append(publish(client_app, f"{TASKS}.add", (1, 1), eta=eta, retries="later"))
    # When ordinary tasks follow, interleaved with more malformed ones
    results = []
    for i in range(6):
        results.append(client_app.signature(f"{TASKS}.add", (i, 1)).delay())
        what, headers = MALFORMED[i % len(MALFORMED)]
        publish(client_app, f"{TASKS}.add", (1, 1), **headers)
    # Then every ordinary task runs exactly once, under its own lease token
    _tokens_of_ordinary_tasks(client_app, history, results)
    # ... no malformed delivery ran its body
    ran = {task_id for event, task_id, *_ in history() if event == "start"}
    assert ran == {r.id for r in results}
    # ... and each malformed delivery is parked, visible, naming the field at fault
    store = celery_leases.store(client_app)
    total = 2 * len(MALFORMED) + 6 + 1  # two rounds, the six interleaved, the ETA one
    wait_for(lambda: sum(p.count for p in store.parked(limit=1000)) >= total, 15,
             what="every malformed delivery to be parked")
    parked = store.parked(limit=1000)
    fields = {p.field for p in parked}
    assert {"id", "lease_generation", "retries", "lease_requeues", "lease_publish"} <= fields, fields
    by_id = {p.task_id: p for p in parked}
    for task_id in bad_ids:
        # A usable id is parked under itself; a bad id's delivery under its repr.
        if task_id in by_id:
            assert by_id[task_id].field in ("lease_generation", "retries", "lease_requeues", "lease_publish")
            assert by_id[task_id].field in by_id[task_id].reason
    assert repr(None) in by_id and repr(1.5) in by_id and repr("bad-\ud800-id") in by_id
    log = worker.log()
    assert "header lease_generation must be a non-negative integer, got 'abc'" in log
    assert "header lease_publish must be 1 to 64 ASCII letters or digits, got 'ab cd'" in log
    assert "the task id is not a string: 1.5" in log
    # ... and the worker holds no request it will never run (no prefetch slot kept), the
    # ETA one included once its ETA passed
    time.sleep(max(0.0, (datetime.fromisoformat(eta) - datetime.now(timezone.utc)).total_seconds()))
    wait_for(lambda: _reserved(client_app) == [] and _scheduled(client_app) == [], 10,
             what="no reserved or scheduled requests left")
    assert client_app.signature(f"{TASKS}.add", (41, 1)).delay().get(timeout=15) == 42


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_leased_task_that_reaches_its_pool_without_a_lease_is_parked_not_run(pool, client_app,
                                                                             start_worker, history):
    # Given a worker whose acquire at receipt never runs (its task_received hook is gone)
    worker = start_worker("a", pool=pool, LEASES_TEST_NO_RECEIPT_HOOK="1")
    # When leased tasks arrive
    results = [client_app.signature(f"{TASKS}.add", (i, 1)).delay() for i in range(3)]
    # Then none runs its body without a lease: each is parked, its waiter released
    for result in results:
        with pytest.raises(DeliveryParked, match="no lease was acquired at receipt"):
            result.get(timeout=15)
    assert [h for h in history() if h[0] == "start"] == []
    assert "no lease was acquired at receipt" in worker.log()
    # ... and a plain task still runs
    assert client_app.signature(f"{TASKS}.plain_sleep", ("P",)).delay().get(timeout=15) == "P"


def _reserved(app) -> list:
    replies = app.control.inspect(timeout=2).reserved() or {}
    assert replies, "the worker did not answer inspect"
    return [r for requests in replies.values() for r in requests]


def _scheduled(app) -> list:
    replies = app.control.inspect(timeout=2).scheduled() or {}
    assert replies, "the worker did not answer inspect"
    return [r for requests in replies.values() for r in requests]


def _received(worker, task_id: str) -> list[float]:
    """Times (s, the worker's log clock) at which the worker received a delivery of ``task_id``."""
    out = []
    for line in worker.log().splitlines():
        if f"[{task_id}] received" in line:
            stamp = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):", line).group(1)
            out.append(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_corrupt_records_are_parked_never_run_and_never_looped(pool, client_app, start_worker,
                                                                history, redis_client):
    # Given a worker, and tasks whose lease keys are corrupt before they arrive: a finished
    # record and an active one whose token is not a number, a record that is not a hash
    worker = start_worker("a", pool=pool)
    store = celery_leases.store(client_app)
    finished, active, wrong_type = (str(uuid.uuid4()) for _ in range(3))
    redis_client.hset(store.keys.record(finished), mapping={"state": "succeeded", "token": "x1"})
    redis_client.hset(store.keys.record(active), mapping={"state": "active", "token": "x2",
                                                          "owner": "elsewhere"})
    redis_client.set(store.keys.record(wrong_type), "not a hash")
    corrupt = {task_id: "token" for task_id in (finished, active)}
    corrupt[wrong_type] = "type"
    # When copies of them are delivered (and an ordinary task beside them)
    results = {t: client_app.signature(f"{TASKS}.add", (1, 2)).apply_async(task_id=t) for t in corrupt}
    ordinary = client_app.signature(f"{TASKS}.add", (0, 1)).delay()
    assert ordinary.get(timeout=30) == 1
    # Then their waiters are released with DeliveryParked naming the key and the field
    for task_id, field in corrupt.items():
        with pytest.raises(DeliveryParked) as parked:
            results[task_id].get(timeout=15, propagate=True)
        assert store.keys.record(task_id) in str(parked.value) and field in str(parked.value)
    # ... over 10 s each was delivered once: parked, not re-queued (main: ~2,500 publishes)
    time.sleep(10)
    for task_id in corrupt:
        assert len(_received(worker, task_id)) == 1, _received(worker, task_id)
    assert {p.task_id for p in store.parked()} >= set(corrupt)
    # When the stats key holds the wrong type (counters only: every acquire of the shard
    # touches it; main re-queued every leased task in a loop)
    stats = store.keys.shard_for(finished).stats
    redis_client.delete(stats)
    redis_client.set(stats, "not a hash")
    try:
        beside = client_app.signature(f"{TASKS}.add", (2, 2)).delay()
        # Then the task runs once under its lease (a counter is no reason to refuse it),
        # delivered once
        assert beside.get(timeout=15) == 4
        time.sleep(3)
        assert len(_received(worker, beside.id)) == 1
        assert store.get(beside.id).state == "succeeded"
    finally:
        redis_client.delete(stats)
    # ... and no body of a corrupt record ran
    ran = {task_id for event, task_id, *_ in history() if event == "start"}
    assert ran == {ordinary.id, beside.id}


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_store_unreachable_requeues_with_growing_capped_delays(pool, celery_env, start_worker, tmp_path):
    # Given a lease store on its own server, base delay 0.5 s capped at 2 s
    lease_redis = RedisServer(dir=tmp_path).start()
    try:
        env = {**celery_env, "LEASES_TEST_LEASES_URL": lease_redis.url,
               "LEASES_TEST_UNAVAILABLE_DELAY": "0.5", "LEASES_TEST_UNAVAILABLE_MAX_DELAY": "2"}
        from tests.support.apps.leased_app import create_app
        app = create_app(env)
        worker = start_worker("a", pool=pool, **{k: v for k, v in env.items() if k.startswith("LEASES_TEST_")})
        # When the store goes down and a task arrives
        lease_redis.stop()
        result = app.signature(f"{TASKS}.add_unbound", (20, 22)).delay()
        wait_for(lambda: len(_received(worker, result.id)) >= 7, 30, what="seven deliveries")
        # Then the copies come back after 0.5, 1, 2, 2, 2 s: doubling, capped, never sooner
        # (the first copy is received at once and held by Celery until its ETA)
        times = _received(worker, result.id)
        gaps = [b - a for a, b in zip(times[1:], times[2:])]
        expected = [0.5, 1.0, 2.0, 2.0, 2.0]
        for gap, delay in zip(gaps, expected):
            assert delay - 0.1 <= gap <= delay + 1.5, (gaps, expected)
        # ... logged once when the task went unreachable, not once per delivery
        log = worker.log()
        assert log.count(f"[{result.id}]: lease store unreachable") == 1, log
        assert app.backend.get_task_meta(result.id)["status"] == "PENDING"
        # And once the store is back, a copy runs the task under a lease
        lease_redis.start()
        assert result.get(timeout=20) == 42
        assert celery_leases.store(app).get(result.id).state == "succeeded"
        app.close()
    finally:
        lease_redis.stop()


# -- in-process: the ETA's clock and the delivery window ----------------------------------------

class Request:
    """What LeaseWorker reads of a Celery request."""

    def __init__(self, task: Any, message: Any, task_id: str | None = None) -> None:
        self.id, self.task, self.name = task_id or str(uuid.uuid4()), task, task.name
        self.message = kombu.Message(body=message.body, headers={**message.headers, "id": self.id},
                                     properties=message.properties, delivery_info=message.delivery_info,
                                     content_type=message.content_type,
                                     content_encoding=message.content_encoding)
        self.request_dict: dict = {"retries": 0}
        self.acknowledged = False

    def acknowledge(self) -> None:
        self.acknowledged = True


@pytest.fixture
def in_process(redis_server_url, key_prefix, tmp_path):
    """A LeaseWorker (no pool) whose lease store is a server of its own; broker: the test server."""
    lease_redis = RedisServer(dir=tmp_path).start()
    app = celery.Celery("rcpt", broker=redis_server_url, set_as_current=False)
    app.conf.update(leases_redis_url=lease_redis.url, leases_key_prefix=key_prefix,
                    leases_worker_recovery=False, task_default_queue=key_prefix,
                    leases_unavailable_retry_delay=5, leases_deliveries_per_minute=3,
                    broker_connection_retry_on_startup=True)
    install(app)

    @app.task(base=LeasedTask, name="rcpt.noop", shared=False)
    def noop():
        return None

    app.send_task("rcpt.noop")
    with app.connection_for_read() as conn:
        message = kombu.Queue(key_prefix)(conn.default_channel).get(no_ack=True)
    worker = LeaseWorker(app, get_config(app))
    worker.start()  # reads the store's clock, as a worker does when it starts
    yield app, worker, noop, message, lease_redis
    worker.heartbeat.stop()
    app.close()
    lease_redis.stop()


def _queued(app) -> list:
    out = []
    with app.connection_for_read() as conn:
        queue = kombu.Queue(app.conf.task_default_queue)(conn.default_channel)
        while (message := queue.get(no_ack=True)) is not None:
            out.append(message)
    return out


class _Skewed(datetime):
    """datetime whose now() is an hour fast: a worker with a wrong wall clock."""

    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz) + timedelta(hours=1)

    @classmethod
    def utcnow(cls):
        return datetime.utcnow() + timedelta(hours=1)


def _skew_wall_clock(monkeypatch) -> None:
    import sys
    for name, module in list(sys.modules.items()):
        if name.startswith("celery_leases") and getattr(module, "datetime", None) is datetime:
            monkeypatch.setattr(module, "datetime", _Skewed)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)


def test_a_requeued_copy_has_its_eta_on_the_store_clock_not_the_workers(in_process, monkeypatch,
                                                                        redis_client):
    REQUEUES_HEADER = "lease_requeues"
    app, worker, task, message, lease_redis = in_process
    # Given a worker whose wall clock is an hour fast (it read the store's clock at start)
    _skew_wall_clock(monkeypatch)
    # When the store is unreachable as a task arrives and when it is due
    lease_redis.stop()
    request = Request(task, message)
    worker.receipt.on_received(request)
    worker.receipt.acquire_pending(request)
    # Then the copy it re-queues is due 5 s from now by the right clock, not an hour late
    (copy,) = _queued(app)
    eta = datetime.fromisoformat(copy.headers["eta"])
    seconds, micros = redis_client.time()  # the same machine's clock, unskewed
    now = datetime.fromtimestamp(seconds + micros / 1e6, timezone.utc)
    assert abs((eta - now).total_seconds() - 5) < 1.0, (eta, now)
    assert copy.headers[REQUEUES_HEADER] == 1 and copy.headers["id"] == request.id
    assert request.acknowledged and request.request_dict["lease_skip"]


def test_past_the_delivery_window_a_delivery_is_postponed_never_run_sooner(in_process, redis_client):
    REQUEUES_HEADER = "lease_requeues"
    app, worker, task, message, lease_redis = in_process
    # Given a worker that admits 3 deliveries of one task id per minute
    task_id = str(uuid.uuid4())
    admitted = []
    for _ in range(3):
        request = Request(task, message, task_id)
        worker.receipt.on_received(request)
        admitted.append(request)
    assert admitted[0].request_dict.get("lease_token")
    # (the first holds it: the duplicates are told it is this worker, #14.7)
    token = admitted[0].request_dict["lease_token"]
    assert [r.request_dict.get("lease_skip") for r in admitted[1:]] == \
        [f"a live lease is held (token {token}, by this worker)"] * 2
    # When a fourth delivery arrives within the minute
    fourth = Request(task, message, task_id)
    worker.receipt.on_received(fourth)
    # Then it is not acquired at receipt; when due it is re-queued to when the window has room
    assert "lease_token" not in fourth.request_dict
    worker.receipt.acquire_pending(fourth)
    (copy,) = _queued(app)
    eta = datetime.fromisoformat(copy.headers["eta"])
    seconds, micros = redis_client.time()
    wait = (eta - datetime.fromtimestamp(seconds + micros / 1e6, timezone.utc)).total_seconds()
    assert 55 < wait <= 60.5, wait
    assert fourth.acknowledged and REQUEUES_HEADER not in copy.headers


def test_delivery_window_counts_admitted_deliveries_per_id():
    from celery_leases.worker.delivery import DeliveryWindow
    now = [0.0]
    window = DeliveryWindow(limit=2, window=60.0, clock=lambda: now[0])
    assert window.admit("a") == 0.0 and window.admit("a") == 0.0
    now[0] = 10.0
    assert window.admit("a") == pytest.approx(50.0)  # refused deliveries are not counted
    assert window.admit("b") == 0.0
    now[0] = 60.0
    assert window.admit("a") == 0.0 and window.admit("a") == 0.0  # both left the window
    assert window.admit("a") == pytest.approx(60.0)
    now[0] = 200.0
    window.admit("c")
    assert set(window._seen) == {"c"}  # idle ids are forgotten


def test_requeue_delay_doubles_up_to_its_cap():
    from celery_leases.worker.delivery import requeue_delay
    assert [requeue_delay(5, 300, n) for n in range(9)] == [5, 10, 20, 40, 80, 160, 300, 300, 300]
    assert requeue_delay(600, 300, 0) == 600  # a cap below the base is the base
    assert requeue_delay(1, 60, 10_000) == 60


@pytest.mark.parametrize("headers", [{"lease_generation": "abc"}, {"retries": "x"}], ids=lambda h: next(iter(h)))
def test_a_parked_delivery_recorded_at_publish_is_never_re_published_by_recovery(
        headers, celery_env, start_worker, history):
    # Given publish tracking with a 1 s delivery timeout, a worker that runs recovery, and a
    # task published through Celery (so recorded at publish) with a malformed header
    from tests.support.apps.leased_app import create_app
    env = {**celery_env, "LEASES_TEST_DELIVERY_TIMEOUT": "1"}
    app = create_app(env)
    store = celery_leases.store(app)
    start_worker("a", pool="threads", **{k: v for k, v in env.items() if k.startswith("LEASES_TEST_")},
                 LEASES_TEST_WORKER_RECOVERY="1")
    r = app.tasks[f"{TASKS}.add"].apply_async((1, 2), headers=headers)
    # When the worker parks it at receipt
    with pytest.raises(DeliveryParked):
        r.get(timeout=30)
    # Then no recovery pass re-publishes it from its publish record in five delivery timeouts:
    # it stays parked, never runs, and its waiter's answer stays DeliveryParked
    time.sleep(5.0)
    assert not [h for h in history() if h[0] == "start" and h[1] == r.id]
    assert app.backend.get_task_meta(r.id)["status"] == "FAILURE"
    assert isinstance(app.backend.get_task_meta(r.id)["result"], DeliveryParked)
    assert store.parked_entry(r.id) is not None
    assert r.id not in {m.decode() for m in store.client.zrange(store.keys.shard_for(r.id).queued, 0, -1)}
    app.close()
