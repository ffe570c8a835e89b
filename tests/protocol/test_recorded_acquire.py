"""An acquire that leaves the message out because its publisher recorded it (acquire.lua ARGV[14]).

A real server: the store must keep the message recorded at publish when it is
this publish's, answer NO_MESSAGE (nothing written) when it is not, and
``LeaseStore.acquire`` must then send the message, so a lease never lacks the
message its recovery re-publishes.
"""
from __future__ import annotations

import pytest

from celery_leases import Code, LeaseStore
from celery_leases.protocol.admin import expire_now
from celery_leases.protocol.queued import QueuedTask, QueuedTasks
from celery_leases.protocol.transitions import AcquireRequest, acquire_call

RECORDED_BODY, DELIVERED_BODY = b"recorded-at-publish", b"as-delivered"
ENVELOPE = {"headers": {"id": "t1"}, "routing_key": "q"}


@pytest.fixture
def store(redis_client, key_prefix):
    store = LeaseStore(redis_client, prefix=key_prefix, ttl=5, retention=60)
    store.acquire("warm-up", "w")  # the script is loaded: each call below is one EVALSHA
    return store


@pytest.fixture
def queued(store):
    return QueuedTasks(store, 30)


def script_calls(client) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))


def acquire(store, **kw):
    call = dict(name="proj.add", body=DELIVERED_BODY, envelope=ENVELOPE, publish="p1", recorded=True)
    return store.acquire("t1", "w", **{**call, **kw})


def stored(client, store, task_id="t1"):
    return client.hgetall(store.keys.message(task_id))


def test_a_recorded_publish_is_acquired_in_one_call_and_keeps_the_recorded_message(store, queued, redis_client):
    queued.enqueue(QueuedTask("t1", "proj.add", RECORDED_BODY, ENVELOPE, publish="p1"))
    before = script_calls(redis_client)
    acq = acquire(store)
    assert script_calls(redis_client) - before == 1
    assert acq.code is Code.ACQUIRED and store.get("t1").state == "active"
    assert stored(redis_client, store)[b"body"] == RECORDED_BODY
    # And once the lease expires, recovery re-publishes the recorded message
    expire_now(store, "t1")
    claims = []
    store.recover(claims.append)
    assert [(c.task_id, c.body, c.envelope["routing_key"]) for c in claims] == [("t1", RECORDED_BODY, "q")]
    # and its recovered copy (generation 1, same publish id) is acquired without the message too
    before = script_calls(redis_client)
    acq = acquire(store, generation=1)
    assert acq.code is Code.ACQUIRED and acq.generation == 1
    assert script_calls(redis_client) - before == 1
    assert stored(redis_client, store)[b"body"] == RECORDED_BODY


@pytest.mark.parametrize("setup", ["no record", "another publish recorded", "message gone"])
def test_without_this_publishs_message_the_acquire_sends_it(store, queued, redis_client, setup):
    if setup == "another publish recorded":  # e.g. a retry, whose record keeps the first message
        queued.enqueue(QueuedTask("t1", "proj.add", RECORDED_BODY, ENVELOPE, publish="p0"))
    elif setup == "message gone":
        queued.enqueue(QueuedTask("t1", "proj.add", RECORDED_BODY, ENVELOPE, publish="p1"))
        redis_client.delete(store.keys.message("t1"))
    before = script_calls(redis_client)
    acq = acquire(store)
    # Then it costs a second call, which stores the delivered message and its publish id
    assert script_calls(redis_client) - before == 2
    assert acq.code is Code.ACQUIRED and store.get("t1").state == "active"
    assert stored(redis_client, store) == {
        b"body": DELIVERED_BODY, b"envelope": b'{"headers":{"id":"t1"},"routing_key":"q"}', b"pub": b"p1"}
    # And a recovery re-publishes what was delivered
    expire_now(store, "t1")
    claims = []
    store.recover(claims.append)
    assert [c.body for c in claims] == [DELIVERED_BODY]


def test_no_message_writes_nothing(store, redis_client):
    # The script's own answer, before LeaseStore sends the message
    script, keys, args = acquire_call(store, AcquireRequest("t1", "w", name="proj.add", body=DELIVERED_BODY,
                                                            envelope=ENVELOPE, publish="p1", recorded=True))
    assert args[8] == b"" and args[9] == "" and args[13] == 1  # the message is not sent (ARGV[14])
    keys_before, stats_before = sorted(redis_client.keys("*")), store.stats()
    assert keys_before  # (the warm-up's)
    reply = store.calls.run(script, keys, args, "test")
    assert reply[0] == Code.NO_MESSAGE
    assert sorted(redis_client.keys("*")) == keys_before and store.stats() == stats_before


def test_a_new_publish_of_a_finished_task_runs_again_once(store, queued, redis_client):
    queued.enqueue(QueuedTask("t1", "proj.add", RECORDED_BODY, ENVELOPE, publish="p1"))
    acq = acquire(store)
    store.finish("t1", "w", acq.token, "succeeded")
    # A frozen signature applied again: a new publish id, its record (finished) not overwritten
    assert queued.enqueue(QueuedTask("t1", "proj.add", RECORDED_BODY, ENVELOPE, publish="p2"))[0] is Code.FINISHED
    acq = acquire(store, publish="p2")
    assert acq.code is Code.ACQUIRED
    assert store.stats().get("rerun") == 1  # the NO_MESSAGE answer decided nothing
    assert stored(redis_client, store)[b"pub"] == b"p2"


def test_a_refused_copy_is_refused_with_the_message_too(store, queued):
    queued.enqueue(QueuedTask("t1", "proj.add", RECORDED_BODY, ENVELOPE, publish="p1"))
    assert acquire(store).code is Code.ACQUIRED
    # A second copy of the same publish while the lease is live: busy, one call
    assert acquire(store).code is Code.BUSY
    # A copy of a publish the store does not hold (no message for it): still refused
    assert acquire(store, publish="p9").code is Code.BUSY
    assert store.get("t1").state == "active"


def test_a_recovering_message_with_an_expiry_loses_it_when_acquired(store, redis_client):
    # Recovery without publish tracking keeps a re-published message only for the retention
    store.acquire("t1", "w", name="proj.add", body=DELIVERED_BODY, envelope=ENVELOPE, publish="p1")
    expire_now(store, "t1")
    store.recover(lambda claim: None)
    message = store.keys.message("t1")
    assert store.get("t1").state == "recovering" and redis_client.pttl(message) > 0
    acq = acquire(store, generation=1)
    assert acq.code is Code.ACQUIRED
    assert redis_client.pttl(message) == -1 and redis_client.pttl(store.keys.record("t1")) == -1


def test_a_reassert_always_sends_the_message(store):
    _, _, args = acquire_call(store, AcquireRequest("t1", "w", body=DELIVERED_BODY, envelope=ENVELOPE,
                                                    publish="p1", recorded=True, reassert=7))
    assert args[8] == DELIVERED_BODY


def test_a_message_key_of_the_wrong_type_is_corrupt_not_missing(store, queued, redis_client):
    from celery_leases.exceptions import CorruptRecord
    queued.enqueue(QueuedTask("t1", "proj.add", RECORDED_BODY, ENVELOPE, publish="p1"))
    message = store.keys.message("t1")
    redis_client.delete(message)
    redis_client.set(message, "not a hash")
    with pytest.raises(CorruptRecord) as corrupt:
        acquire(store)
    assert corrupt.value.key == message and corrupt.value.field == "type"
    assert store.get("t1").state == "queued"  # nothing written
