"""Publish tracking on a real server: enqueue.lua, claim_undelivered.lua and acquire of a queued record."""
from __future__ import annotations

import time

import pytest

from celery_leases import Code, LeaseStore
from celery_leases.protocol.queued import QueuedTask, QueuedTasks

TIMEOUT = 0.3


@pytest.fixture
def store(redis_client, key_prefix):
    return LeaseStore(redis_client, prefix=key_prefix, ttl=5, retention=60)


@pytest.fixture
def queued(store):
    return QueuedTasks(store, TIMEOUT)


def task(task_id="t1", body=b"body", **kw) -> QueuedTask:
    return QueuedTask(task_id, "proj.add", body, {"headers": {"id": task_id}, "routing_key": "q"}, **kw)


def overdue(queued, published=None):
    """Let the delivery timeout pass, then run one undelivered pass; returns (report, published, expired)."""
    time.sleep(TIMEOUT + 0.1)
    published, expired = [], []
    report = queued.recover(published.append, expired.append)
    return report, published, expired


def test_enqueue_records_a_queued_task_indexed_at_publish_plus_the_timeout(store, queued, redis_client):
    # When a task is recorded at publish
    assert queued.enqueue(task()) == (Code.OK, "queued")
    # Then it is queued, generation 0, with its message, in the queued index at now + timeout
    record = store.get("t1")
    assert (record.state, record.generation, record.token, record.has_message) == ("queued", 0, 0, True)
    assert not record.started  # no worker has it yet
    score = redis_client.zscore(store.keys.shard_for("t1").queued, "t1")
    assert abs(score - (store.server_time_ms() + TIMEOUT * 1000)) < 200
    assert redis_client.hget(store.keys.message("t1"), "body") == b"body"
    # And it is not a lease: nothing is in the deadline index
    assert store.expired() == [] and store.active() == []


def test_an_eta_task_is_due_at_its_eta(store, queued, redis_client):
    eta = store.server_time_ms() + 60_000
    queued.enqueue(task(eta_ms=eta))
    assert redis_client.zscore(store.keys.shard_for("t1").queued, "t1") == eta + TIMEOUT * 1000
    # And it is not re-published before its ETA + the timeout
    report, published, _ = overdue(queued)
    assert published == [] and report.undelivered == 0


@pytest.mark.parametrize("state", ["queued", "active", "succeeded", "revoked"])
def test_enqueue_never_overwrites_an_existing_record(store, queued, redis_client, state):
    # Given a record in each state (a second publish of a queued id, a retry of a running
    # task, a new publish of a finished id, a revoked id)
    if state == "queued":
        queued.enqueue(task(body=b"first"))
    else:
        acq = store.acquire("t1", "w", body=b"first", envelope={})
        if state == "succeeded":
            store.finish("t1", "w", acq.token, "succeeded")
        elif state == "revoked":
            store.revoke("t1", owner="w", token=acq.token)
    before = redis_client.hgetall(store.keys.record("t1"))
    # When the id is published again with tracking
    code, seen = queued.enqueue(task(body=b"second"))
    # Then nothing was written: BUSY for a live record, FINISHED for a terminal one
    assert (code, seen) == ((Code.FINISHED if state in ("succeeded", "revoked") else Code.BUSY), state)
    assert redis_client.hgetall(store.keys.record("t1")) == before
    assert redis_client.hget(store.keys.message("t1"), "body") in (b"first", None)
    if state != "queued":
        assert redis_client.zscore(store.keys.shard_for("t1").queued, "t1") is None


def test_acquire_moves_queued_to_active_and_out_of_the_index(store, queued, redis_client):
    queued.enqueue(task())
    acq = store.acquire("t1", "w", name="proj.add", body=b"body", envelope={})
    assert acq.code is Code.ACQUIRED and acq.token >= 1 and acq.generation == 0
    assert store.get("t1").state == "active"
    assert redis_client.zcard(store.keys.shard_for("t1").queued) == 0
    # And no recovery pass re-publishes it
    _, published, _ = overdue(queued)
    assert published == []


