"""Parking on a real redis-server: a delivery that must not run is kept, listed, handed back, bounded."""
from __future__ import annotations

import time

import pytest
import redis

import celery_leases
from celery_leases import CorruptRecord, DeliveryParked, LeaseStore
from celery_leases.config import client_config
from celery_leases.recovery.parking import park_delivery


@pytest.fixture
def store(redis_server_url, key_prefix):
    s = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix)
    yield s
    s.client.close()


def test_park_lists_oldest_first_and_unpark_hands_back_body_and_envelope(store):
    # Given two deliveries parked one after the other
    store.park("t1", "corrupt record", name="proj.a", body=b"\x00body-1", envelope={"headers": {"id": "t1"}},
               key="k1", field="token")
    store.park("t2", "malformed message", name="proj.b", body=b"body-2")

    # Then both are listed, oldest first, with reason, key, field and server time, without bodies
    listed = store.parked()
    assert [p.task_id for p in listed] == ["t1", "t2"]
    first = listed[0]
    assert (first.reason, first.name, first.key, first.field) == ("corrupt record", "proj.a", "k1", "token")
    assert first.body == b"" and first.body_size == len(b"\x00body-1")
    assert abs(first.parked_at - store.server_time_ms()) < 5000

    # When t1 is unparked, Then it comes back whole, once
    back = store.unpark("t1")
    assert back.body == b"\x00body-1" and back.envelope == {"headers": {"id": "t1"}}
    assert store.unpark("t1") is None
    assert [p.task_id for p in store.parked()] == ["t2"]


def test_park_never_touches_the_lease_record(store):
    # Given a corrupt lease record
    key = store.keys.record("t1")
    store.client.hset(key, mapping={"state": "active", "token": "nope"})
    before = store.client.dump(key)
    # When the delivery is parked
    store.park("t1", "corrupt", key=key, field="token")
    # Then the record is byte-for-byte as it was
    assert store.client.dump(key) == before


def test_parking_again_counts_and_keeps_one_entry(store):
    store.park("t1", "first")
    store.park("t1", "second")
    (entry,) = store.parked()
    assert (entry.reason, entry.count) == ("second", 2)


def test_parked_entries_are_bounded_by_a_cap_and_a_retention(redis_server_url, key_prefix):
    # Given a store that keeps 3 parked entries for 0.3 s
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix,
                       parked_cap=3, parked_retention=0.3)
    for i in range(5):
        store.park(f"t{i}", "bad")
    # Then only the newest 3 are kept (index and bodies alike)
    assert [p.task_id for p in store.parked()] == ["t2", "t3", "t4"]
    assert store.client.hlen(store.keys.parked_body) == 3
    # And after the retention the next parking drops the old ones
    time.sleep(0.4)
    store.park("t9", "bad")
    assert [p.task_id for p in store.parked()] == ["t9"]
    assert store.client.hlen(store.keys.parked_meta) == 1


@pytest.mark.parametrize("which", ["parked", "parked_meta", "parked_body"])
def test_a_parking_key_of_the_wrong_type_is_named_and_nothing_is_written(store, which):
    bad = getattr(store.keys, which)
    store.client.set(bad, "x")
    others = [k for k in (store.keys.parked, store.keys.parked_meta, store.keys.parked_body) if k != bad]
    with pytest.raises(CorruptRecord) as err:
        store.park("t1", "corrupt")
    assert bad in str(err.value) and "type" in str(err.value) and err.value.key == bad
    assert store.client.get(bad) == b"x"
    assert all(not store.client.exists(k) for k in others)
    with pytest.raises(CorruptRecord):
        store.unpark("t1")


def test_park_delivery_stores_fails_waiters_signals_and_dead_letters(redis_server_url, key_prefix):
    from tests.support.apps.leased_app import create_app
    app = create_app({"LEASES_TEST_BROKER": redis_server_url, "LEASES_TEST_PREFIX": key_prefix,
                      "LEASES_TEST_DLQ": f"{key_prefix}-dlq"})
    seen = []

    def receiver(sender=None, **kwargs):
        seen.append((sender, kwargs))

    celery_leases.delivery_parked.connect(receiver, weak=False)
    try:
        # Given a message as the worker would have received it
        sig = app.signature("tests.support.apps.leased_app.add", (1, 2))
        task_id = "parked-1"
        body = b'[["x"], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
        envelope = {"headers": {"id": task_id, "task": sig.task}, "properties": {},
                    "content_type": "application/json", "content_encoding": "utf-8",
                    "exchange": "", "routing_key": key_prefix}
        # When it is parked
        park_delivery(app, celery_leases.store(app), task_id, "corrupt lease record",
                      dead_letter_queue=client_config(app).dead_letter_queue, name=sig.task, body=body,
                      envelope=envelope, key="k", field="generation")

        # Then the waiter gets DeliveryParked naming the task, key and field
        with pytest.raises(DeliveryParked) as err:
            app.AsyncResult(task_id).get(timeout=5)
        assert task_id in str(err.value) and "k" in str(err.value) and "generation" in str(err.value)
        # And it is listed in the store, with the message
        store = celery_leases.store(app)
        (entry,) = store.parked()
        assert (entry.task_id, entry.key, entry.field, entry.name) == (task_id, "k", "generation", sig.task)
        # And the signal told task id, reason, key and field, sent by the task
        (sender, kwargs) = [s for s in seen if s[1]["task_id"] == task_id][0]
        assert sender is app.tasks[sig.task]
        assert kwargs["key"] == "k" and kwargs["field"] == "generation"
        # And a copy went to the dead-letter queue, with why
        with app.connection_for_read() as conn:
            got = conn.SimpleQueue(f"{key_prefix}-dlq").get(timeout=5)
            assert got.headers["lease_parked"] == "corrupt lease record"
            assert got.body in (body, body.decode())
            got.ack()
    finally:
        celery_leases.delivery_parked.disconnect(receiver)
        app.close()


def test_park_delivery_goes_on_when_the_store_is_unreachable(redis_server_url, key_prefix, caplog):
    from tests.support.apps.leased_app import create_app
    app = create_app({"LEASES_TEST_BROKER": redis_server_url, "LEASES_TEST_PREFIX": key_prefix,
                      "LEASES_TEST_LEASES_URL": "redis://127.0.0.1:1/0"})
    try:
        park_delivery(app, celery_leases.store(app), "parked-2", "malformed message",
                      dead_letter_queue=client_config(app).dead_letter_queue, field="lease_generation")
        # The waiter is still released, and the log names the task
        with pytest.raises(DeliveryParked):
            app.AsyncResult("parked-2").get(timeout=5)
        assert any("parked-2" in r.getMessage() and "could not be stored" in r.getMessage()
                   for r in caplog.records)
    finally:
        app.close()
