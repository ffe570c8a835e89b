"""Publish tracking covers the copies recovery and retries publish, and bounds its own copies.

A real server: mark_published.lua and hand_over.lua put a ``recovering`` record waiting for
its delivery in the queued index (with publish tracking on), claim_undelivered.lua
re-publishes it like a ``queued`` one, and each consecutive undelivered re-publish waits
twice as long as the one before, up to ``QueuedTasks.backoff_cap`` delivery timeouts.
"""
from __future__ import annotations

import time

import pytest

from celery_leases import Code, LeaseStore
from celery_leases.protocol.queued import QueuedTask, QueuedTasks

TIMEOUT = 0.3
T_MS = int(TIMEOUT * 1000)


@pytest.fixture
def store(redis_client, key_prefix):
    return LeaseStore(redis_client, prefix=key_prefix, ttl=5, retention=60, publish_grace=0.2)


@pytest.fixture
def queued(store):
    # Built first, as tracking.attach does for every store: publish tracking is on for it.
    return QueuedTasks(store, TIMEOUT)


def index_of(store):
    return store.keys.shard_for("t1").queued


def recovered(store, redis_client, task_id="t1"):
    """A task acquired, its owner gone while running it (released as started), re-published
    by recovery and confirmed: recovering."""
    acq = store.acquire(task_id, "w", body=b"body", envelope={"headers": {"id": task_id}, "routing_key": "q"})
    store.release("w", {task_id: acq.token}, started={task_id})
    claims = []
    report = store.recover(publish=claims.append)
    assert report.recovered == 1 and [c.generation for c in claims] == [1]
    assert store.get(task_id).state == "recovering"
    return acq


def handed_over(store, countdown=0.0):
    """A task acquired whose owner retried: recovering, waiting for attempt 1."""
    acq = store.acquire("t1", "w", body=b"body", envelope={"headers": {"id": "t1"}, "routing_key": "q"})
    store.finish("t1", "w", acq.token, "retry", next_attempt=1,
                 retry_grace=countdown + store.settings.publish_grace)
    assert store.get("t1").state == "recovering"
    return acq


def make_overdue(redis_client, store, task_id="t1"):
    """Move the task's score into the past: its wait is over (no sleeping for it)."""
    redis_client.zadd(store.keys.shard_for(task_id).queued, {task_id: 1})


def claim_all(queued):
    published, expired = [], []
    report = queued.recover(published.append, expired.append)
    return report, published, expired


# -- a confirmed recovery re-publish waits in the queued index ---------------------------------

def test_a_confirmed_recovery_republish_waits_in_the_queued_index(store, queued, redis_client):
    # Given a recovered task whose re-publish was confirmed, with publish tracking on
    recovered(store, redis_client)
    now = store.server_time_ms()
    # Then it left the deadline index and waits in the queued index, due now + the timeout
    assert redis_client.zscore(store.keys.shard_for("t1").deadlines, "t1") is None
    assert abs(redis_client.zscore(index_of(store), "t1") - (now + T_MS)) < 200
    # And neither its record nor its message expires while it waits
    assert redis_client.pttl(store.keys.record("t1")) == -1
    assert redis_client.pttl(store.keys.message("t1")) == -1
    # And before the timeout nothing is re-published
    report, published, _ = claim_all(queued)
    assert published == [] and report.undelivered == 0


def test_a_lost_recovery_copy_is_republished_with_the_next_generation(store, queued, redis_client):
    # Given a recovered task (generation 1) whose copy the broker lost
    recovered(store, redis_client)
    # When the delivery timeout passes without a worker acquiring it
    time.sleep(TIMEOUT + 0.1)
    report, published, _ = claim_all(queued)
    # Then it is re-published once, generation 2, with its stored message, and counted
    assert [(p.task_id, p.code, p.generation, p.body) for p in published] == [("t1", Code.RECOVERED, 2, b"body")]
    assert report.undelivered == 1 and store.stats()["undelivered_republished"] == 1
    record = store.get("t1")
    assert (record.state, record.generation, record.recoveries) == ("recovering", 2, 1)
    # And only that copy may run: the lost copy of generation 1, if it was only late, is stale
    assert store.acquire("t1", "w2", generation=1).code is Code.STALE
    assert store.acquire("t1", "w2", generation=2).code is Code.ACQUIRED
    assert redis_client.zscore(index_of(store), "t1") is None


