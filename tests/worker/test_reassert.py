"""A held lease whose record vanished (a failover lost its write) is put back under the same token."""
from __future__ import annotations

import time

import redis

import celery_leases
from celery_leases import Code, LeaseStore
from celery_leases.testing import wait_for

TASKS = "tests.support.apps.leased_app"


def forget_lease(client: redis.Redis, store: LeaseStore, task_id: str) -> None:
    """What a failover that lost the acquire leaves: no record, no message, no deadline, older sequence."""
    shard = store.keys.shard_for(task_id)
    client.delete(store.keys.record(task_id), store.keys.message(task_id))
    client.zrem(shard.deadlines, task_id)
    client.set(shard.sequence, 0)


def test_reassert_recreates_the_record_with_the_same_token(redis_server_url, key_prefix):
    client = redis.Redis.from_url(redis_server_url)
    store = LeaseStore(client, prefix=key_prefix)
    held = store.acquire("a", "w", name="n", body=b"body", envelope={"headers": {}})
    forget_lease(client, store, "a")
    assert store.renew_many("w", {"a": held.token}) == {"a": Code.MISSING}

    again = store.acquire("a", "w", name="n", body=b"body", envelope={"headers": {}}, reassert=held.token)

    assert again.code is Code.ACQUIRED and again.token == held.token
    assert store.renew_many("w", {"a": held.token}) == {}
    assert store.get("a").state == "active"
    # The sequence was put back above the token: a later owner still gets a greater one
    assert store.acquire("b", "w").token > held.token
    store.finish("a", "w", held.token, "succeeded")
    assert store.get("a").state == "succeeded"


def test_reassert_is_refused_when_another_record_exists(redis_server_url, key_prefix):
    client = redis.Redis.from_url(redis_server_url)
    store = LeaseStore(client, prefix=key_prefix)
    held = store.acquire("a", "w1")
    forget_lease(client, store, "a")
    other = store.acquire("a", "w2")  # a redelivered copy reached another worker first

    refused = store.acquire("a", "w1", reassert=held.token)

    assert refused.code is Code.LOST
    assert store.get("a").owner == "w2" and store.get("a").token == other.token
    # And re-asserting one's own live record is a no-op that says so
    assert store.acquire("a", "w2", reassert=other.token).code is Code.ACQUIRED


def test_a_running_task_survives_its_record_being_lost(client_app, start_worker, history, redis_client):
    # Given a worker running a task longer than its 2 s ttl
    start_worker("a", pool="threads", concurrency=1)
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("v", 5.0)).delay()
    wait_for(lambda: [h for h in history() if h[0] == "start" and h[1] == result.id], 10,
             what="the task to start")
    token = store.get(result.id).token
    # When the lease record, message and deadline vanish as in a failover that lost the acquire
    forget_lease(redis_client, store, result.id)
    # Then the next heartbeat puts the record back, under the same token
    record = wait_for(lambda: store.get(result.id), 10, what="the record to be re-created")
    assert record.state == "active" and record.token == token
    time.sleep(2.5)  # longer than the ttl: it is being renewed
    assert store.get(result.id).state == "active" and store.expired() == []
    # And the task's outcome is accepted: one run, its result stored, the lease finished
    assert result.get(timeout=15) == "v"
    assert len([h for h in history() if h[0] == "start" and h[1] == result.id]) == 1
    assert store.get(result.id).state == "succeeded"


def test_a_store_error_while_re_creating_the_record_is_retried_not_taken_as_lost(redis_server_url, key_prefix):
    # Given a held lease whose record vanished, and a store that fails the first re-create
    from types import SimpleNamespace

    from celery_leases.config import LeaseConfig
    from celery_leases.exceptions import LeaseUnavailable
    from celery_leases.worker.heartbeat import Heartbeat, Held
    from celery_leases.worker.lost import LostLeases

    client = redis.Redis.from_url(redis_server_url)
    store = LeaseStore(client, prefix=key_prefix, ttl=30)
    held = store.acquire("a", "w", name="n", body=b"body", envelope={"headers": {}})
    request = SimpleNamespace(id="a", task=SimpleNamespace(name="n"), request_dict={"retries": 0},
                              message=SimpleNamespace(headers={}, body=b"body", properties={},
                                                      delivery_info={}, content_type="application/json",
                                                      content_encoding="utf-8"))
    config = LeaseConfig(redis_url=redis_server_url)
    lost = LostLeases(None, config, store, "w", task_config=lambda task: config)
    flagged = []
    beat = Heartbeat(store, "w", 0.1, lambda task_id, h, code: flagged.append(code), on_missing=lost.on_missing)
    beat.add("a", Held(held.token, request, ttl=30))
    forget_lease(client, store, "a")
    real, failures = store.acquire, [LeaseUnavailable("store did not answer")]

    def acquire(**call):
        if failures:
            raise failures.pop()
        return real(**call)
    store.acquire = acquire
    # When the heartbeat ticks while the store fails, then again
    beat.tick()
    assert flagged == [] and not beat.held["a"].lost and store.get("a") is None
    beat.tick()
    # Then the record is back under the same token, and the lease was never flagged lost
    assert flagged == [] and store.get("a").token == held.token and store.get("a").state == "active"