def test_an_overdue_task_is_republished_once_per_timeout_with_a_new_generation(store, queued):
    queued.backoff_cap = 1  # no backoff here: one copy per timeout (test_undelivered_recovering.py has it)
    queued.enqueue(task())
    # When no worker acquired it within the timeout
    report, published, _ = overdue(queued)
    # Then one copy is handed out, generation 1, and it is counted
    assert [(p.task_id, p.generation, p.body) for p in published] == [("t1", 1, b"body")]
    assert published[0].envelope["headers"]["id"] == "t1"
    assert report.undelivered == 1 and report.as_dict()["undelivered"] == 1
    assert store.stats()["undelivered_republished"] == 1
    # And a pass right after hands out nothing more (due again only after another timeout)
    assert queued.recover(published.append).undelivered == 0
    assert len(published) == 1
    # And it costs no recovery: waiting never makes a task dead
    for _ in range(4):
        overdue(queued)
    record = store.get("t1")
    assert (record.state, record.generation, record.recoveries) == ("queued", 5, 0)
    # And only the newest copy may run: older generations are stale
    assert store.acquire("t1", "w", generation=0).code is Code.STALE
    assert store.acquire("t1", "w", generation=4).code is Code.STALE
    assert store.acquire("t1", "w", generation=5).code is Code.ACQUIRED
    assert store.acquire("t1", "w2", generation=5).code is Code.BUSY


def test_a_task_past_its_expires_is_revoked_not_republished(store, queued, redis_client):
    queued.enqueue(task(expires_ms=store.server_time_ms() + 100))
    report, published, expired = overdue(queued)
    assert published == [] and [e.task_id for e in expired] == ["t1"]
    assert expired[0].code is Code.FINISHED and expired[0].body == b"body"
    assert report.undelivered_expired == 1
    assert store.get("t1").state == "revoked"
    assert redis_client.exists(store.keys.message("t1")) == 0
    assert redis_client.zcard(store.keys.shard_for("t1").queued) == 0
    # And a late delivery of the original is refused
    assert store.acquire("t1", "w").code is Code.FINISHED


def test_a_revoked_queued_task_leaves_the_index_at_the_next_pass(store, queued, redis_client):
    queued.enqueue(task())
    assert store.revoke("t1") is Code.OK
    assert store.get("t1").state == "revoked"
    _, published, _ = overdue(queued)
    assert published == []
    assert redis_client.zcard(store.keys.shard_for("t1").queued) == 0


def test_a_record_without_a_message_publish_is_republished_once(store, queued):
    # Given a publisher killed between the record and the publish: a record, no message
    queued.enqueue(task("lost"))
    # When the timeout passes, Then recovery publishes it (generation 1), once per period
    _, published, _ = overdue(queued)
    assert [p.task_id for p in published] == ["lost"]
    assert queued.recover(published.append).undelivered == 0


def test_a_corrupt_queued_record_is_reported_and_leaves_the_index(store, queued, redis_client):
    queued.enqueue(task("bad"))
    queued.enqueue(task("good"))
    redis_client.hset(store.keys.record("bad"), "generation", "x")
    report, published, _ = overdue(queued)
    assert [p.task_id for p in published] == ["good"]
    assert report.corrupt == 1
    assert redis_client.zscore(store.keys.shard_for("bad").queued, "bad") is None


def test_enqueue_many_is_one_round_trip_over_shards(redis_client, key_prefix):
    store = LeaseStore(redis_client, prefix=key_prefix, shards=4)
    queued = QueuedTasks(store, TIMEOUT)
    results = queued.enqueue_many([task(f"t{i}") for i in range(20)])
    assert results == [(Code.OK, "queued")] * 20
    assert queued.count() == 20
    assert {store.get(f"t{i}").state for i in range(20)} == {"queued"}
    _, published, _ = overdue(queued)
    assert sorted(p.task_id for p in published) == sorted(f"t{i}" for i in range(20))


def test_delivery_timeout_must_be_positive(store):
    with pytest.raises(ValueError, match="leases_delivery_timeout"):
        QueuedTasks(store, 0)


def test_forget_drops_only_a_queued_record_never_republished(store, queued, redis_client):
    # A queued record whose publish failed is dropped, with its message and index entry
    queued.enqueue(task("a"))
    assert queued.forget("a") is Code.OK
    assert store.get("a") is None and redis_client.exists(store.keys.message("a")) == 0
    assert queued.count() == 0
    assert queued.forget("a") is Code.MISSING
    # A re-published one (a copy may be in the broker) or an acquired one is left alone
    queued.enqueue(task("b"))
    overdue(queued)
    assert queued.forget("b") is Code.BUSY and store.get("b").generation == 1
    queued.enqueue(task("c"))
    store.acquire("c", "w")
    assert queued.forget("c") is Code.BUSY and store.get("c").state == "active"