def test_without_tracking_a_confirmed_republish_is_not_indexed_and_expires(redis_client, key_prefix):
    # Given a store without publish tracking (delivery timeout 0)
    store = LeaseStore(redis_client, prefix=key_prefix, ttl=5, retention=60)
    recovered(store, redis_client)
    # Then the confirmed copy is in no index, and its record expires after the retention
    assert redis_client.zscore(index_of(store), "t1") is None
    assert 0 < redis_client.pttl(store.keys.record("t1")) <= 60_000


# -- a retry hand-over waits in the queued index -----------------------------------------------

def test_a_retry_hand_over_waits_for_its_countdown_plus_the_timeout(store, queued, redis_client):
    # Given an owner that retried with a 2 s countdown, with publish tracking on
    handed_over(store, countdown=2.0)
    now = store.server_time_ms()
    # Then the record waits in the queued index, due at the countdown, plus the timeout
    assert redis_client.zscore(store.keys.shard_for("t1").deadlines, "t1") is None
    assert abs(redis_client.zscore(index_of(store), "t1") - (now + 2000 + T_MS)) < 200
    assert abs(int(redis_client.hget(store.keys.record("t1"), "due")) - (now + 2000)) < 200
    # And the timeout alone passing re-publishes nothing: the retry is not due yet
    time.sleep(TIMEOUT + 0.1)
    report, published, _ = claim_all(queued)
    assert published == [] and report.undelivered == 0


def test_a_lost_retry_is_republished_and_runs_as_the_next_owner(store, queued, redis_client):
    # Given a retry hand-over (attempt 1) whose message the broker lost
    handed_over(store)
    time.sleep(TIMEOUT + 0.1)
    # When the wait is over
    report, published, _ = claim_all(queued)
    # Then the stored message is re-published with generation 1, its attempt reset
    # (the stored message is the retrying attempt's own: it carries retries 0)
    assert [(p.generation, p.body) for p in published] == [(1, b"body")]
    assert store.get("t1").attempt == 0
    # And the retry's own message, were it only late (generation 0, attempt 1), is stale
    assert store.acquire("t1", "w2", generation=0, attempt=1).code is Code.STALE
    assert store.acquire("t1", "w2", generation=1, attempt=0).code is Code.ACQUIRED


def test_a_delivered_retry_leaves_the_queued_index(store, queued, redis_client):
    handed_over(store)
    # When the next attempt is delivered and acquired
    assert store.acquire("t1", "w2", attempt=1).code is Code.ACQUIRED
    # Then nothing re-publishes it, even once its wait is over
    make_overdue(redis_client, store)
    report, published, _ = claim_all(queued)
    assert published == [] and redis_client.zscore(index_of(store), "t1") is None


# -- claim_undelivered on recovering records: not overdue, overdue, expired, corrupt ------------

def test_a_recovering_record_not_overdue_is_left_alone(store, queued, redis_client):
    recovered(store, redis_client)
    before = redis_client.hgetall(store.keys.record("t1"))
    rows = queued.claim(["t1"])
    assert rows == [] and redis_client.hgetall(store.keys.record("t1")) == before
    assert redis_client.zscore(index_of(store), "t1") is not None


def test_a_recovering_record_past_its_expires_is_revoked_not_republished(store, queued, redis_client):
    recovered(store, redis_client)
    redis_client.hset(store.keys.record("t1"), "expires", store.server_time_ms() - 1)
    make_overdue(redis_client, store)
    report, published, expired = claim_all(queued)
    assert published == [] and [(e.task_id, e.code, e.body) for e in expired] == [("t1", Code.FINISHED, b"body")]
    assert report.undelivered_expired == 1
    assert store.get("t1").state == "revoked"
    assert redis_client.exists(store.keys.message("t1")) == 0
    assert redis_client.zscore(index_of(store), "t1") is None
    assert 0 < redis_client.pttl(store.keys.record("t1")) <= 60_000
    assert store.acquire("t1", "w2", generation=1).code is Code.FINISHED


@pytest.mark.parametrize("field, value", [("generation", "two"), ("state", "lost")])
def test_a_corrupt_recovering_record_is_reported_and_leaves_the_index(store, queued, redis_client,
                                                                      field, value):
    recovered(store, redis_client)
    redis_client.hset(store.keys.record("t1"), field, value)
    before = redis_client.hgetall(store.keys.record("t1"))
    make_overdue(redis_client, store)
    report, published, _ = claim_all(queued)
    assert published == [] and report.corrupt == 1
    assert redis_client.zscore(index_of(store), "t1") is None
    assert redis_client.hgetall(store.keys.record("t1")) == before


def test_a_recovering_record_without_its_message_is_reported(store, queued, redis_client):
    recovered(store, redis_client)
    redis_client.delete(store.keys.message("t1"))
    make_overdue(redis_client, store)
    rows = queued.claim(["t1"])
    assert [(r.code, "body is missing" in str(r.error)) for r in rows] == [(Code.CORRUPT, True)]
    assert redis_client.zscore(index_of(store), "t1") is None


@pytest.mark.parametrize("state", ["active", "succeeded", "dead"])
def test_a_listed_record_no_longer_waiting_only_leaves_the_index(store, queued, redis_client, state):
    recovered(store, redis_client)
    acq = store.acquire("t1", "w2", generation=1)
    if state == "succeeded":
        store.finish("t1", "w2", acq.token, "succeeded")
    elif state == "dead":
        redis_client.hset(store.keys.record("t1"), "state", "dead")
    redis_client.zadd(index_of(store), {"t1": 1})  # a left-over entry
    before = redis_client.hgetall(store.keys.record("t1"))
    report, published, _ = claim_all(queued)
    assert published == [] and report.undelivered == 0
    assert redis_client.zscore(index_of(store), "t1") is None
    assert redis_client.hgetall(store.keys.record("t1")) == before


# -- the bound: each consecutive undelivered copy waits twice as long, up to the cap ------------

def waits_of(store, queued, redis_client, copies):
    """Claim ``copies`` consecutive times; the wait each claim set before the next copy, in
    delivery timeouts. The claim reads the server's clock somewhere between the readings
    taken before and after it (a loaded machine can take a good part of a timeout in
    between): the whole number of timeouts within that bracket, else the bracket itself."""
    waits = []
    for _ in range(copies):
        make_overdue(redis_client, store)
        before = store.server_time_ms()
        report, published, _ = claim_all(queued)
        after = store.server_time_ms()
        assert report.undelivered == 1
        due = redis_client.zscore(index_of(store), "t1")
        low, high = (due - after) / T_MS, (due - before) / T_MS
        whole = [n for n in range(1, 17) if low - 0.02 <= n <= high + 0.02]
        waits.append(whole[0] if len(whole) == 1 else (round(low, 2), round(high, 2)))
    return waits


def test_each_consecutive_undelivered_copy_waits_twice_as_long_up_to_the_cap(store, queued, redis_client):
    # Given a task recorded at publish that no worker ever acquires
    queued.enqueue(QueuedTask("t1", "proj.add", b"body", {"headers": {"id": "t1"}}))
    # When its copies keep being lost
    waits = waits_of(store, queued, redis_client, 6)
    # Then the nth copy waits timeout * 2^(n-1), at most backoff_cap (8) timeouts
    assert waits == [1, 2, 4, 8, 8, 8]
    record = store.get("t1")
    assert (record.state, record.generation, record.recoveries) == ("queued", 6, 0)
    assert redis_client.hget(store.keys.record("t1"), "undelivered_streak") == b"6"
    assert store.stats()["undelivered_republished"] == 6


def test_the_backoff_of_a_recovering_record_starts_again_after_each_delivery(store, queued, redis_client):
    # Given a recovered task whose copies were lost three times
    recovered(store, redis_client)
    assert waits_of(store, queued, redis_client, 3) == [1, 2, 4]
    # When a copy is finally delivered, and that owner dies and recovery re-publishes again
    acq = store.acquire("t1", "w2", generation=4)
    assert acq.code is Code.ACQUIRED
    store.release("w2", {"t1": acq.token})
    assert store.recover(publish=lambda claim: None).recovered == 1
    # Then the streak was reset: the next lost copy waits one timeout again
    assert redis_client.hget(store.keys.record("t1"), "undelivered_streak") == b"0"
    assert waits_of(store, queued, redis_client, 2) == [1, 2]
